"""The simulated NIC's VF settings: the MAC and VLAN its PF's driver holds for each VF.

A real PF's driver keeps each VF's administrative MAC and VLAN (what `ip link show <pf>` lists per
`vf <n>`) until they are set again or the host reboots, whoever used the VF last; the agent reads and
sets them over netlink (`agent.host.vfio.sriov`). The simulated NIC has no netlink device, so its PF's
driver keeps them here: one file per VF, `<root>/sriov/<pf interface>/vf<n>` (JSON), under the
simulated machine's root, where they outlive an agent process as on a host. A VF without a file has
what a fresh boot gives it: no MAC (zeros) and no VLAN. A simulated reboot forgets them all
(`forget`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson

from agent.fsutil import atomic_write, makedirs
from agent.host.vfio.errors import VfioError
from agent.host.vfio.sriov import VfLink


class SimVfLinks:
    """`VfLinks` of the simulated machine rooted at `root`."""

    def __init__(self, root: Path) -> None:
        self.top = root / "sriov"

    def _path(self, ifname: str, vf: int) -> Path:
        if not ifname or "/" in ifname or ifname in (".", ".."):
            raise VfioError(f"no simulated PF interface {ifname!r}")
        return self.top / ifname / f"vf{vf}"

    def get(self, ifname: str, vf: int) -> VfLink:
        try:
            raw = self._path(ifname, vf).read_bytes()
        except FileNotFoundError:
            return VfLink()
        return VfLink.from_wire(orjson.loads(raw))

    def set(self, ifname: str, vf: int, link: VfLink, *, with_mac: bool = True) -> None:
        path = self._path(ifname, vf)
        if not with_mac:
            link = VfLink(self.get(ifname, vf).mac, link.vlan, link.qos)
        makedirs(path.parent, 0o700)
        atomic_write(path, orjson.dumps(link.wire()), 0o600, durable=True)

    def all(self) -> dict[tuple[str, int], VfLink]:
        """Every VF with settings other than a fresh boot's, by (PF interface, VF index)."""
        out: dict[tuple[str, int], VfLink] = {}
        try:
            pfs = os.listdir(self.top)
        except FileNotFoundError:
            return out
        for ifname in pfs:
            for name in os.listdir(self.top / ifname):
                if name.startswith("vf") and name[2:].isdigit():
                    link = self.get(ifname, int(name[2:]))
                    if link != VfLink():
                        out[(ifname, int(name[2:]))] = link
        return out

    def forget(self) -> None:
        """A reboot: every VF as a fresh boot gives it."""
        shutil.rmtree(self.top, ignore_errors=True)

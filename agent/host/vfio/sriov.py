"""A VF's MAC address and VLAN, read and set through its PF before the VF goes to a VM (`ip link show
<pf>` / `ip link set <pf> vf <n> mac ... vlan ...`), over netlink with pyroute2: the guest's driver
then sees the MAC the claim asked for, and KubeVirt's SR-IOV networks rely on a known MAC. The VF
itself cannot be asked once bound to vfio-pci; the PF's driver keeps the setting for it, across
tenants, until it is set again: so prepare reads what the VF had before changing it (the claim's
record holds it before the change), and unprepare puts it back.

`VfLinks` is where the PF's driver keeps its VFs' settings, the seam between prepare and the machine:
`NetlinkVfLinks` on a host; the simulated machine, its NIC having no netlink device, keeps them in
files. `agent.app.assembly.vf_links` chooses which one prepare is given."""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.host.vfio.errors import VfioError
from agent.host.vfio.pci import function_dir, physical_function, virtual_functions

log = logging.getLogger(__name__)

NO_MAC = "00:00:00:00:00:00"  # a VF without an administrative MAC (the kernel shows zeros)


@dataclass(frozen=True, slots=True)
class VfLink:
    """A VF's settings as its PF's driver holds them."""

    mac: str = NO_MAC  # lower case
    vlan: int = 0  # 0: none
    qos: int = 0  # the VLAN's 802.1p priority

    def wire(self) -> dict[str, Any]:
        return {"mac": self.mac, "vlan": self.vlan, "qos": self.qos}

    @classmethod
    def from_wire(cls, raw: object) -> VfLink:
        if not (isinstance(raw, dict) and set(raw) == {"mac", "vlan", "qos"} and isinstance(raw["mac"], str)
                and type(raw["vlan"]) is int and type(raw["qos"]) is int):
            raise ValueError(f"not a VF's MAC and VLAN: {raw!r}"[:200])
        return cls(raw["mac"], raw["vlan"], raw["qos"])

    def changed(self, mac: str, vlan: int | None) -> VfLink:
        """These settings with a claim's MAC ("" leaves it) and VLAN (None leaves it; 0 clears it) applied."""
        if vlan is None:
            return VfLink(mac or self.mac, self.vlan, self.qos)
        return VfLink(mac or self.mac, vlan, 0)


class VfLinks(Protocol):
    """The VF settings a PF's driver holds, by the PF's interface name and the VF's index there. `set`
    sends the MAC only `with_mac`: a driver may refuse a MAC of zeros (none), which a VF left as it was
    must never be asked to take."""

    def get(self, ifname: str, vf: int) -> VfLink: ...

    def set(self, ifname: str, vf: int, link: VfLink, *, with_mac: bool) -> None: ...


def vf_position(sysfs: Path, bdf: str) -> tuple[str, int]:
    """The VF's PF and its index there (`virtfn<n>`); VfioError for a function that is not a VF."""
    pf = physical_function(sysfs, bdf)
    if pf is None:
        raise VfioError(f"PCI function {bdf} is not an SR-IOV VF: only a VF takes a MAC or VLAN through its PF")
    vfs = virtual_functions(sysfs, pf)
    if bdf not in vfs:
        raise VfioError(f"PCI function {bdf} is not among the enabled VFs of its PF {pf}")
    return pf, vfs.index(bdf)


def pf_interface(sysfs: Path, pf: str) -> str:
    try:
        names = sorted(os.listdir(function_dir(sysfs, pf) / "net"))
    except OSError:
        names = []
    if not names:
        raise VfioError(f"the PF {pf} has no network interface (not bound to its NIC driver?): "
                        "its VFs' MAC and VLAN cannot be set")
    return names[0]


def read_vf(sysfs: Path, links: VfLinks, bdf: str) -> VfLink:
    """VF `bdf`'s MAC and VLAN now, from its PF."""
    pf, n = vf_position(sysfs, bdf)
    return links.get(pf_interface(sysfs, pf), n)


def set_vf(sysfs: Path, links: VfLinks, bdf: str, link: VfLink, *, with_mac: bool) -> None:
    """Give VF `bdf` this VLAN, and this MAC `with_mac`, through its PF (idempotent)."""
    pf, n = vf_position(sysfs, bdf)
    ifname = pf_interface(sysfs, pf)
    links.set(ifname, n, link, with_mac=with_mac)
    log.info("set VF %d of %s (%s): %svlan %d qos %d", n, ifname, bdf, f"mac {link.mac} " if with_mac else "",
             link.vlan, link.qos)


class NetlinkVfLinks:
    """The host's: RTM_GETLINK with the VF list (RTEXT_FILTER_VF), and RTM_SETLINK's IFLA_VFINFO_LIST."""

    def get(self, ifname: str, vf: int) -> VfLink:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with IPRoute() as ipr:
                msgs = ipr.link("get", index=self._index(ipr, ifname), ext_mask=1)  # 1: RTEXT_FILTER_VF
        except NetlinkError as exc:
            raise VfioError(f"reading the VFs of {ifname} failed: {exc}") from exc
        return vf_link_of(msgs[0] if msgs else None, ifname, vf)

    def set(self, ifname: str, vf: int, link: VfLink, *, with_mac: bool) -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        spec: dict[str, object] = {"vf": vf, "vlan": link.vlan, "qos": link.qos}
        if with_mac:
            spec["mac"] = link.mac
        try:
            with IPRoute() as ipr:
                index = self._index(ipr, ifname)
                try:
                    ipr.link("set", index=index, vf=spec)
                except NetlinkError as exc:
                    if not (with_mac and link.mac == NO_MAC and exc.code == errno.EINVAL):
                        raise
                    # Some PF drivers take no MAC of zeros (a VF without an administrative MAC): the VLAN
                    # is put back, the MAC the claim gave stays.
                    log.warning("the driver of %s refuses to clear VF %d's MAC (%s): it keeps the one it has",
                                ifname, vf, exc)
                    ipr.link("set", index=index, vf={k: v for k, v in spec.items() if k != "mac"})
        except NetlinkError as exc:
            what = f"mac {link.mac} vlan {link.vlan}" if with_mac else f"vlan {link.vlan}"
            raise VfioError(f"setting VF {vf} of {ifname} to {what} failed: {exc}") from exc

    @staticmethod
    def _index(ipr: Any, ifname: str) -> int:
        found = ipr.link_lookup(ifname=ifname)
        if not found:
            raise VfioError(f"the PF's interface {ifname} is not in this network namespace")
        return int(found[0])


def vf_link_of(msg: Any, ifname: str, vf: int) -> VfLink:
    """VF `vf`'s settings in an RTM_NEWLINK message of its PF (asked for with RTEXT_FILTER_VF)."""
    vfs = msg.get_attr("IFLA_VFINFO_LIST") if msg is not None else None
    for info in vfs.get_attrs("IFLA_VF_INFO") if vfs is not None else ():
        mac, vlan = info.get_attr("IFLA_VF_MAC"), info.get_attr("IFLA_VF_VLAN")
        if mac is not None and mac["vf"] == vf:
            return VfLink(str(mac["mac"]).lower(), int(vlan["vlan"]) if vlan else 0, int(vlan["qos"]) if vlan else 0)
    raise VfioError(f"the kernel reports no VF {vf} of {ifname} (not an SR-IOV PF, or its VFs are not enabled): "
                    "its MAC and VLAN cannot be read")

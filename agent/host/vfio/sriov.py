"""A VF's MAC address and VLAN, set through its PF before the VF goes to a VM (`ip link set <pf> vf <n>
mac ... vlan ...`), over netlink with pyroute2: the guest's driver then sees the MAC the claim asked
for, and KubeVirt's SR-IOV networks rely on a known MAC. The VF itself cannot be asked once bound to
vfio-pci; the PF's driver keeps the setting for it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from agent.host.vfio.errors import VfioError
from agent.host.vfio.pci import function_dir, physical_function, virtual_functions

log = logging.getLogger(__name__)


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


def set_vf_mac_vlan(sysfs: Path, bdf: str, mac: str, vlan: int, *, simulated: bool) -> None:
    """Set the VF's MAC (when given) and VLAN (0 clears it) through its PF. On the simulated machine
    there is no netlink device behind the PF: the request is checked as on a host and logged, not sent."""
    pf, n = vf_position(sysfs, bdf)
    ifname = pf_interface(sysfs, pf)
    what = " ".join(filter(None, (f"mac {mac}" if mac else "", f"vlan {vlan}")))
    if simulated:
        log.info("simulated machine: not setting VF %d of %s (%s, VF %s): %s (no netlink device behind "
                 "a simulated NIC)", n, ifname, pf, bdf, what)
        return
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    spec: dict[str, object] = {"vf": n, "vlan": vlan}
    if mac:
        spec["mac"] = mac
    try:
        with IPRoute() as ipr:
            found = ipr.link_lookup(ifname=ifname)
            if not found:
                raise VfioError(f"the PF {pf}'s interface {ifname} is not in this network namespace")
            ipr.link("set", index=found[0], vf=spec)
    except NetlinkError as exc:
        raise VfioError(f"setting VF {n} of {ifname} ({bdf}) to {what} failed: {exc}") from exc
    log.info("set VF %d of %s (%s): %s", n, ifname, bdf, what)

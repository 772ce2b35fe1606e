"""A VF's MAC and VLAN as its PF reports them over netlink (`agent.host.vfio.sriov`): the message the
kernel sends for `ip link show <pf>` (RTEXT_FILTER_VF), and a real link without VFs answering a read
and a write with a precise error. (This machine has no SR-IOV NIC: the round trip of a set and a read
through a PF runs on the simulated machine, tests/test_vfio_prepare.py.)"""

from __future__ import annotations

import pytest
from netns import network_namespace
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from agent.host.vfio.errors import VfioError
from agent.host.vfio.sriov import VfLink, vf_link_of


def _pf_message(*vfs: tuple[int, str, int, int]) -> ifinfmsg:
    """An RTM_NEWLINK of a PF as the kernel encodes it, with one IFLA_VF_INFO per VF."""
    msg = ifinfmsg()
    msg["index"] = 7
    msg["attrs"] = [("IFLA_IFNAME", "pf0"), ("IFLA_VFINFO_LIST", {"attrs": [
        ("IFLA_VF_INFO", {"attrs": [("IFLA_VF_MAC", {"vf": n, "mac": mac}),
                                    ("IFLA_VF_VLAN", {"vf": n, "vlan": vlan, "qos": qos})]})
        for n, mac, vlan, qos in vfs]})]
    msg.encode()
    wire = ifinfmsg(msg.data)
    wire.decode()
    return wire


def test_a_vfs_settings_are_read_from_its_pfs_message() -> None:
    msg = _pf_message((0, "02:00:00:00:00:AA", 100, 2), (1, "00:00:00:00:00:00", 0, 0))
    assert vf_link_of(msg, "pf0", 0) == VfLink("02:00:00:00:00:aa", 100, 2)
    assert vf_link_of(msg, "pf0", 1) == VfLink()
    with pytest.raises(VfioError, match="the kernel reports no VF 2 of pf0"):
        vf_link_of(msg, "pf0", 2)


def test_changed_applies_only_what_the_claim_asked() -> None:
    tenant = VfLink("02:00:00:00:0e:01", 100, 2)
    assert tenant.changed("", None) == tenant
    assert tenant.changed("", 0) == VfLink(tenant.mac, 0, 0)
    assert tenant.changed("02:aa:bb:cc:dd:01", None) == VfLink("02:aa:bb:cc:dd:01", 100, 2)
    assert tenant.changed("02:aa:bb:cc:dd:01", 42) == VfLink("02:aa:bb:cc:dd:01", 42, 0)


def test_a_link_without_vfs_answers_read_and_write_with_a_precise_error() -> None:
    """Over real netlink, in a namespace: a veth has no VFs to read, and refuses a VF setting."""
    code = """
from agent.host.vfio.errors import VfioError
from agent.host.vfio.sriov import NetlinkVfLinks, VfLink
links = NetlinkVfLinks()
for op in (lambda: links.get("pf0", 0), lambda: links.set("pf0", 0, VfLink(vlan=5), with_mac=True),
           lambda: links.set("pf0", 0, VfLink(vlan=5), with_mac=False), lambda: links.get("none0", 0)):
    try:
        op()
        print("no error")
    except VfioError as exc:
        print(exc)
"""
    with network_namespace() as ns:
        ns.veth("pf0", "peer0")
        got = ns.python(code).splitlines()
    assert got[0] == ("the kernel reports no VF 0 of pf0 (not an SR-IOV PF, or its VFs are not enabled): its MAC "
                      "and VLAN cannot be read")
    assert got[1].startswith("setting VF 0 of pf0 to mac 00:00:00:00:00:00 vlan 5 failed:")
    assert got[2].startswith("setting VF 0 of pf0 to vlan 5 failed:")
    assert got[3] == "the PF's interface none0 is not in this network namespace"

"""NIC discovery over real netlink and sysfs, in network namespaces the tests make.

Discovery runs inside the namespace (`ip netns exec`, which also mounts that
namespace's sysfs), so what it reports is what the agent would report on a
node with those interfaces. Hardware the test machine lacks (SR-IOV PFs and
VFs, RDMA, multi-port functions) is a sysfs tree of our own, pointing at
interfaces that really exist in the namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conftest import need_command, need_root
from netns import FakeSysfs, NetNS, discover, exactly, network_namespace, next_matching

from agent.apirules import device_wire_errors
from agent.config import Settings
from agent.inventory.netwatch import (
    ADDRESS_ADDED,
    ADDRESS_REMOVED,
    LINK_ADDED,
    LINK_CHANGED,
    LINK_REMOVED,
    RESYNC,
    NetEvent,
    NetlinkWatcher,
    debounced,
)
from agent.inventory.nics import NicSource, mac_device_name, pci_device_name

PCI = "resource.kubernetes.io/pciBusID"
ROOT = "resource.kubernetes.io/pcieRoot"
NUMA = "resource.kubernetes.io/numaNode"


@pytest.fixture
def ns() -> Iterator[NetNS]:
    need_root()
    need_command("ip")
    with network_namespace("dra-nic") as made:
        yield made


# -- names ----------------------------------------------------------------


def test_device_names_are_dns_labels_from_pci_address_or_mac() -> None:
    assert pci_device_name("0000:3b:00.1", 0) == "nic-0000-3b-00-1"
    assert pci_device_name("0000:3b:00.1", 2) == "nic-0000-3b-00-1-p2"
    assert mac_device_name("02:A1:b2:c3:d4:e5") == "nic-mac-02a1b2c3d4e5"
    # InfiniBand hardware addresses are 20 bytes: too long for a label, so hashed, stably.
    ib = ":".join(["80"] + ["fe"] * 19)
    assert len(mac_device_name(ib)) <= 63
    assert mac_device_name(ib) == mac_device_name(ib.upper())
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", mac_device_name(ib))


# -- veth pairs in a namespace: netlink facts --------------------------------


def test_interface_facts_from_netlink(ns: NetNS) -> None:
    ns.veth("va", "vb")
    ns.ip("link", "set", "va", "address", "02:a1:b2:c3:d4:e5")
    ns.ip("link", "set", "va", "mtu", "1400")
    ns.ip("addr", "add", "10.0.0.5/24", "dev", "va")
    ns.ip("addr", "add", "10.0.0.6/24", "dev", "va")
    ns.ip("addr", "add", "fd00::5/64", "dev", "va", "nodad")
    ns.ip("addr", "add", "fe80::5/64", "dev", "va", "nodad")  # link scope: never published

    scan = discover(ns, nic_include="va")

    assert list(scan.by_ifname) == ["va"]  # vb and lo are software links and not asked for
    dev = scan.by_ifname["va"]
    assert dev["name"] == "nic-mac-02a1b2c3d4e5"
    assert dev["kind"] == "nic"
    assert dev["capacity"] == {}
    attrs = scan.attrs("va")
    assert attrs == {
        "type": "nic",
        "ifName": "va",
        "macAddress": "02:a1:b2:c3:d4:e5",
        "mtu": 1400,
        "linkUp": True,
        "uplink": False,
        "speedMbps": 10000,  # what veth reports in sysfs while it is up
        "isVf": False,
        "rdma": False,
        "ipv4": "10.0.0.5/24",
        "ipv6": "fd00::5/64",
    }
    assert dev["attributes"]["mtu"] == {"int": 1400}
    assert dev["attributes"]["linkUp"] == {"bool": True}
    assert dev["node"] == {"interface": "va", "mac": "02:a1:b2:c3:d4:e5",
                           "ips": ["10.0.0.5/24", "10.0.0.6/24", "fd00::5/64"], "uplink": ""}


LIST_LINKS = """
import json
from agent.inventory import netlink
links, addresses = netlink.dump()
print(json.dumps({"links": {l.ifname: [l.index, l.mac, l.mtu, l.kind] for l in links},
                  "addresses": {str(i): sorted(a.cidr for a in found) for i, found in addresses.items()}}))
"""


def test_a_dump_of_many_links_lists_each_as_ip_does(ns: NetNS) -> None:
    # 300 links and 300 addresses: each dump spans many datagrams, the way a busy node's does.
    ns.batch(f"link add d{i} type veth peer name p{i}" for i in range(150))
    ns.batch(f"addr add 10.{i % 150}.{i // 150}.1/24 dev {'dp'[i // 150]}{i % 150}" for i in range(300))
    out = json.loads(ns.python(LIST_LINKS))
    want = {name: [link["ifindex"], link["address"] if name != "lo" else "", link["mtu"],
                   link.get("linkinfo", {}).get("info_kind", "")]
            for name, link in ((link["ifname"], link) for link in json.loads(ns.ip("-d", "-j", "link", "show")))}
    assert out["links"] == want and len(want) == 301
    addresses = {str(a["ifindex"]): sorted(f"{i['local']}/{i['prefixlen']}" for i in a["addr_info"])
                 for a in json.loads(ns.ip("-j", "addr", "show")) if a["addr_info"]}
    assert out["addresses"] == addresses and len(addresses) == 300


def test_link_up_needs_admin_up_and_carrier(ns: NetNS) -> None:
    ns.veth("va", "vb", up=False)
    ns.ip("link", "set", "va", "up")  # the peer is down: no carrier
    assert discover(ns, nic_include="va").attrs("va")["linkUp"] is False

    ns.ip("link", "set", "vb", "up")
    assert discover(ns, nic_include="va").attrs("va")["linkUp"] is True

    ns.ip("link", "set", "va", "down")
    assert discover(ns, nic_include="va").attrs("va")["linkUp"] is False


def test_rename_keeps_the_device_name(ns: NetNS) -> None:
    ns.veth("va", "vb", up=False)
    before = discover(ns, nic_include="v*").by_ifname["va"]["name"]
    ns.ip("link", "set", "va", "name", "vrenamed")
    scan = discover(ns, nic_include="v*")
    assert "va" not in scan.by_ifname
    assert scan.by_ifname["vrenamed"]["name"] == before
    assert scan.attrs("vrenamed")["ifName"] == "vrenamed"


def test_software_links_only_when_included_and_exclude_wins(ns: NetNS) -> None:
    ns.veth("va", "vb")
    ns.veth("wa", "wb")
    ns.ip("link", "set", "lo", "up")

    assert discover(ns).devices == []
    # lo has no hardware address, so even "*" cannot give it a stable name.
    assert sorted(discover(ns, nic_include="*").by_ifname) == ["va", "vb", "wa", "wb"]
    assert sorted(discover(ns, nic_include="v*,wa").by_ifname) == ["va", "vb", "wa"]
    assert sorted(discover(ns, nic_include="*", nic_exclude="vb,w*").by_ifname) == ["va"]
    assert discover(ns, nic_include="va", nic_exclude="v*").devices == []


# -- PCI hardware: a sysfs tree of our own for interfaces of the namespace ------


def sriov_tree(tmp_path: Path, ns: NetNS) -> FakeSysfs:
    """An RDMA-capable SR-IOV PF with one VF enabled, and a two-port function without NUMA affinity."""
    for name in ("pf0", "vf0", "p0", "p1"):
        ns.veth(name, f"{name}x")
    fake = FakeSysfs(tmp_path / "sys", ns)
    bridge = ("pci0000:3a", "0000:3a:00.0")
    pf = fake.function(*bridge, "0000:3b:00.0", vendor="0x15b3", device="0x101d", numa=1, driver="mlx5_core",
                       sriov_totalvfs="8", sriov_numvfs="1")
    vf = fake.function(*bridge, "0000:3b:00.2", vendor="0x15b3", device="0x101e", numa=1, driver="mlx5_core")
    os.symlink(vf, pf / "virtfn0")
    os.symlink(pf, vf / "physfn")
    (pf / "infiniband" / "mlx5_0").mkdir(parents=True)
    (vf / "infiniband" / "mlx5_1").mkdir(parents=True)
    fake.netdev(pf, "pf0")
    fake.netdev(vf, "vf0")
    dual = fake.function("pci0000:5d", "0000:5d:00.0", "0000:5e:00.0", vendor="0x8086", device="0x1572",
                         numa=-1, driver="i40e")
    fake.netdev(dual, "p0", dev_port=0)
    fake.netdev(dual, "p1", dev_port=1, speed="-1")
    return fake


HW = "pf0,vf0,p0,p1"  # veths stand in for the hardware's netdevs: software links by kind, so named


def test_sriov_pf_vf_rdma_and_ports_from_sysfs(ns: NetNS, tmp_path: Path) -> None:
    fake = sriov_tree(tmp_path, ns)

    scan = discover(ns, sysfs_root=str(fake.root), nic_include=HW)

    assert scan.failed_devices == {} and scan.problems == {}
    assert {d["node"]["interface"]: d["name"] for d in scan.devices} == {
        "pf0": "nic-0000-3b-00-0",
        "vf0": "nic-0000-3b-00-2",
        "p0": "nic-0000-5e-00-0",
        "p1": "nic-0000-5e-00-0-p1",
    }
    pf = scan.attrs("pf0")
    assert {k: pf[k] for k in ("sriovTotalVfs", "sriovNumVfs", "isVf", "rdma", "driver", "pciVendor",
                               "pciDevice", "speedMbps", PCI, ROOT, NUMA)} == {
        "sriovTotalVfs": 8, "sriovNumVfs": 1, "isVf": False, "rdma": True, "driver": "mlx5_core",
        "pciVendor": "0x15b3", "pciDevice": "0x101d", "speedMbps": 100000,
        PCI: "0000:3b:00.0", ROOT: "pci0000:3a", NUMA: 1,
    }
    assert "pfName" not in pf
    assert pf["macAddress"] == fake.links["pf0"]["address"]

    vf = scan.attrs("vf0")
    assert vf["isVf"] is True
    assert vf["pfName"] == "pf0"
    assert vf["rdma"] is True
    assert (vf[PCI], vf[ROOT], vf[NUMA]) == ("0000:3b:00.2", "pci0000:3a", 1)
    assert "sriovTotalVfs" not in vf and "sriovNumVfs" not in vf

    for port in ("p0", "p1"):
        attrs = scan.attrs(port)
        assert attrs[PCI] == "0000:5e:00.0"
        assert attrs[ROOT] == "pci0000:5d"
        assert NUMA not in attrs  # sysfs says -1: no affinity
        assert attrs["isVf"] is False and attrs["rdma"] is False
        assert attrs["driver"] == "i40e"
    assert "speedMbps" not in scan.attrs("p1")


def with_iommu(fake: FakeSysfs, groups: dict[str, tuple[int, Path]]) -> None:
    """`bus/pci/devices` links and IOMMU groups (bus ID -> (group, function directory)), as the kernel has them."""
    for bus, (group, fn) in groups.items():
        for link, target in ((fake.root / "bus" / "pci" / "devices" / bus, fn),
                             (fake.root / "kernel" / "iommu_groups" / str(group) / "devices" / bus, fn),
                             (fn / "iommu_group", fake.root / "kernel" / "iommu_groups" / str(group))):
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, link)


def test_a_vf_gets_a_passthrough_variant_and_each_function_its_counter_set(ns: NetNS, tmp_path: Path) -> None:
    fake = sriov_tree(tmp_path, ns)
    top = fake.root / "devices"
    pf = top / "pci0000:3a" / "0000:3a:00.0" / "0000:3b:00.0"
    dual = top / "pci0000:5d" / "0000:5d:00.0" / "0000:5e:00.0"
    with_iommu(fake, {"0000:3b:00.0": (30, pf), "0000:3b:00.2": (31, pf.parent / "0000:3b:00.2"),
                      "0000:5e:00.0": (50, dual)})

    scan = discover(ns, sysfs_root=str(fake.root), nic_include=HW)

    variant = scan.by_name["nic-0000-3b-00-2-vfio"]  # the VF; the PF has a VF enabled: none
    assert {d["name"] for d in scan.devices if d["kind"] == "vfio"} == {"nic-0000-3b-00-2-vfio"}
    attrs = {k: next(iter(v.values())) for k, v in variant["attributes"].items()}
    assert attrs == {"type": "vfio", "nativeType": "nic", PCI: "0000:3b:00.2", ROOT: "pci0000:3a", NUMA: 1,
                     "iommuGroup": 31, "vendorID": "0x15b3", "deviceID": "0x101e",
                     "macAddress": fake.links["vf0"]["address"]}
    sets = {d["name"]: d["wire"]["consumesCounters"] for d in scan.devices}
    assert sets["nic-0000-3b-00-2"] == sets["nic-0000-3b-00-2-vfio"] == [
        {"counterSet": "nic-0000-3b-00-2-counters", "counters": {"ports": {"value": "1"}}}]
    # Two ports of one function: one set with two ports, one each.
    assert sets["nic-0000-5e-00-0"] == sets["nic-0000-5e-00-0-p1"] == [
        {"counterSet": "nic-0000-5e-00-0-counters", "counters": {"ports": {"value": "1"}}}]


def test_pci_functions_are_published_without_include_and_renames_keep_names(ns: NetNS,
                                                                             tmp_path: Path) -> None:
    fake = sriov_tree(tmp_path, ns)
    # The one kindless link a namespace has is lo: give it a PCI function, like a hardware NIC.
    fn = fake.function("pci0000:00", "0000:00:1f.6", vendor="0x8086", device="0x15bb", numa=0)
    fake.netdev(fn, "lo")

    scan = discover(ns, sysfs_root=str(fake.root))
    assert list(scan.by_ifname) == ["lo"]
    assert scan.by_ifname["lo"]["name"] == "nic-0000-00-1f-6"
    assert "nic-0000-00-1f-6" not in discover(ns, sysfs_root=str(fake.root), nic_exclude="l?").by_name

    # Renamed: same PCI function, so the same device name.
    ns.ip("link", "set", "vf0", "down")
    ns.ip("link", "set", "vf0", "name", "enp59s0f0v0")
    (fake.root / "class" / "net" / "vf0").rename(fake.root / "class" / "net" / "enp59s0f0v0")
    scan = discover(ns, sysfs_root=str(fake.root), nic_include="pf0,enp*")
    assert scan.by_name["nic-0000-3b-00-2"]["node"]["interface"] == "enp59s0f0v0"
    assert scan.attrs("enp59s0f0v0")["ifName"] == "enp59s0f0v0"


def test_one_bad_nic_does_not_stop_the_others(ns: NetNS, tmp_path: Path) -> None:
    fake = sriov_tree(tmp_path, ns)
    ns.veth("gone0", "gone0x")  # in netlink, but its sysfs entry vanished
    ns.veth("moved0", "moved0x")  # its name now belongs to another link
    ns.veth("dup0", "dup0x")  # points at pf0's function and port: the same device name
    links = ns.links()
    fn = fake.root / "devices" / "pci0000:3a" / "0000:3a:00.0" / "0000:3b:00.0"
    fake.netdev(None, "moved0", ifindex=links["moved0"]["ifindex"] + 1000)
    fake.netdev(fn, "dup0", ifindex=links["dup0"]["ifindex"])
    speed = fake.root / "class" / "net" / "p1" / "speed"
    speed.unlink()
    speed.mkdir()  # reading it fails (EISDIR): an unreadable file, not an unknown value

    scan = discover(ns, sysfs_root=str(fake.root), nic_include=HW + ",gone0,moved0,dup0")

    assert sorted(scan.by_ifname) == ["p0", "pf0", "vf0"]
    # Only a link with a device name is a failed device; the others name no device of the pool.
    assert set(scan.failed_devices) == {"nic-0000-5e-00-0-p1"}
    assert "p1" in scan.failed_devices["nic-0000-5e-00-0-p1"]
    assert "speed" in scan.failed_devices["nic-0000-5e-00-0-p1"]
    assert set(scan.problems) == {"interface gone0", "interface moved0", "interface dup0"}
    assert "does not exist" in scan.problems["interface gone0"]
    assert "renamed" in scan.problems["interface moved0"]
    # The older link keeps the name; the newer one is reported, not silently dropped.
    assert scan.by_name["nic-0000-3b-00-0"]["node"]["interface"] == "pf0"
    assert "nic-0000-3b-00-0" in scan.problems["interface dup0"] and "pf0" in scan.problems["interface dup0"]


# -- the host's own NIC ------------------------------------------------------


def _host_pci_nics() -> dict[str, tuple[str, str, int | None]]:
    """ifname -> (bus ID, PCIe root, NUMA node), read from /sys without the agent's code."""
    bdf = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
    out = {}
    for ifname in sorted(os.listdir("/sys/class/net")):
        device = f"/sys/class/net/{ifname}/device"
        if not os.path.exists(device):
            continue
        parts = Path(os.path.realpath(device)).parts  # /, sys, devices, pci0000:00, ..., <BDF>, [virtioN]
        functions = [i for i, p in enumerate(parts) if bdf.match(p)]
        if not functions or not parts[3].startswith("pci"):
            continue
        bus_id = parts[functions[-1]]
        numa = int(Path(*parts[: functions[-1] + 1], "numa_node").read_text())
        out[ifname] = (bus_id, parts[3], numa if numa >= 0 else None)
    return out


def test_host_pci_nic_matches_sysfs() -> None:
    nics = _host_pci_nics()
    if not nics:
        pytest.skip("this host has no PCI network interface in its network namespace")
    scan = NicSource(Settings()).scan()
    by_ifname = {d.node.interface: d for d in scan.devices}
    for ifname, (bus_id, root, numa) in nics.items():
        dev = by_ifname.get(ifname)
        reported = [*scan.failed_devices, *scan.problems]
        if dev is None and any(ifname in str(item) for item in reported):
            pytest.fail(f"{ifname} not published: {reported}")
        assert dev is not None, f"PCI interface {ifname} ({bus_id}) not published"
        assert dev.name.startswith(pci_device_name(bus_id, 0))
        assert dev.attributes[PCI] == bus_id
        assert dev.attributes[ROOT] == root
        assert dev.attributes.get(NUMA) == numa
        assert dev.attributes["ifName"] == ifname
        assert device_wire_errors(dev.wire()) == []


# -- netlink events ------------------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_watcher_reports_link_and_address_changes(ns: NetNS) -> None:
    ns.veth("old", "oldx", up=False)  # there before the watcher: its changes are changes, not additions
    async with NetlinkWatcher(netns=ns.name) as watcher:
        ns.ip("link", "set", "old", "mtu", "1400")
        ev = await next_matching(watcher, lambda e: e.ifname == "old", "a change on old")
        assert ev.kind == LINK_CHANGED

        ns.veth("va", "vb", up=False)
        added = await next_matching(watcher, lambda e: e.ifname == "va", "va added")
        assert added.kind == LINK_ADDED and added.link_up is False
        index = added.index

        ns.ip("link", "set", "vb", "up")
        ns.ip("link", "set", "va", "up")
        await next_matching(watcher, exactly(NetEvent(LINK_CHANGED, "va", index, link_up=True)), "va up")

        ns.ip("addr", "add", "10.9.0.1/24", "dev", "va")
        ns.ip("addr", "add", "fd09::1/64", "dev", "va", "nodad")
        await next_matching(watcher, exactly(NetEvent(ADDRESS_ADDED, "va", index, address="10.9.0.1/24")),
                            "the IPv4 address added")
        await next_matching(watcher, exactly(NetEvent(ADDRESS_ADDED, "va", index, address="fd09::1/64")),
                            "the IPv6 address added")
        ns.ip("addr", "del", "10.9.0.1/24", "dev", "va")
        await next_matching(watcher, exactly(NetEvent(ADDRESS_REMOVED, "va", index, address="10.9.0.1/24")),
                            "the address removed")

        ns.ip("link", "set", "va", "down")
        await next_matching(watcher, exactly(NetEvent(LINK_CHANGED, "va", index, link_up=False)),
                            "va down")
        ns.ip("link", "set", "va", "name", "vrenamed")
        await next_matching(watcher, lambda e: e.kind == LINK_CHANGED and e.ifname == "vrenamed"
                            and e.index == index, "the rename")
        ns.ip("link", "del", "vrenamed")
        await next_matching(watcher, lambda e: e.kind == LINK_REMOVED and e.index == index, "va removed")
        await next_matching(watcher, lambda e: e.kind == LINK_REMOVED and e.ifname == "vb", "vb removed")


async def test_watcher_close_and_cancellation_release_everything(ns: NetNS) -> None:
    fds = _fds()
    watcher = NetlinkWatcher(netns=ns.name)
    await watcher.start()
    assert _fds() > fds  # the netlink socket
    blocked = asyncio.create_task(anext(watcher))
    await asyncio.sleep(0)  # one turn of the loop (not a wait for time): the task now waits for an event
    assert not blocked.done()
    await watcher.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(blocked, 10)
    assert [e async for e in watcher] == []
    await watcher.close()  # again: nothing left to do
    assert _fds() == fds
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "netlink-watcher"]

    started = asyncio.Event()

    async def consume() -> None:
        async with NetlinkWatcher(netns=ns.name) as w:
            started.set()
            async for _ in w:
                pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _fds() == fds
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "netlink-watcher"]


async def test_watcher_resyncs_after_the_kernel_drops_events(ns: NetNS, caplog: pytest.LogCaptureFixture) -> None:
    ns.veth("va", "vb", up=False)
    ns.veth("wa", "wb", up=False)
    async with NetlinkWatcher(netns=ns.name, rcvbuf=4096) as watcher:
        # The event loop is blocked during this burst: nobody reads, the small buffer overflows (ENOBUFS)
        # and the kernel drops events. Links come, one is renamed, a pair goes.
        ns.batch([*(f"link add x{i} type veth peer name y{i}" for i in range(40)),
                  "link set va name vz", "link del wa",
                  *(f"link set vb mtu {1300 + i % 100}" for i in range(500))])
        await next_matching(watcher, lambda e: e.kind == RESYNC, "a resync")
        assert watcher.reconnects >= 1
        assert os.strerror(errno.ENOBUFS) in caplog.text
        # Resynced to the true state: every link the kernel has, by its name now; none that went.
        truth = {link["ifindex"]: name for name, link in ns.links().items()}
        assert watcher.known_links() == truth
        # Events after the resync: a link added during the loss is known (a change, not an addition),
        # and the renamed one goes by its new name.
        ns.ip("link", "set", "x7", "mtu", "1280")
        x7 = await next_matching(watcher, lambda e: e.ifname == "x7", "a change on x7")
        assert x7.kind == LINK_CHANGED
        ns.ip("addr", "add", "10.8.0.1/24", "dev", "vz")
        added = await next_matching(watcher, lambda e: e.kind == ADDRESS_ADDED, "an address on vz")
        assert added.ifname == "vz" and truth[added.index] == "vz"


async def test_debounce_one_rescan_per_burst_of_netlink_events(ns: NetNS) -> None:
    ns.veth("va", "vb", up=False)
    async with NetlinkWatcher(netns=ns.name) as watcher:
        log: list[NetEvent] = []
        triggers: asyncio.Queue[int] = asyncio.Queue()

        async def recorded() -> AsyncIterator[NetEvent]:
            async for event in watcher:
                log.append(event)
                yield event

        async def rescans() -> None:
            async for _ in debounced(recorded(), 1.0):
                triggers.put_nowait(len(log))

        consumer = asyncio.create_task(rescans())
        try:
            ns.batch(f"link set va mtu {1400 + i}" for i in range(10))
            first = await asyncio.wait_for(triggers.get(), 20)
            # One trigger, after the whole burst: all ten changes were in before it.
            assert sum(e.ifname == "va" and e.kind == LINK_CHANGED for e in log[:first]) == 10
            ns.ip("link", "set", "vb", "mtu", "1300")
            second = await asyncio.wait_for(triggers.get(), 20)
            later = log[first:second]
            assert later and all(e.ifname == "vb" for e in later)
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer


async def _from(queue: asyncio.Queue[str | None]) -> AsyncIterator[str]:
    while (item := await queue.get()) is not None:
        yield item


async def test_debounce_events_during_a_rescan_give_exactly_one_more() -> None:
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    rescans = debounced(_from(queue), 0.05)
    queue.put_nowait("first")
    await asyncio.wait_for(anext(rescans), 10)
    for i in range(5):  # arrive while the consumer is rescanning
        queue.put_nowait(str(i))
    await asyncio.wait_for(anext(rescans), 10)
    queue.put_nowait(None)  # the source ends: so do the rescans, with no extra one
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(rescans), 10)


async def test_debounce_an_event_storm_still_triggers_rescans() -> None:
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    async def storm() -> None:
        while True:  # faster than the delay, forever: a pure debounce would never fire
            queue.put_nowait("flap")
            await asyncio.sleep(0.01)

    storming = asyncio.create_task(storm())
    rescans = debounced(_from(queue), delay=0.5, max_wait=1.0)
    try:
        await asyncio.wait_for(anext(rescans), 30)
    finally:
        storming.cancel()
        await rescans.aclose()


def test_the_links_of_the_default_routes_are_uplinks(ns: NetNS) -> None:
    # Moved into a pod or passed to a VM, the link of the node's default route cuts the node off: each
    # such link (IPv4 or IPv6) is published as an uplink, which prepare never moves.
    for name in ("va", "wa", "xa"):
        ns.veth(name, f"{name[0]}b")
    ns.ip("addr", "add", "10.9.0.2/24", "dev", "va")
    ns.ip("route", "add", "default", "via", "10.9.0.1")
    ns.ip("-6", "addr", "add", "fd09::2/64", "dev", "wa", "nodad")
    ns.ip("-6", "route", "add", "default", "via", "fd09::1", "dev", "wa")
    scan = discover(ns, nic_include="va,wa,xa")
    assert {name: scan.attrs(name)["uplink"] for name in ("va", "wa", "xa")} == {"va": True, "wa": True, "xa": False}
    ns.ip("route", "del", "default")
    assert discover(ns, nic_include="va").attrs("va")["uplink"] is False
    # The NIC holding one of the Node's addresses (the DaemonSet passes status.hostIPs) is one too.
    assert discover(ns, nic_include="va", node_ips="10.9.0.2").attrs("va")["uplink"] is True


def bridge(ns: NetNS, name: str, *ports: str) -> None:
    ns.ip("link", "add", name, "type", "bridge")
    for port in ports:
        ns.ip("link", "set", port, "master", name)
    ns.ip("link", "set", name, "up")


def test_a_port_of_the_bridge_that_carries_a_default_route_is_an_uplink(ns: NetNS) -> None:
    # Before, only the link holding the default route itself was: up0, the bridge's port, was published
    # `uplink: false` and moved into a pod, leaving br0 with no port (a bond's port is the same: the
    # master is followed whatever its kind; this kernel has no bonding module).
    ns.veth("up0", "wire0")
    ns.veth("c0", "c1")  # the control: a plain pair, no route, no master
    bridge(ns, "br0", "up0")
    ns.ip("addr", "add", "10.9.0.2/24", "dev", "br0")
    ns.ip("route", "add", "default", "via", "10.9.0.1")
    scan = discover(ns, nic_include="up0,c0,c1")
    assert scan.uplink("up0") == "br0 carries the default route 0.0.0.0/0 (table main), and up0 is a port of br0"
    assert scan.attrs("up0")["uplink"] is True
    assert (scan.attrs("c0")["uplink"], scan.uplink("c0"), scan.attrs("c1")["uplink"]) == (False, "", False)
    # A default route of any routing table counts (policy routing, a VRF's table): /proc/net/route lists
    # only the main one.
    ns.ip("route", "del", "default")
    assert discover(ns, nic_include="up0").attrs("up0")["uplink"] is False
    ns.ip("route", "add", "default", "via", "10.9.0.1", "dev", "br0", "table", "100")
    assert discover(ns, nic_include="up0").uplink("up0") == (
        "br0 carries the default route 0.0.0.0/0 (table 100), and up0 is a port of br0")
    # A route that leads nowhere (unreachable, blackhole) is no way out of the node.
    ns.ip("route", "del", "default", "table", "100")
    ns.ip("route", "add", "unreachable", "default", "table", "101")
    ns.ip("-6", "route", "add", "blackhole", "default", "table", "102")
    assert discover(ns, nic_include="up0").attrs("up0")["uplink"] is False
    # A multipath default route leaves by each of its nexthops' links.
    ns.ip("addr", "add", "10.7.0.2/24", "dev", "c0")
    ns.ip("route", "add", "default", "table", "103", "nexthop", "via", "10.9.0.1", "dev", "br0",
          "nexthop", "via", "10.7.0.1", "dev", "c0")
    scan = discover(ns, nic_include="up0,c0")
    assert scan.uplink("up0") == "br0 carries the default route 0.0.0.0/0 (table 103), and up0 is a port of br0"
    assert scan.uplink("c0") == "c0 carries the default route 0.0.0.0/0 (table 103)"


def test_a_link_stacked_on_the_nic_that_carries_a_default_route_makes_it_an_uplink(ns: NetNS) -> None:
    # A VLAN (macvlan, ipvlan) on the NIC names it as its lower link (IFLA_LINK), as a veth names its peer
    # in the same namespace: this kernel has no 8021q module, so the veth stands for the VLAN here. The
    # links above are followed upward through both kinds of step: s0 <- s1 (IFLA_LINK) -> br1 (master).
    ns.veth("s0", "s1")
    bridge(ns, "br1", "s1")
    ns.ip("-6", "addr", "add", "fd09::2/64", "dev", "br1", "nodad")
    ns.ip("-6", "route", "add", "default", "via", "fd09::1", "dev", "br1", "table", "200")
    scan = discover(ns, nic_include="s0,s1")
    assert scan.uplink("s0") == ("br1 carries the default route ::/0 (table 200), and s1 is stacked on s0, "
                                 "s1 is a port of br1")
    assert scan.uplink("s1") == "br1 carries the default route ::/0 (table 200), and s1 is a port of br1"


def test_a_port_of_the_bridge_holding_an_address_of_the_node_is_an_uplink(ns: NetNS) -> None:
    # A bridge for KubeVirt's VMs that holds the node's address and no default route: its port is how the
    # node is reached all the same.
    ns.veth("q0", "q1")
    ns.veth("c0", "c1")
    bridge(ns, "br2", "q0")
    bridge(ns, "br3", "c0")  # the control: a bridge with neither route nor the Node's address
    ns.ip("addr", "add", "10.8.0.7/24", "dev", "br2")
    ns.ip("addr", "add", "10.8.1.7/24", "dev", "br3")
    scan = discover(ns, nic_include="q0,c0", node_ips="10.8.0.7,fd08::7")
    assert scan.uplink("q0") == "br2 holds 10.8.0.7, an address of the Node, and q0 is a port of br2"
    assert scan.attrs("c0")["uplink"] is False
    assert discover(ns, nic_include="q0").attrs("q0")["uplink"] is False  # no --node-ips: nothing says so

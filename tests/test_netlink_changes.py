"""Netlink while the links change: a dump the kernel flags as interrupted is dumped again, a link renamed
or moved to another network namespace is reported as it now is, and hardware addresses come whole.

Links are veth pairs in network namespaces the tests make; discovery and the watcher read them in
this process (`netns=`), so a test can reach into the dump as it runs.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import need_command, need_root
from netns import NetNS, network_namespace, next_matching

from agent.inventory import netlink
from agent.inventory.netwatch import ADDRESS_ADDED, LINK_ADDED, LINK_CHANGED, LINK_REMOVED, NetlinkWatcher


@pytest.fixture
def ns() -> Iterator[NetNS]:
    need_root()
    need_command("ip")
    with network_namespace("dra-nlc") as made:
        yield made


@pytest.fixture
def other() -> Iterator[NetNS]:
    need_root()
    need_command("ip")
    with network_namespace("dra-nlo") as made:
        yield made


def _truth(ns: NetNS) -> dict[int, str]:
    """Link names by index, as `ip` lists them now."""
    return {link["ifindex"]: link["ifname"] for link in json.loads(ns.ip("-j", "link", "show"))}


def _names(links: list[netlink.Link]) -> dict[int, str]:
    return {link.index: link.ifname for link in links}


# -- a dump interrupted by a change ---------------------------------------------------------------


def test_an_interrupted_dump_is_dumped_again_not_returned_half(ns: NetNS, monkeypatch: pytest.MonkeyPatch) -> None:
    # 300 links: the dump takes many datagrams, and the kernel builds the next ones as they are read.
    ns.batch(f"link add d{i} type veth peer name p{i}" for i in range(150))
    before = _truth(ns)
    attempts = 0
    once = netlink._dump_once

    async def counted(*args: Any) -> Any:
        nonlocal attempts
        attempts += 1
        return await once(*args)

    original = netlink.AsyncIPRoute.enqueue
    changed = False

    def enqueue(self: Any, data: bytes, addr: Any) -> Any:
        # With the first datagram of the first dump in (it lists d0 and p0), the table changes under
        # the dump: d0 and p0 go. The kernel flags the messages it builds from then on NLM_F_DUMP_INTR.
        nonlocal changed
        if not changed:
            changed = True
            subprocess.run(["ip", "-n", ns.name, "link", "del", "d0"], check=True, timeout=30)
        return original(self, data, addr)

    monkeypatch.setattr(netlink, "_dump_once", counted)
    monkeypatch.setattr(netlink.AsyncIPRoute, "enqueue", enqueue)
    links, _ = netlink.dump(ns.name, addresses=False)

    after = _truth(ns)
    assert set(before.values()) - set(after.values()) == {"d0", "p0"}
    # The first answer had d0 and p0, gone by then: it was not returned; the second one is the table.
    assert attempts == 2
    assert _names(links) == after


def test_dump_messages_raises_on_the_flag_of_any_message(ns: NetNS, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even when the flag is only on the last message (NLMSG_DONE, which pyroute2 does not yield)."""
    ns.veth("va", "vb")
    original = netlink.AsyncIPRoute.enqueue
    done_type = 3  # NLMSG_DONE

    def enqueue(self: Any, data: bytes, addr: Any) -> Any:
        buf = bytearray(data)
        offset = 0
        while offset + 16 <= len(buf):
            length, kind, flags = struct.unpack_from("=IHH", buf, offset)
            if kind == done_type:
                struct.pack_into("=H", buf, offset + 6, flags | 0x10)  # NLM_F_DUMP_INTR
            offset += (length + 3) & ~3
        return original(self, bytes(buf), addr)

    monkeypatch.setattr(netlink.AsyncIPRoute, "enqueue", enqueue)
    with pytest.raises(netlink.ScanError, match="interrupted 5 times"):
        netlink.dump(ns.name)


# -- renamed, and moved to another namespace ------------------------------------------------------


async def test_a_renamed_link_is_reported_by_its_new_name(ns: NetNS) -> None:
    ns.veth("va", "vb", up=False)  # a link is renamed while down
    async with NetlinkWatcher(netns=ns.name) as watcher:
        index = next(i for i, name in watcher.known_links().items() if name == "va")
        ns.ip("link", "set", "va", "name", "vnew")
        renamed = await next_matching(watcher, lambda e: e.index == index, "the rename")
        assert (renamed.kind, renamed.ifname) == (LINK_CHANGED, "vnew")
        assert watcher.known_links()[index] == "vnew"
        # Later events of the link carry the new name, from the watcher's own record of it.
        ns.ip("addr", "add", "10.7.0.1/24", "dev", "vnew")
        added = await next_matching(watcher, lambda e: e.kind == ADDRESS_ADDED, "the address")
        assert (added.ifname, added.index, added.address) == ("vnew", index, "10.7.0.1/24")
    links, addresses = await asyncio.to_thread(netlink.dump, ns.name)
    assert _names(links)[index] == "vnew" and "va" not in _names(links).values()
    assert [a.cidr for a in addresses[index]] == ["10.7.0.1/24"]


async def test_a_link_moved_to_another_namespace_is_gone_from_this_one(ns: NetNS, other: NetNS) -> None:
    ns.veth("va", "vb")
    mac = ns.links()["va"]["address"]
    async with NetlinkWatcher(netns=ns.name) as here, NetlinkWatcher(netns=other.name) as there:
        index = next(i for i, name in here.known_links().items() if name == "va")
        ns.ip("link", "set", "va", "netns", other.name)

        gone = await next_matching(here, lambda e: e.kind == LINK_REMOVED, "va gone from its namespace")
        assert (gone.ifname, gone.index) == ("va", index)
        assert "va" not in here.known_links().values()
        arrived = await next_matching(there, lambda e: e.kind == LINK_ADDED, "va in the other namespace")
        assert arrived.ifname == "va"
        assert there.known_links()[arrived.index] == "va"

        links_here, _ = await asyncio.to_thread(netlink.dump, ns.name)
        links_there, _ = await asyncio.to_thread(netlink.dump, other.name)
        assert "va" not in _names(links_here).values() and "vb" in _names(links_here).values()
        assert [link.mac for link in links_there if link.ifname == "va"] == [mac]

        # Back, renamed on the way (the kernel moves it, then renames it): added here, then known by
        # its new name; gone from there.
        other.ip("link", "set", "va", "netns", ns.name, "name", "vback")
        back = await next_matching(here, lambda e: e.kind == LINK_ADDED, "the link back")
        renamed = await next_matching(here, lambda e: e.ifname == "vback", "the link back, renamed")
        assert renamed.index == back.index and here.known_links()[back.index] == "vback"
        left = await next_matching(there, lambda e: e.kind == LINK_REMOVED, "the link gone from there")
        assert left.ifname == "va" and left.index == arrived.index
        assert here.known_links() == _truth(ns)
        assert there.known_links() == _truth(other)


# -- hardware addresses ----------------------------------------------------------------------------


def _newlink(index: int, ifname: str, address: bytes, perm: bytes) -> bytes:
    """An RTM_NEWLINK message as the kernel sends one for an IPoIB link (the attributes read here)."""
    def attr(kind: int, payload: bytes) -> bytes:
        raw = struct.pack("=HH", 4 + len(payload), kind) + payload
        return raw + b"\0" * (-len(raw) % 4)

    body = struct.pack("=BxHiII", 0, 32, index, 0x11043, 0)  # ARPHRD_INFINIBAND; up, running, lower up
    body += attr(3, ifname.encode() + b"\0") + attr(1, address) + attr(54, perm) + attr(4, struct.pack("=I", 2044))
    return struct.pack("=IHHII", 16 + len(body), 16, 0, 0, 0) + body


def test_an_infiniband_address_is_read_whole() -> None:
    # No link type of this kernel has an address longer than Ethernet's (no IPoIB, no ip6tnl): the
    # message of one is parsed by pyroute2's decoder, the one the agent's sockets use.
    from pyroute2.netlink.rtnl.marshal import MarshalRtnl

    address = bytes.fromhex("00000048fe800000000000000002c9030001f2a1")  # 20 bytes: QPN + port GID
    perm = bytes.fromhex("00000048fe800000000000000002c9030001f2a1")
    (msg,) = MarshalRtnl().parse(_newlink(7, "ib0", address, perm))
    link = netlink.link_of(msg)
    assert link.mac == link.perm_mac == address.hex(":")
    assert len(link.mac.split(":")) == 20
    assert (link.ifname, link.mtu, link.link_up) == ("ib0", 2044, True)


def test_ethernet_addresses_as_ip_lists_them(ns: NetNS) -> None:
    ns.veth("va", "vb")
    ns.ip("link", "set", "va", "address", "02:a1:b2:c3:d4:e5")
    links, _ = netlink.dump(ns.name)
    by_name = {link.ifname: link for link in links}
    assert by_name["va"].mac == "02:a1:b2:c3:d4:e5"
    assert by_name["vb"].mac == ns.links()["vb"]["address"]
    assert by_name["lo"].mac == ""  # all zeros: no address


# -- off the event loop ---------------------------------------------------------------------------


async def test_the_watcher_opens_and_dumps_off_the_event_loop(ns: NetNS, monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.inventory.netwatch as netwatch

    threads: dict[str, bool] = {}
    loop_thread = threading.get_ident()
    for name in ("route_socket", "dump"):
        real = getattr(netwatch, name)

        def recorded(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            threads[_name] = threading.get_ident() != loop_thread
            return _real(*args, **kwargs)

        monkeypatch.setattr(netwatch, name, recorded)
    ns.veth("va", "vb")
    async with NetlinkWatcher(netns=ns.name) as watcher:
        assert watcher.known_links() == _truth(ns)
    assert threads == {"route_socket": True, "dump": True}

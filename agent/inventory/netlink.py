"""Links, addresses and default routes of a network namespace as plain records, read over rtnetlink
with pyroute2.

Both the NIC scan (a dump) and the event watcher (`agent.inventory.netwatch`, multicast messages)
read the same message types, so the decoding lives here once. The default routes are dumped from every
routing table (a route dump without a table filter): `/proc/net/route` lists the main table only, and a
node may reach the cluster through another (policy routing, a VRF). pyroute2 encodes the requests and
decodes the replies; its messages (dict-like, typed `Any`) go no further than this module and the
watcher: everything else reads `Link`, `Address` and `DefaultRoute`.

What stays ours, and why:
- the retry of a dump the kernel flagged as interrupted (NLM_F_DUMP_INTR): pyroute2 yields such a
  dump's messages as if it were whole, so the flag is read from each message's header;
- the hardware addresses, read from the attributes' bytes: pyroute2 decodes IFLA_ADDRESS as 6 bytes
  and would cut an InfiniBand address (20 bytes) short;
- the socket of a named network namespace, opened by a thread that enters it: pyroute2's own
  `netns=` forks a child process to open it, and the agent's process runs gRPC's threads.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import logging
import os
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from pyroute2 import AsyncIPRoute
from pyroute2.netlink import NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST
from pyroute2.netlink.rtnl import RTM_GETADDR, RTM_GETLINK, RTM_GETROUTE
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from agent.inventory import ScanError

log = logging.getLogger(__name__)

IFF_UP = 0x1
IFF_LOWER_UP = 0x10000
IFA_F_DADFAILED = 0x08
IFA_F_TENTATIVE = 0x40
RT_SCOPE_UNIVERSE = 0
RTN_UNICAST = 1  # a route's type: a blackhole, unreachable or prohibit default route leads nowhere
RT_TABLE_MAIN = 254
# ifi_change of a link the kernel has just registered (rtmsg_ifinfo(..., ~0U, ...)).
CHANGE_NEW_LINK = 0xFFFFFFFF

_DUMP_ATTEMPTS = 5
_DUMP_PAUSE = 0.01  # seconds, times the attempt number, between interrupted dumps
_NETNS_DIR = "/run/netns"  # where `ip netns` keeps a name for each namespace
_CLONE_NEWNET = 0x40000000

# A pyroute2 message (ifinfmsg, ifaddrmsg): read by field and attribute name, here and in netwatch only.
Message = Any


class DumpInterrupted(Exception):
    """The kernel's table changed while it was being dumped (NLM_F_DUMP_INTR): dump again."""


@dataclass(frozen=True, slots=True)
class Link:
    index: int
    ifname: str
    mac: str  # current hardware address, "" when the link has none (or all zeros)
    perm_mac: str  # permanent address (IFLA_PERM_ADDRESS), "" when the kernel does not say
    mtu: int
    admin_up: bool
    carrier: bool
    kind: str  # IFLA_INFO_KIND: set by software links (veth, bridge, ...), "" for hardware
    # IFLA_MASTER: the link this one is a port of (a bridge, bond, team, VRF), 0 for none.
    master: int = 0
    # IFLA_LINK: the link this one is stacked on (a VLAN's, macvlan's or ipvlan's lower link; a veth's
    # peer), 0 for none or for a link of another namespace (IFLA_LINK_NETNSID: its index is that one's).
    lower: int = 0

    @property
    def link_up(self) -> bool:
        return self.admin_up and self.carrier


@dataclass(frozen=True, slots=True)
class Address:
    index: int
    family: int  # socket.AF_INET or socket.AF_INET6
    cidr: str  # "10.0.0.5/24", "fd00::5/64"
    scope: int
    flags: int

    @property
    def usable_global(self) -> bool:
        """Global scope, and not an IPv6 address still in (or failed) duplicate address detection."""
        return self.scope == RT_SCOPE_UNIVERSE and not self.flags & (IFA_F_TENTATIVE | IFA_F_DADFAILED)


@dataclass(frozen=True, slots=True)
class DefaultRoute:
    """A unicast default route (0.0.0.0/0, ::/0) of any routing table."""

    family: int  # socket.AF_INET or socket.AF_INET6
    table: int
    interfaces: tuple[int, ...]  # the indexes of the links it leaves by: its own, or its nexthops'

    @property
    def described(self) -> str:
        table = "main" if self.table == RT_TABLE_MAIN else str(self.table)
        return f"the default route {'0.0.0.0/0' if self.family == socket.AF_INET else '::/0'} (table {table})"


@dataclass(frozen=True, slots=True)
class NetState:
    """One namespace's links (by index), their addresses (by link index) and its default routes."""

    links: list[Link]
    addresses: dict[int, list[Address]]
    routes: list[DefaultRoute]


def _attr_bytes(msg: Message, name: str) -> bytes | None:
    """The payload of the first attribute `name`, as the kernel sent it (without its 4-byte header)."""
    for slot in msg["attrs"]:
        if slot.name == name:
            nla = slot.nla
            return bytes(nla.data[nla.offset + 4:nla.offset + nla["header"]["length"]])
    return None


def _hwaddr(value: bytes | None) -> str:
    """"aa:bb:..." (lower case, every byte: 6 for Ethernet, 20 for InfiniBand); "" when there is
    none, or it is all zeros."""
    if not value or not any(value):
        return ""
    return value.hex(":")


def link_of(msg: Message) -> Link:
    """A Link from an RTM_NEWLINK / RTM_DELLINK message."""
    flags = int(msg["flags"])
    carrier = msg.get_attr("IFLA_CARRIER")
    info = msg.get_attr("IFLA_LINKINFO")
    kind = info.get_attr("IFLA_INFO_KIND") if info is not None else None
    lower = msg.get_attr("IFLA_LINK") if msg.get_attr("IFLA_LINK_NETNSID") is None else None
    return Link(
        index=int(msg["index"]),
        ifname=msg.get_attr("IFLA_IFNAME") or "",
        mac=_hwaddr(_attr_bytes(msg, "IFLA_ADDRESS")),
        perm_mac=_hwaddr(_attr_bytes(msg, "IFLA_PERM_ADDRESS")),
        mtu=int(msg.get_attr("IFLA_MTU") or 0),
        admin_up=bool(flags & IFF_UP),
        # Kernels without IFLA_CARRIER still report carrier as IFF_LOWER_UP.
        carrier=bool(carrier) if carrier is not None else bool(flags & IFF_LOWER_UP),
        kind=kind if isinstance(kind, str) else "",
        master=int(msg.get_attr("IFLA_MASTER") or 0),
        lower=int(lower or 0),
    )


def address_of(msg: Message) -> Address | None:
    """An Address from an RTM_NEWADDR / RTM_DELADDR message; None for families other than IP."""
    family = int(msg["family"])
    if family not in (socket.AF_INET, socket.AF_INET6):
        return None
    # On point-to-point links IFA_ADDRESS is the peer; IFA_LOCAL is always our own address.
    addr = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
    if not isinstance(addr, str) or not addr:
        return None
    try:
        cidr = ipaddress.ip_interface(f"{addr}/{int(msg['prefixlen'])}")
    except ValueError:
        return None
    if cidr.version != (4 if family == socket.AF_INET else 6):
        return None
    flags = msg.get_attr("IFA_FLAGS")  # 32 bits; the header field holds only the low 8
    return Address(
        index=int(msg["index"]),
        family=family,
        cidr=str(cidr),
        scope=int(msg["scope"]),
        flags=int(flags if flags is not None else msg["flags"]),
    )


def default_route_of(msg: Message) -> DefaultRoute | None:
    """A DefaultRoute from an RTM_NEWROUTE message; None for any other route."""
    family = int(msg["family"])
    if family not in (socket.AF_INET, socket.AF_INET6) or int(msg["dst_len"]) != 0 \
            or int(msg["type"]) != RTN_UNICAST:
        return None
    table = msg.get_attr("RTA_TABLE")  # the header's field holds only 8 bits
    interfaces = [int(oif)] if (oif := msg.get_attr("RTA_OIF")) else []
    interfaces += [int(hop["oif"]) for hop in msg.get_attr("RTA_MULTIPATH") or () if int(hop["oif"]) > 0]
    return DefaultRoute(family=family, table=int(table if table is not None else msg["table"]),
                        interfaces=tuple(dict.fromkeys(interfaces)))


def label_of(msg: Message) -> str:
    """The address's label (IFA_LABEL: IPv4 only, the interface's name or an alias of it)."""
    label = msg.get_attr("IFA_LABEL")
    return label if isinstance(label, str) else ""


def route_socket(netns: str | None = None) -> socket.socket:
    """A NETLINK_ROUTE socket, unbound: of this process's network namespace, or of the one `ip
    netns` names `netns` (never created). Blocking: it may start and join a thread."""
    if netns is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE)
    # A socket belongs to the namespace of the thread that opens it: a thread of its own enters the
    # namespace (setns(2)), opens it and ends, and no other thread ever changes namespace.
    found: list[socket.socket | BaseException] = []

    def open_there() -> None:
        try:
            fd = os.open(os.path.join(_NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
            try:
                # os.setns is Python 3.12's; the agent runs on 3.11 as well.
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"setns into network namespace {netns}: {os.strerror(code)}")
            finally:
                os.close(fd)
            found.append(socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE))
        except BaseException as exc:
            found.append(exc)

    thread = threading.Thread(target=open_there, name="netns-socket")
    thread.start()
    thread.join()
    result = found[0]
    if isinstance(result, BaseException):
        raise result
    return result


class _IntrFlag:
    """Notes NLM_F_DUMP_INTR on any message of one dump, NLMSG_DONE included (pyroute2 calls it for
    each message of the request's sequence number, before it drops NLMSG_DONE)."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, msg: Message) -> bool:
        self.seen |= bool(msg["header"]["flags"] & NLM_F_DUMP_INTR)
        return False  # keep the message


async def dump_messages(ipr: Any, request_type: int, request: Message) -> list[Message]:
    """Every message of one dump (RTM_GETLINK with an ifinfmsg, RTM_GETADDR with an ifaddrmsg);
    DumpInterrupted when the kernel flagged any of them: the table changed meanwhile, and what came
    is not a consistent picture of it."""
    intr = _IntrFlag()
    replies = await ipr.nlm_request(request, request_type, NLM_F_REQUEST | NLM_F_DUMP, callback=intr)
    out = [msg async for msg in replies]
    if intr.seen:
        raise DumpInterrupted(f"netlink dump {request_type} interrupted")
    return out


async def _dump_once(netns: str | None, addresses: bool, routes: bool) -> NetState:
    sock = route_socket(netns)
    ipr = AsyncIPRoute(use_socket=sock, groups=0)
    try:
        links = [link_of(m) for m in await dump_messages(ipr, RTM_GETLINK, ifinfmsg())]
        found: dict[int, list[Address]] = defaultdict(list)
        if addresses:
            for m in await dump_messages(ipr, RTM_GETADDR, ifaddrmsg()):
                if (a := address_of(m)) is not None:
                    found[a.index].append(a)
        defaults: list[DefaultRoute] = []
        for family in (socket.AF_INET, socket.AF_INET6) if routes else ():
            request = rtmsg()
            request["family"] = family  # table 0 in the request: every table is dumped
            defaults += [r for m in await dump_messages(ipr, RTM_GETROUTE, request)
                         if (r := default_route_of(m)) is not None and r.family == family]
    finally:
        ipr.close()
        sock.close()  # given to pyroute2 (use_socket), so it is ours to close
    links.sort(key=lambda link: link.index)
    return NetState(links, dict(found), defaults)


def dump(netns: str | None = None, *, addresses: bool = True) -> tuple[list[Link], dict[int, list[Address]]]:
    """All links of this network namespace (or of the one `ip netns` names `netns`), by index, and
    their addresses by link index (none asked: `addresses=False`). Blocking: run it off the event
    loop (it runs one of its own)."""
    state = _dump(netns, addresses=addresses, routes=False)
    return state.links, state.addresses


def net_state(netns: str | None = None) -> NetState:
    """The links, addresses and default routes (of every routing table) of this network namespace, or of
    the one `ip netns` names `netns`. Blocking, as `dump`."""
    return _dump(netns, addresses=True, routes=True)


def _dump(netns: str | None, *, addresses: bool, routes: bool) -> NetState:
    """The kernel interrupts a dump when the table changes under it; a fresh dump
    is then the only consistent answer. ScanError when every attempt was
    interrupted: the inventory then keeps the NICs of its last good scan.
    """
    attempt = 1
    while True:
        try:
            return asyncio.run(_dump_once(netns, addresses, routes))
        except DumpInterrupted as exc:
            if attempt == _DUMP_ATTEMPTS:
                raise ScanError(f"the netlink dump was interrupted {attempt} times in a row (links, "
                                "addresses or routes changing faster than they can be listed)") from exc
            log.debug("netlink dump interrupted (attempt %d), retrying", attempt)
            # A burst of changes is usually over in milliseconds: let it pass before dumping again.
            time.sleep(_DUMP_PAUSE * attempt)
            attempt += 1

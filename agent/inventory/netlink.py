"""Links and addresses as plain records, from rtnetlink messages (`agent.host.rtnetlink`).

Both the NIC scan (a dump) and the event watcher (multicast messages) read the
same message types, so the decoding lives here once.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections import defaultdict
from dataclasses import dataclass

from agent.host import rtnetlink as rtnl
from agent.host.rtnetlink import AddressMessage, DumpInterrupted, LinkMessage, RtnlSocket, text, u32
from agent.inventory import ScanError

log = logging.getLogger(__name__)

IFF_UP = 0x1
IFF_LOWER_UP = 0x10000
IFA_F_DADFAILED = 0x08
IFA_F_TENTATIVE = 0x40
RT_SCOPE_UNIVERSE = 0
# ifi_change of a link the kernel has just registered (rtmsg_ifinfo(..., ~0U, ...)).
CHANGE_NEW_LINK = 0xFFFFFFFF

_DUMP_ATTEMPTS = 5
_DUMP_PAUSE = 0.01  # seconds, times the attempt number, between interrupted dumps


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


def _hwaddr(value: bytes | None) -> str:
    """"aa:bb:..." (lower case); "" when there is none, or it is all zeros."""
    if not value or not any(value):
        return ""
    return ":".join(f"{b:02x}" for b in value)


def link_of(msg: LinkMessage) -> Link:
    """A Link from an RTM_NEWLINK / RTM_DELLINK message."""
    attrs = msg.attrs
    carrier = attrs.get(rtnl.IFLA_CARRIER)
    info = attrs.get(rtnl.IFLA_LINKINFO)
    kind = text(rtnl.attributes(info).get(rtnl.IFLA_INFO_KIND)) if info is not None else None
    return Link(
        index=msg.index,
        ifname=text(attrs.get(rtnl.IFLA_IFNAME)) or "",
        mac=_hwaddr(attrs.get(rtnl.IFLA_ADDRESS)),
        perm_mac=_hwaddr(attrs.get(rtnl.IFLA_PERM_ADDRESS)),
        mtu=u32(attrs.get(rtnl.IFLA_MTU)) or 0,
        admin_up=bool(msg.flags & IFF_UP),
        # Kernels without IFLA_CARRIER still report carrier as IFF_LOWER_UP.
        carrier=bool(carrier[0]) if carrier else bool(msg.flags & IFF_LOWER_UP),
        kind=kind or "",
    )


def address_of(msg: AddressMessage) -> Address | None:
    """An Address from an RTM_NEWADDR / RTM_DELADDR message; None for families other than IP."""
    family = msg.family
    if family not in (socket.AF_INET, socket.AF_INET6):
        return None
    # On point-to-point links IFA_ADDRESS is the peer; IFA_LOCAL is always our own address.
    raw = msg.attrs.get(rtnl.IFA_LOCAL) or msg.attrs.get(rtnl.IFA_ADDRESS)
    if not raw or len(raw) != (4 if family == socket.AF_INET else 16):
        return None
    flags = u32(msg.attrs.get(rtnl.IFA_FLAGS))  # 32 bits; the header field holds only the low 8
    return Address(
        index=msg.index,
        family=family,
        cidr=str(ipaddress.ip_interface(f"{socket.inet_ntop(family, raw)}/{msg.prefixlen}")),
        scope=msg.scope,
        flags=flags if flags is not None else msg.flags,
    )


def label_of(msg: AddressMessage) -> str:
    """The address's label (IFA_LABEL: IPv4 only, the interface's name or an alias of it)."""
    return text(msg.attrs.get(rtnl.IFA_LABEL)) or ""


def dump() -> tuple[list[Link], dict[int, list[Address]]]:
    """All links of this network namespace (by index) and their addresses (by link index).

    The kernel interrupts a dump when the table changes under it; a fresh dump
    is then the only consistent answer. ScanError when every attempt was
    interrupted: the inventory then keeps the NICs of its last good scan.
    """
    attempt = 1
    while True:
        try:
            return _dump_once()
        except DumpInterrupted as exc:
            if attempt == _DUMP_ATTEMPTS:
                raise ScanError(f"the netlink dump was interrupted {attempt} times in a row (links or "
                                "addresses changing faster than they can be listed)") from exc
            log.debug("netlink dump interrupted (attempt %d), retrying", attempt)
            # A burst of changes is usually over in milliseconds: let it pass before dumping again.
            time.sleep(_DUMP_PAUSE * attempt)
            attempt += 1


def _dump_once() -> tuple[list[Link], dict[int, list[Address]]]:
    with RtnlSocket() as sock:
        links = [link_of(m) for m in sock.dump(rtnl.RTM_GETLINK) if isinstance(m, LinkMessage)]
        addresses: dict[int, list[Address]] = defaultdict(list)
        for m in sock.dump(rtnl.RTM_GETADDR):
            if isinstance(m, AddressMessage) and (a := address_of(m)) is not None:
                addresses[a.index].append(a)
    links.sort(key=lambda link: link.index)
    return links, dict(addresses)

"""Which links of this network namespace are the node's uplink, and why.

A link is the uplink when it, or any link stacked above it, carries a default route of any routing
table or holds an address of the Node (`--node-ips`: the DaemonSet gives status.hostIPs). Moved into a
pod or passed to a VM with its PCI function, it would take the node's way to the cluster with it, so
the agent does neither (docs/claims.md, "A NIC in the pod"). "Above" is followed upward, transitively:
- the link this one is a port of (IFLA_MASTER), whatever kind it is: a bridge, bond, team or VRF
  alike, so a kind the agent has never heard of is followed too;
- every link whose lower link this one is (IFLA_LINK: a VLAN, macvlan or ipvlan on it, and a veth's
  peer in the same namespace, which carries its traffic).
So the port of a bridge or bond that holds the node's address is the uplink, as is a NIC with a VLAN
on it that carries a default route.

NIC discovery marks each NIC with its reason (`NicFacts.uplink_reason`, published as `uplink`);
prepare asks again (`refuse_uplinks`), from the links and routes as they are then: a default route
added since the last scan is no event NIC discovery follows (it rescans on link and address events),
and a link made a bridge's port is rescanned only after the events' debounce.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from agent.errors import ClaimError
from agent.inventory.netlink import Link, NetState, net_state

log = logging.getLogger(__name__)

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class UplinkRefused(ClaimError):
    """A prepare would take the node's uplink from the host (move it into a pod, pass it through)."""


@functools.cache
def node_addresses(values: tuple[str, ...]) -> frozenset[IpAddress]:
    """The Node's addresses `--node-ips` gives (one that is no address logged, once, and left out)."""
    out: set[IpAddress] = set()
    for value in values:
        try:
            out.add(ipaddress.ip_address(value))
        except ValueError:
            log.warning("--node-ips: %r is not an IP address: left out", value[:80])
    return frozenset(out)


def uplink_reasons(state: NetState, node_ips: Collection[IpAddress]) -> dict[int, str]:
    """Link index -> why that link is the node's uplink, for each link of `state` that is one."""
    names = {link.index: link.ifname for link in state.links}
    carries: dict[int, str] = {}
    for route in state.routes:
        for index in route.interfaces:
            carries.setdefault(index, f"carries {route.described}")
    for index, addresses in sorted(state.addresses.items()):
        for a in addresses:
            if (ip := ipaddress.ip_interface(a.cidr).ip) in node_ips:
                carries.setdefault(index, f"holds {ip}, an address of the Node")
    uppers = _uppers(state.links)
    out: dict[int, str] = {}
    for link in state.links:
        if (reason := _reason(link.index, carries, uppers, names)) is not None:
            out[link.index] = reason
    return out


def _uppers(links: Iterable[Link]) -> dict[int, list[tuple[int, str]]]:
    """Link index -> the links directly above it, each with how it is above ("{a} ... {b}")."""
    out: dict[int, list[tuple[int, str]]] = {}
    for link in links:
        if link.master > 0:
            out.setdefault(link.index, []).append((link.master, "{a} is a port of {b}"))
        if link.lower > 0 and link.lower != link.index:
            out.setdefault(link.lower, []).append((link.index, "{b} is stacked on {a}"))
    return out


def _reason(start: int, carries: dict[int, str], uppers: dict[int, list[tuple[int, str]]],
            names: dict[int, str]) -> str | None:
    """Why link `start` is the uplink: the nearest link at or above it that carries a default route or
    a Node's address, and the way up to it; None when none does."""
    def name(index: int) -> str:
        return names.get(index) or f"link {index}"

    queue: deque[tuple[int, tuple[str, ...]]] = deque([(start, ())])
    seen = {start}
    while queue:
        index, way = queue.popleft()
        if index in carries:
            said = f"{name(index)} {carries[index]}"
            return f"{said}, and {', '.join(way)}" if way else said
        for above, how in uppers.get(index, ()):
            if above not in seen:
                seen.add(above)
                queue.append((above, (*way, how.format(a=name(index), b=name(above)))))
    return None


@dataclass(frozen=True, slots=True)
class Leaving:
    """A link a prepare would take from the host, and what becomes of it then."""

    device: str  # the claim's device
    interface: str
    fate: str  # "Moved into a pod it ...": the sentence after the reason
    known: str = ""  # why discovery found it the uplink, "" when it did not


def refuse_uplinks(leaving: Sequence[Leaving], node_ips: Collection[IpAddress]) -> None:
    """UplinkRefused when one of `leaving` is the uplink now, or was at the last scan (its published
    `uplink` says so). Blocking: a netlink dump, in the claim's thread."""
    if not leaving:
        return
    state = net_state()
    names = {link.index: link.ifname for link in state.links}
    now = {names[index]: reason for index, reason in uplink_reasons(state, node_ips).items()}
    for going in leaving:
        if reason := now.get(going.interface) or going.known:
            raise UplinkRefused(f"device {going.device} ({going.interface}) is this node's uplink: {reason}. "
                                f"{going.fate}")

"""Which interfaces carry this network namespace's default route, from the kernel's route tables as
procfs lists them (`/proc/thread-self/net/route` and `ipv6_route`: the calling thread's namespace, so
a scan run in a namespace a test entered reads that namespace's).

A NIC that carries the default route is how the node reaches the cluster: moved into a pod or passed
to a VM, it cuts the node off. NIC discovery marks it (`uplink`) and prepare refuses to move it.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

_NET = Path("/proc/thread-self/net")
_RTF_UP = 0x1
_RTF_REJECT = 0x200  # an unreachable route (the kernel lists one for ::/0 on lo)
_ALL_ZERO_V6 = "0" * 32


def default_route_interfaces(net: Path = _NET) -> frozenset[str]:
    """The interface names of every default route (IPv4 0.0.0.0/0, IPv6 ::/0) that is up; empty where
    procfs cannot be read (logged), as on a host without IPv6."""
    names: set[str] = set()
    try:
        lines = (net / "route").read_text().splitlines()[1:]  # Iface Destination Gateway Flags ... Mask
    except OSError as exc:
        log.debug("reading %s: %s", net / "route", exc)
        lines = []
    for line in lines:
        cols = line.split()
        if len(cols) >= 8 and int(cols[1], 16) == 0 and int(cols[7], 16) == 0 and _usable(int(cols[3], 16)):
            names.add(cols[0])
    try:
        lines6 = (net / "ipv6_route").read_text().splitlines()
    except OSError as exc:
        log.debug("reading %s: %s", net / "ipv6_route", exc)
        lines6 = []
    for line in lines6:
        # dest dest_len src src_len next_hop metric refcnt use flags iface
        cols = line.split()
        if (len(cols) == 10 and cols[0] == _ALL_ZERO_V6 and cols[1] == "00" and _usable(int(cols[8], 16))
                and cols[9] != "lo"):
            names.add(cols[9])
    return frozenset(names)


def _usable(flags: int) -> bool:
    return bool(flags & _RTF_UP) and not flags & _RTF_REJECT

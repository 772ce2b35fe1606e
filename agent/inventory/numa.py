"""NUMA topology from sysfs: which online CPUs and how much memory each node has.

Shared by the CPU and the memory source. Every function takes the sysfs root, so
tests run on trees of their own and the real `/sys` alike.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from agent.config import Settings
from agent.inventory.pci import read_text

_NODE_DIR = re.compile(r"^node(\d+)$")
_CPU_DIR = re.compile(r"^cpu(\d+)$")
_MEMTOTAL = re.compile(r"^Node\s+\d+\s+MemTotal:\s+(\d+)\s*kB\s*$", re.MULTILINE)
_PROC_MEMTOTAL = re.compile(r"^MemTotal:\s+(\d+)\s*kB\s*$", re.MULTILINE)


def parse_cpulist(text: str) -> list[int]:
    """`0-3,8-11` -> [0, 1, 2, 3, 8, 9, 10, 11]; an empty list is empty. ValueError on anything else."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        lo, hi = int(first), int(last) if sep else int(first)
        if hi < lo:
            raise ValueError(f"not a CPU list: {text!r}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def _cpu_dir(sysfs_root: Path) -> Path:
    return sysfs_root / "devices" / "system" / "cpu"


def online_cpus(sysfs_root: Path) -> set[int]:
    """The online CPUs: `cpu/online`, or, where that file is missing, each `cpuK` not marked offline."""
    base = _cpu_dir(sysfs_root)
    text = read_text(base / "online")
    if text is not None:
        return set(parse_cpulist(text))
    found: set[int] = set()
    try:
        entries = os.listdir(base)
    except OSError:
        return found
    for name in entries:
        m = _CPU_DIR.match(name)
        # cpu0 often has no `online` file: it cannot be taken offline.
        if m and read_text(base / name / "online") in (None, "1"):
            found.add(int(m.group(1)))
    return found


def numa_nodes(sysfs_root: Path) -> list[int] | None:
    """NUMA node ids, or None when the kernel has no NUMA support (no `devices/system/node`)."""
    base = sysfs_root / "devices" / "system" / "node"
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    return sorted(int(m.group(1)) for name in entries if (m := _NODE_DIR.match(name)))


def node_cpus(sysfs_root: Path, node: int) -> list[int]:
    """The node's CPUs, online or not; ValueError when its cpulist is unreadable."""
    path = sysfs_root / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    text = read_text(path)
    if text is None:
        raise ValueError(f"cannot read {path}")
    return parse_cpulist(text)


def node_memory(sysfs_root: Path, node: int) -> int | None:
    """MemTotal of the node in bytes; None when its meminfo is missing or has no MemTotal."""
    text = read_text(sysfs_root / "devices" / "system" / "node" / f"node{node}" / "meminfo")
    m = _MEMTOTAL.search(text or "")
    return int(m.group(1)) * 1024 if m else None


def system_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    m = _PROC_MEMTOTAL.search(read_text(meminfo) or "")
    return int(m.group(1)) * 1024 if m else None


def is_host_sysfs(sysfs_root: Path) -> bool:
    """True when the root is this machine's own `/sys`, so `/proc` describes the same machine."""
    return os.path.realpath(sysfs_root) == "/sys"


def cpu_package(sysfs_root: Path, cpu: int) -> int | None:
    text = read_text(_cpu_dir(sysfs_root) / f"cpu{cpu}" / "topology" / "physical_package_id")
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def cpu_siblings(sysfs_root: Path, cpu: int) -> set[int]:
    """The CPU's hardware threads (itself included); just itself when the topology is unreadable."""
    text = read_text(_cpu_dir(sysfs_root) / f"cpu{cpu}" / "topology" / "thread_siblings_list")
    try:
        return set(parse_cpulist(text)) | {cpu} if text else {cpu}
    except ValueError:
        return {cpu}


class NodeResourceSource:
    """What the CPU and memory sources share: sysfs only, nothing to open, and the
    node-allocatable switch."""

    kind = ""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Set by the daemon when the Node declares DRANodeAllocatableResources; the API server
        # rejects the consumable-capacity and node-allocatable fields otherwise.
        self.node_allocatable: bool = False

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

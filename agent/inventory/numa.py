"""NUMA topology from sysfs: which online CPUs and how much memory each node has.

Shared by the CPU and the memory source. Every function takes the sysfs root, so
tests run on trees of their own and the real `/sys` alike.

A node's memory is the size of its online memory blocks (`online_block_memory`), not the
`MemTotal` of its `meminfo`: MemTotal counts the pages the kernel has initialised, and a VM
kernel that initialises memory lazily (Firecracker with `deferred_init=lazy`) makes it grow
the first time memory is touched (4.2 GB, then 10.4, 17.6, 24.08 GB on one such node). A
capacity that moves republishes the ResourceSlices at every rescan that sees it move and
changes what the scheduler may allocate. The blocks change only when memory is really
hot-plugged or taken offline. They count the memory the kernel reserved for itself (its
image, the page structures, a crash kernel) too, and whole blocks, so on an ordinary machine
they come to a few percent more than MemTotal. MemTotal is the fallback where sysfs has no
memory-block interface (`devices/system/memory`, a kernel without memory hotplug).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.config import Settings
from agent.host.pci import read_text
from agent.model import NUMA_NODE, Device, IntList

_NODE_DIR = re.compile(r"^node(\d+)$")
_CPU_DIR = re.compile(r"^cpu(\d+)$")
_MEMTOTAL = re.compile(r"^Node\s+\d+\s+MemTotal:\s+(\d+)\s*kB\s*$", re.MULTILINE)
_PROC_MEMTOTAL = re.compile(r"^MemTotal:\s+(\d+)\s*kB\s*$", re.MULTILINE)
_MEMORY_BLOCK = re.compile(r"^memory(\d+)$")


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


def format_cpulist(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> `0-2,5`, the form `parse_cpulist` reads."""
    ids = sorted(set(cpus))
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


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


@dataclass(frozen=True, slots=True)
class BlockMemory:
    """Bytes of online memory blocks: per NUMA node, and in all (blocks of no node included)."""

    per_node: dict[int, int]
    total: int


def online_block_memory(sysfs_root: Path) -> BlockMemory | None:
    """The online memory blocks: `block_size_bytes` (hex) times the `memory<K>` blocks whose
    `state` is `online`, each counted for the node whose `node<N>/memory<K>` link names it.

    None when sysfs has no memory-block interface (no readable `block_size_bytes`): the caller
    falls back to MemTotal. A block that the kernel linked to two nodes (boot memory spanning a
    node boundary) counts for the lowest, so no byte counts twice. A node with no online block
    is absent from `per_node`; without NUMA (no `devices/system/node`) only `total` is filled.
    """
    base = sysfs_root / "devices" / "system" / "memory"
    text = read_text(base / "block_size_bytes")
    try:
        block_size = int(text, 16) if text else 0
    except ValueError:
        block_size = 0
    if block_size <= 0:
        return None
    try:
        blocks = [int(m.group(1)) for name in os.listdir(base) if (m := _MEMORY_BLOCK.match(name))]
    except OSError:
        return None
    owner: dict[int, int] = {}
    for node in sorted(numa_nodes(sysfs_root) or [], reverse=True):  # the lowest node wins
        try:
            entries = os.listdir(sysfs_root / "devices" / "system" / "node" / f"node{node}")
        except OSError:
            continue
        owner.update((int(m.group(1)), node) for name in entries if (m := _MEMORY_BLOCK.match(name)))
    per_node: dict[int, int] = {}
    total = 0
    for block in blocks:
        if read_text(base / f"memory{block}" / "state") != "online":
            continue
        total += block_size
        if (home := owner.get(block)) is not None:
            per_node[home] = per_node.get(home, 0) + block_size
    return BlockMemory(per_node=per_node, total=total)


def node_memory(sysfs_root: Path, node: int) -> int | None:
    """MemTotal of the node in bytes; None when its meminfo is missing or has no MemTotal.

    Only the fallback without memory blocks: MemTotal grows with use on lazily initialised
    VMs (see the module docstring).
    """
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


@dataclass(frozen=True, slots=True)
class NumaTopology:
    """The NUMA nodes' distances (the firmware's SLIT, `node<N>/distance`) and the socket of each node
    that has CPUs (`physical_package_id` of its first CPU that says one)."""

    distances: dict[int, tuple[int, ...]]
    sockets: dict[int, int]

    def numa_list(self, node: int) -> tuple[int, ...]:
        """The list form of the standard `numaNode` attribute of a device on `node`: the node itself,
        then the other nodes at the smallest distance any other node has from it that are on its socket
        (a node whose socket is unknown, a CPU-less memory node, counts as on it), in order. Just the node
        when its distances are unknown. Every driver on the node must derive the same list for a
        `matchAttribute` constraint across drivers to mean one thing, hence exactly this rule."""
        row = self.distances.get(node)
        if row is None or node >= len(row):
            return (node,)
        others = [d for i, d in enumerate(row) if i != node]
        if not others:
            return (node,)
        nearest = min(others)
        socket = self.sockets.get(node)
        near = [i for i, d in enumerate(row) if i != node and d == nearest
                and (socket is None or self.sockets.get(i, socket) == socket)]
        return (node, *sorted(near))


def numa_topology(sysfs_root: Path) -> NumaTopology:
    """The topology as sysfs shows it; nodes whose distance row is unreadable are left out."""
    distances: dict[int, tuple[int, ...]] = {}
    sockets: dict[int, int] = {}
    for node in numa_nodes(sysfs_root) or []:
        text = read_text(sysfs_root / "devices" / "system" / "node" / f"node{node}" / "distance")
        try:
            row = tuple(int(f) for f in (text or "").split())
        except ValueError:
            row = ()
        if row:
            distances[node] = row
        try:
            cpus = node_cpus(sysfs_root, node)
        except ValueError:
            cpus = []
        # An offline CPU has no topology: the first CPU that says its package.
        if (package := next((p for c in cpus if (p := cpu_package(sysfs_root, c)) is not None), None)) is not None:
            sockets[node] = package
    return NumaTopology(distances, sockets)


class NumaForm:
    """The form the standard `numaNode` attribute of every device is published in: the scalar node (any
    cluster), or with `lists` on (the `DRAListTypeAttributes` gate) the list `NumaTopology.numa_list`
    gives, so a `matchAttribute` constraint also matches devices on nearby nodes of one socket. Applied to
    every scanned device (`agent.app.assembly.PublishedForm`): slices, metadata files and the CLI agree."""

    def __init__(self, sysfs_root: Path) -> None:
        self.sysfs_root = sysfs_root
        self._topology: NumaTopology | None = None

    @property
    def lists(self) -> bool:
        return self._topology is not None

    def set_lists(self, on: bool) -> None:
        """Lists on (the topology read now: it changes only when NUMA nodes are hot-plugged) or off."""
        self._topology = numa_topology(self.sysfs_root) if on else None

    def __call__(self, device: Device) -> Device:
        value = device.attributes.get(NUMA_NODE)
        if self._topology is None or type(value) is not int:
            return device
        return dataclasses.replace(device, attributes={
            **device.attributes, NUMA_NODE: IntList(self._topology.numa_list(value))})

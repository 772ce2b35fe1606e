"""A sysfs tree of a two-socket machine for CPU and NUMA discovery (`--sysfs-root`): what the kernel
shows under devices/system for CPUs, NUMA nodes with their firmware distances, and memory blocks.

Default: 4 NUMA nodes, nodes 0 and 1 on socket 0, nodes 2 and 3 on socket 1; each node 2 cores of 2
hardware threads (node n: CPUs 2n, 2n+1 and their siblings 8+2n, 9+2n) and 4 GiB of memory; distances
10 to itself, 11 within a socket, 21 across.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

GIB = 1 << 30


def cpus_of(node: int, cores: int = 2, nodes: int = 4) -> list[int]:
    """Node `node`'s CPUs: its cores' first threads, then their siblings."""
    first = [cores * node + c for c in range(cores)]
    return first + [c + cores * nodes for c in first]


def build_topology(root: Path, *, sockets: Sequence[int] = (0, 0, 1, 1), cores: int = 2,
                   distances: Sequence[Sequence[int]] | None = None, numa: bool = True) -> Path:
    """The tree under `root` (a `sys` directory); `sockets[n]` is node n's package. Without `numa`, no
    devices/system/node (a kernel without NUMA: the whole machine is one node)."""
    nodes = len(sockets)
    if distances is None:
        distances = [[10 if i == j else 11 if sockets[i] == sockets[j] else 21 for j in range(nodes)]
                     for i in range(nodes)]
    total = 2 * cores * nodes
    cpu_dir = root / "devices" / "system" / "cpu"
    cpu_dir.mkdir(parents=True)
    (cpu_dir / "online").write_text(f"0-{total - 1}\n")
    (cpu_dir / "possible").write_text(f"0-{total - 1}\n")
    for node in range(nodes):
        mine = cpus_of(node, cores, nodes)
        for i, cpu in enumerate(mine):
            d = cpu_dir / f"cpu{cpu}" / "topology"
            d.mkdir(parents=True)
            (d / "physical_package_id").write_text(f"{sockets[node]}\n")
            core = mine[i % cores]
            (d / "thread_siblings_list").write_text(f"{core},{core + cores * nodes}\n")
    memory = root / "devices" / "system" / "memory"
    memory.mkdir(parents=True)
    (memory / "block_size_bytes").write_text(f"{GIB:x}\n")
    for node in range(nodes):
        for k in range(4):
            block = memory / f"memory{4 * node + k}"
            block.mkdir()
            (block / "state").write_text("online\n")
    if numa:
        base = root / "devices" / "system" / "node"
        for node in range(nodes):
            d = base / f"node{node}"
            d.mkdir(parents=True)
            mine = sorted(cpus_of(node, cores, nodes))
            (d / "cpulist").write_text(",".join(map(str, mine)) + "\n")
            (d / "distance").write_text(" ".join(map(str, distances[node])) + "\n")
            for k in range(4):
                (d / f"memory{4 * node + k}").mkdir()
        (base / "online").write_text(f"0-{nodes - 1}\n")
    return root

"""CPU and memory per NUMA node: a built sysfs tree with every corner, and this machine's own /sys."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from agent import apirules, quantity
from agent.config import Settings
from agent.facts import CpuFacts
from agent.inventory.cpus import CpuSource
from agent.inventory.memory import MemorySource
from agent.inventory.numa import parse_cpulist
from agent.model import NUMA_NODE, Capacity

GiB_KB = 1024 * 1024

# Two sockets, 16 hardware threads (core k has threads k and k + 8), five NUMA nodes:
#   node 0: socket 0, CPUs 0-1,8-9 (9 offline: SMT still on via 0/8), 64 GiB
#   node 1: socket 0, CPUs 2-3,10-11, all online, 64 GiB
#   node 2: socket 1, CPUs 4-5,12-13, all offline, 32 GiB: memory but no cpu device
#   node 3: socket 1, CPUs 6-7,14-15 (14, 15 offline: no SMT left), no memory
#   node 4: memory only (CXL expander), 128 GiB
NODES = {0: ("0-1,8-9", 64 * GiB_KB), 1: ("2-3,10-11", 64 * GiB_KB), 2: ("4-5,12-13", 32 * GiB_KB),
         3: ("6-7,14-15", 0), 4: ("", 128 * GiB_KB)}
ONLINE = "0-3,6-8,10-11"


def meminfo(node: int, kb: int) -> str:
    lines = [("MemTotal", kb), ("MemFree", kb // 2), ("MemUsed", kb - kb // 2), ("SwapCached", 0),
             ("Active", 0), ("HugePages_Total", 0)]
    return "".join(f"Node {node} {k}:{v:>16} kB\n" if not k.startswith("HugePages")
                   else f"Node {node} {k}:{v:>6}\n" for k, v in lines)


def build_sysfs(root: Path, numa: bool = True) -> Path:
    cpu = root / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(ONLINE + "\n")
    (cpu / "possible").write_text("0-15\n")
    online = set(parse_cpulist(ONLINE))
    for k in range(16):
        d = cpu / f"cpu{k}"
        d.mkdir()
        if k:
            (d / "online").write_text("1\n" if k in online else "0\n")
        if k not in online:
            continue  # the kernel drops an offline CPU's topology
        topo = d / "topology"
        topo.mkdir()
        (topo / "physical_package_id").write_text("0\n" if k % 8 < 4 else "1\n")
        # Listing an offline sibling too: discovery must not count it.
        (topo / "thread_siblings_list").write_text(f"{k % 8},{k % 8 + 8}\n")
    if numa:
        for n, (cpulist, kb) in NODES.items():
            d = root / "devices" / "system" / "node" / f"node{n}"
            d.mkdir(parents=True)
            (d / "cpulist").write_text(cpulist + "\n")
            (d / "meminfo").write_text(meminfo(n, kb))
        (root / "devices" / "system" / "node" / "online").write_text("0-4\n")
    return root


# Memory blocks of 1 GiB (the kernel's block_size_bytes is hex without 0x), per node as
# (online, offline) counts; deliberately not what the nodes' MemTotal says, as on a real machine
# where the blocks also hold what the kernel reserved.
BLOCK_SIZE = 1 << 30
BLOCKS = {0: (66, 2), 1: (65, 0), 2: (33, 31), 4: (130, 1)}


def add_memory_blocks(root: Path, blocks: dict[int, tuple[int, int]] = BLOCKS) -> dict[int, list[int]]:
    """The memory-block interface: `memory/memory<K>/{state,node<N>}` and `node/node<N>/memory<K>`,
    links both ways as the kernel makes them. Returns each node's block numbers."""
    memory = root / "devices" / "system" / "memory"
    memory.mkdir(parents=True)
    (memory / "block_size_bytes").write_text(f"{BLOCK_SIZE:x}\n")
    (memory / "auto_online_blocks").write_text("online\n")
    out: dict[int, list[int]] = {}
    k = 0
    for node, (online, offline) in blocks.items():
        for i in range(online + offline):
            block = memory / f"memory{k}"
            block.mkdir()
            (block / "state").write_text("online\n" if i < online else "offline\n")
            (block / "phys_index").write_text(f"{k:08x}\n")
            node_dir = root / "devices" / "system" / "node" / f"node{node}"
            if node_dir.is_dir():
                (block / f"node{node}").symlink_to(f"../../node/node{node}")
                (node_dir / f"memory{k}").symlink_to(f"../../memory/memory{k}")
            out.setdefault(node, []).append(k)
            k += 1
    return out


def settings(sysfs: Path) -> Settings:
    return Settings(node_name="node-a", sysfs_root=sysfs)


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8-11\n") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_cpulist("5") == [5] and parse_cpulist("") == [] and parse_cpulist("\n") == []
    assert parse_cpulist("3,1-2,2") == [1, 2, 3]
    for bad in ("a-b", "3-1", "1-", "0-3:2"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_cpu_devices_per_numa_node(tmp_path: Path) -> None:
    result = CpuSource(settings(build_sysfs(tmp_path))).scan()
    assert result.failed_devices == [] and result.problems == []
    got = {d.name: (d.kind, d.attributes, d.capacity, d.node) for d in result.devices}
    assert got == {
        "cpu-numa0": ("cpu", {"type": "cpu", NUMA_NODE: 0, "socket": 0, "smt": True},
                      {"cpus": Capacity("3")}, CpuFacts(cpus=(0, 1, 8), cores=((0, 8), (1,)))),
        "cpu-numa1": ("cpu", {"type": "cpu", NUMA_NODE: 1, "socket": 0, "smt": True},
                      {"cpus": Capacity("4")}, CpuFacts(cpus=(2, 3, 10, 11), cores=((2, 10), (3, 11)))),
        "cpu-numa3": ("cpu", {"type": "cpu", NUMA_NODE: 3, "socket": 1, "smt": False},
                      {"cpus": Capacity("2")}, CpuFacts(cpus=(6, 7), cores=((6,), (7,)))),
    }
    for dev in result.devices:
        wire = dev.wire()
        assert "allowMultipleAllocations" not in wire and "nodeAllocatableResources" not in wire
        assert "requestPolicy" not in wire["capacity"]["cpus"]
        assert apirules.device_wire_errors(wire) == []


def test_memory_devices_per_numa_node_from_memtotal_without_memory_blocks(tmp_path: Path) -> None:
    # A kernel without memory hotplug has no memory-block interface: each node's MemTotal it is.
    sysfs = build_sysfs(tmp_path)
    assert not (sysfs / "devices" / "system" / "memory").exists()
    result = MemorySource(settings(sysfs)).scan()
    assert result.failed_devices == [] and result.problems == []
    assert {d.name: (d.kind, d.attributes, d.capacity) for d in result.devices} == {
        "memory-numa0": ("memory", {"type": "memory", NUMA_NODE: 0}, {"memory": Capacity("64Gi")}),
        "memory-numa1": ("memory", {"type": "memory", NUMA_NODE: 1}, {"memory": Capacity("64Gi")}),
        "memory-numa2": ("memory", {"type": "memory", NUMA_NODE: 2}, {"memory": Capacity("32Gi")}),
        "memory-numa4": ("memory", {"type": "memory", NUMA_NODE: 4}, {"memory": Capacity("128Gi")}),
    }
    for dev in result.devices:
        wire = dev.wire()
        assert "allowMultipleAllocations" not in wire and "nodeAllocatableResources" not in wire
        assert apirules.device_wire_errors(wire) == []


def memory_capacities(sysfs: Path) -> dict[str, str]:
    return {d.name: d.capacity["memory"].value for d in MemorySource(settings(sysfs)).scan().devices}


def test_memory_from_online_blocks(tmp_path: Path) -> None:
    sysfs = build_sysfs(tmp_path)
    add_memory_blocks(sysfs)
    # Online blocks times the block size, offline blocks left out; the node without memory
    # (node 3) has no device, and MemTotal (64, 64, 32, 128 GiB) plays no part.
    assert memory_capacities(sysfs) == {
        "memory-numa0": "66Gi", "memory-numa1": "65Gi", "memory-numa2": "33Gi", "memory-numa4": "130Gi"}
    # Only "online" counts: a block on its way out no longer does.
    memory = sysfs / "devices" / "system" / "memory"
    (memory / "memory0" / "state").write_text("going-offline\n")
    assert memory_capacities(sysfs)["memory-numa0"] == "65Gi"


def test_block_linked_to_two_nodes_counts_once(tmp_path: Path) -> None:
    sysfs = build_sysfs(tmp_path)
    blocks = add_memory_blocks(sysfs)
    # Boot memory spanning a node boundary: the kernel links the block under both nodes.
    shared = blocks[1][0]
    (sysfs / "devices" / "system" / "node" / "node0" / f"memory{shared}").symlink_to(
        f"../../memory/memory{shared}")
    got = memory_capacities(sysfs)
    assert (got["memory-numa0"], got["memory-numa1"]) == ("67Gi", "64Gi")


def test_growing_memtotal_does_not_move_the_capacity(tmp_path: Path) -> None:
    # A lazily initialised VM (Firecracker, deferred_init=lazy): MemTotal grows as memory is first
    # touched, here 4 GiB, then 10, then 24. The capacity, and so the slice, stays the same.
    sysfs = build_sysfs(tmp_path)
    add_memory_blocks(sysfs)
    node0 = sysfs / "devices" / "system" / "node" / "node0" / "meminfo"
    seen = []
    for gib in (4, 10, 24, 64):
        node0.write_text(meminfo(0, gib * GiB_KB))
        seen.append(memory_capacities(sysfs))
    assert all(s == seen[0] for s in seen) and seen[0]["memory-numa0"] == "66Gi"
    # Memory really taken offline (hot-unplug) is a change, and is published.
    blocks = sysfs / "devices" / "system" / "memory"
    for k in range(2):
        (blocks / f"memory{k}" / "state").write_text("offline\n")
    assert memory_capacities(sysfs)["memory-numa0"] == "64Gi"


def test_unreadable_block_size_falls_back_to_memtotal(tmp_path: Path) -> None:
    sysfs = build_sysfs(tmp_path)
    add_memory_blocks(sysfs)
    size = sysfs / "devices" / "system" / "memory" / "block_size_bytes"
    for text in ("", "zz\n", "0\n"):
        size.write_text(text)
        assert memory_capacities(sysfs)["memory-numa0"] == "64Gi"
    size.unlink()
    assert memory_capacities(sysfs)["memory-numa4"] == "128Gi"


def test_node_allocatable_fields(tmp_path: Path) -> None:
    sysfs = build_sysfs(tmp_path)
    cpus, memory = CpuSource(settings(sysfs)), MemorySource(settings(sysfs))
    assert cpus.node_allocatable is False and memory.node_allocatable is False
    cpus.node_allocatable = memory.node_allocatable = True
    cpu_wire = {d.name: d.wire() for d in cpus.scan().devices}["cpu-numa1"]
    mem_wire = {d.name: d.wire() for d in memory.scan().devices}["memory-numa4"]
    assert cpu_wire["allowMultipleAllocations"] is True
    assert cpu_wire["capacity"] == {"cpus": {"value": "4", "requestPolicy": {
        "default": "1", "validRange": {"min": "1", "step": "1"}}}}
    assert cpu_wire["nodeAllocatableResources"] == {
        "cpu": {"mapping": {"capacityKey": "cpus", "capacityMultiplier": "1"}}}
    assert mem_wire["allowMultipleAllocations"] is True
    assert mem_wire["capacity"] == {"memory": {"value": "128Gi", "requestPolicy": {
        "default": "1Mi", "validRange": {"min": "1Mi", "step": "1Mi"}}}}
    assert mem_wire["nodeAllocatableResources"] == {
        "memory": {"mapping": {"capacityKey": "memory", "capacityMultiplier": "1"}}}
    for dev in cpus.scan().devices + memory.scan().devices:
        assert apirules.device_wire_errors(dev.wire()) == []
    # Switching off again (the Node stopped declaring the feature) drops the fields.
    cpus.node_allocatable = False
    assert all("nodeAllocatableResources" not in d.wire() for d in cpus.scan().devices)


def test_kernel_without_numa(tmp_path: Path) -> None:
    sysfs = build_sysfs(tmp_path, numa=False)
    (dev,) = CpuSource(settings(sysfs)).scan().devices
    assert dev.name == "cpu-numa0" and dev.capacity == {"cpus": Capacity("9")}
    assert dev.node.cpus == (0, 1, 2, 3, 6, 7, 8, 10, 11)
    assert dev.attributes == {"type": "cpu", NUMA_NODE: 0, "socket": 0, "smt": True}
    # /proc/meminfo describes this machine, not the tree: no memory device rather than a wrong one.
    assert MemorySource(settings(sysfs)).scan().devices == []
    # With memory blocks the tree itself says: every online block, none linked to a node.
    add_memory_blocks(sysfs, {0: (3, 1), 1: (5, 0)})
    (mem,) = MemorySource(settings(sysfs)).scan().devices
    assert mem.name == "memory-numa0" and mem.capacity == {"memory": Capacity("8Gi")}
    assert mem.attributes == {"type": "memory", NUMA_NODE: 0}


def test_unreadable_cpulist_fails_only_that_node(tmp_path: Path) -> None:
    sysfs = build_sysfs(tmp_path)
    (sysfs / "devices" / "system" / "node" / "node1" / "cpulist").write_text("garbage\n")
    result = CpuSource(settings(sysfs)).scan()
    assert [d.name for d in result.devices] == ["cpu-numa0", "cpu-numa3"]
    [failure] = result.failed_devices
    assert failure.device == "cpu-numa1" and "garbage" in failure.reason


def test_online_file_missing_falls_back_to_per_cpu_flags(tmp_path: Path) -> None:
    sysfs = build_sysfs(tmp_path)
    (sysfs / "devices" / "system" / "cpu" / "online").unlink()
    devices = CpuSource(settings(sysfs)).scan().devices
    assert [d.node.cpus for d in devices] == [(0, 1, 8), (2, 3, 10, 11), (6, 7)]


# This machine's own /sys.

def kernel_managed_bytes() -> int:
    """Memory the kernel manages, summed over /proc/zoneinfo: what per-node MemTotal counts."""
    text = Path("/proc/zoneinfo").read_text()
    return sum(int(n) for n in re.findall(r"^\s+managed\s+(\d+)$", text, re.MULTILINE)) * os.sysconf(
        "SC_PAGE_SIZE")


def test_real_sys_cpus_add_up() -> None:
    devices = CpuSource(Settings(node_name="node-a")).scan().devices
    assert devices, "this machine has online CPUs"
    assert sum(quantity.parse_int(d.capacity["cpus"].value) for d in devices) == os.sysconf(
        "SC_NPROCESSORS_ONLN")
    ids = [c for d in devices for c in d.node.cpus]
    assert len(ids) == len(set(ids)), "a CPU counted in two nodes"
    for dev in devices:
        assert apirules.device_wire_errors(dev.wire()) == []


def real_online_blocks() -> dict[int | None, int] | None:
    """Bytes of this machine's online memory blocks per node (None: linked to no node), read through
    each block's own `node<N>` entry, the other end of the link the agent reads; None when /sys has
    no memory-block interface."""
    base = Path("/sys/devices/system/memory")
    if not (base / "block_size_bytes").exists():
        return None
    size = int((base / "block_size_bytes").read_text(), 16)
    out: dict[int | None, int] = {}
    for block in base.glob("memory[0-9]*"):
        if (block / "state").read_text().strip() != "online":
            continue
        nodes = sorted(int(e.name[4:]) for e in block.iterdir() if re.fullmatch(r"node\d+", e.name))
        key = nodes[0] if nodes else None
        out[key] = out.get(key, 0) + size
    return out


def test_real_sys_memory_adds_up() -> None:
    devices = MemorySource(Settings(node_name="node-a")).scan().devices
    assert devices, "this machine has memory"
    published = sum(quantity.parse_int(d.capacity["memory"].value) for d in devices)
    proc = int(re.search(r"^MemTotal:\s+(\d+) kB$", Path("/proc/meminfo").read_text(), re.MULTILINE)
               .group(1)) * 1024  # type: ignore[union-attr]
    blocks = real_online_blocks()
    if blocks is not None:
        got = {d.attributes[NUMA_NODE]: quantity.parse_int(d.capacity["memory"].value) for d in devices}
        if Path("/sys/devices/system/node").is_dir():
            assert got == {n: size for n, size in blocks.items() if n is not None}
        else:
            assert got == {0: sum(blocks.values())}
        # The blocks hold all MemTotal counts and what the kernel reserved besides (more still on a
        # lazily initialised VM, where MemTotal has not caught up yet), but not twice as much.
        assert proc <= sum(blocks.values()) <= 2 * proc, (blocks, proc)
    else:
        # No memory blocks: each node's MemTotal. Some VM kernels (Firecracker with lazy memory init)
        # count memory in /proc/meminfo before its pages are initialized; the per-node totals, and so
        # the slice, follow the initialized pages.
        managed = kernel_managed_bytes()
        if abs(managed - proc) <= proc * 0.01:
            assert abs(published - proc) <= proc * 0.01, (published, proc)
        else:
            assert abs(published - managed) <= managed * 0.01, (published, managed, proc)
    for dev in devices:
        assert apirules.device_wire_errors(dev.wire()) == []

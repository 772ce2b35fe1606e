"""Memory per NUMA node, as consumable capacity: one `memory-numa<N>` device per node with memory.

A node's capacity is its online memory blocks (block size times online blocks), which stays put
while the node runs; its meminfo `MemTotal` is only the fallback where sysfs has no memory-block
interface. MemTotal grows as memory is first touched on a VM that initialises memory lazily
(Firecracker, `deferred_init=lazy`), and a capacity that moves republishes the slices and changes
what the scheduler may allocate. The blocks include what the kernel reserved for itself, so on an
ordinary machine the capacity is a few percent more than MemTotal. See `agent.inventory.numa`.
"""

from __future__ import annotations

from typing import Any

from agent import quantity
from agent.facts import MemoryFacts
from agent.inventory import ScanResult
from agent.inventory.numa import (
    NodeResourceSource,
    is_host_sysfs,
    node_memory,
    numa_nodes,
    online_block_memory,
    system_memory,
)
from agent.inventory.published import attributes
from agent.kinds import Kind
from agent.model import Capacity, Device


# Mebibyte granularity: finer requests only fragment the node for no workload's benefit.
def memory_request_policy() -> dict[str, Any]:
    return {"default": "1Mi", "validRange": {"min": "1Mi", "step": "1Mi"}}


def memory_node_allocatable() -> dict[str, Any]:
    return {"memory": {"mapping": {"capacityKey": "memory", "capacityMultiplier": "1"}}}


class MemorySource(NodeResourceSource):
    kind = "memory"

    def scan(self) -> ScanResult:
        root = self.settings.sysfs_root
        nodes = numa_nodes(root)
        blocks = online_block_memory(root)
        sizes: dict[int, int | None] = {}
        if nodes is None:
            # No NUMA in this kernel: the whole machine is node 0. Without memory blocks only /proc
            # of this very machine can say how big it is; a sysfs tree elsewhere has no meminfo.
            if blocks is not None:
                sizes[0] = blocks.total
            else:
                sizes[0] = system_memory() if is_host_sysfs(root) else None
        elif blocks is not None:
            sizes = {node: blocks.per_node.get(node, 0) for node in nodes}
        else:
            sizes = {node: node_memory(root, node) for node in nodes}
        return ScanResult(devices=[self._device(node, size) for node, size in sorted(sizes.items()) if size])

    def _device(self, node: int, size: int) -> Device:
        policy = memory_request_policy() if self.node_allocatable else None
        facts = MemoryFacts(node)
        return Device(
            name=f"memory-numa{node}",
            kind=Kind.MEMORY,
            attributes=attributes(facts),
            capacity={"memory": Capacity(quantity.binary(size), request_policy=policy)},
            allow_multiple_allocations=self.node_allocatable,
            node_allocatable=memory_node_allocatable() if self.node_allocatable else None,
            node=facts,
        )

"""Memory per NUMA node, as consumable capacity: one `memory-numa<N>` device per node with memory."""

from __future__ import annotations

from typing import Any

from agent import quantity
from agent.inventory import ScanResult
from agent.inventory.numa import NodeResourceSource, is_host_sysfs, node_memory, numa_nodes, system_memory
from agent.model import NUMA_NODE, Capacity, Device


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
        sizes: dict[int, int | None] = {}
        if nodes is None:
            # No NUMA in this kernel: the whole machine is node 0, but only /proc of this very
            # machine can say how big it is; a sysfs tree elsewhere has no meminfo to read.
            sizes[0] = system_memory() if is_host_sysfs(root) else None
        else:
            sizes = {node: node_memory(root, node) for node in nodes}
        return ScanResult(devices=[self._device(node, size) for node, size in sorted(sizes.items()) if size])

    def _device(self, node: int, size: int) -> Device:
        policy = memory_request_policy() if self.node_allocatable else None
        return Device(
            name=f"memory-numa{node}",
            kind="memory",
            attributes={"type": "memory", NUMA_NODE: node},
            capacity={"memory": Capacity(quantity.binary(size), request_policy=policy)},
            allow_multiple_allocations=self.node_allocatable,
            node_allocatable=memory_node_allocatable() if self.node_allocatable else None,
        )

"""CPUs per NUMA node, as consumable capacity: one `cpu-numa<N>` device per node with online CPUs."""

from __future__ import annotations

from typing import Any

from agent import quantity
from agent.facts import CpuFacts
from agent.inventory import DeviceFailure, ScanResult
from agent.inventory.numa import (
    NodeResourceSource,
    cpu_package,
    cpu_siblings,
    node_cpus,
    numa_nodes,
    online_cpus,
)
from agent.inventory.published import attributes
from agent.kinds import Kind
from agent.model import NUMA_NODE, Capacity, Device


# Whole CPUs, any number of them: the scheduler hands out slices of one device to many claims.
def cpu_request_policy() -> dict[str, Any]:
    return {"default": "1", "validRange": {"min": "1", "step": "1"}}


def cpu_node_allocatable() -> dict[str, Any]:
    return {"cpu": {"mapping": {"capacityKey": "cpus", "capacityMultiplier": "1"}}}


class CpuSource(NodeResourceSource):
    kind = "cpu"

    def scan(self) -> ScanResult:
        root = self.settings.sysfs_root
        online = online_cpus(root)
        nodes = numa_nodes(root)
        result = ScanResult()
        groups: dict[int, list[int]] = {}
        if nodes is None:
            groups[0] = sorted(online)
        else:
            for node in nodes:
                try:
                    groups[node] = [c for c in node_cpus(root, node) if c in online]
                except ValueError as exc:
                    result.failed_devices.append(DeviceFailure(f"cpu-numa{node}", str(exc)))
        for node, cpus in sorted(groups.items()):
            if cpus:
                result.devices.append(self._device(node, cpus, online))
        return result

    def _device(self, node: int, cpus: list[int], online: set[int]) -> Device:
        root = self.settings.sysfs_root
        facts = CpuFacts(tuple(cpus))
        attrs = attributes(facts) | {NUMA_NODE: node}
        socket = next((p for c in cpus if (p := cpu_package(root, c)) is not None), None)
        if socket is not None:
            attrs["socket"] = socket
        attrs["smt"] = any((cpu_siblings(root, c) & online) - {c} for c in cpus)
        policy = cpu_request_policy() if self.node_allocatable else None
        return Device(
            name=f"cpu-numa{node}",
            kind=Kind.CPU,
            attributes=attrs,
            capacity={"cpus": Capacity(quantity.decimal(len(cpus)), request_policy=policy)},
            allow_multiple_allocations=self.node_allocatable,
            node_allocatable=cpu_node_allocatable() if self.node_allocatable else None,
            node=facts,
        )

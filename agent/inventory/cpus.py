"""CPUs per NUMA node, as consumable capacity: one `cpu-numa<N>` device per node with online CPUs.

With `--kubevirt-cpu` the device also speaks the names KubeVirt's `CPUsWithDRA` asks for: its CPUs are
counted under `dra.cpu/cpu` (instead of `cpus`), it carries `dra.cpu/socketID` (the package of its CPUs,
from `topology/physical_package_id`), and it is shared by claims whatever the Node declares: each VM's
claim asks for `dra.cpu/cpu: N` per guest socket, and the scheduler hands out N of the node's CPUs.
Only one capacity counts the CPUs: the scheduler keeps each capacity of a device on its own books (a
request naming one consumes the other's default), so publishing both `cpus` and `dra.cpu/cpu` would let
it hand out the same CPUs twice.
"""

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

CPU_CAPACITY = "cpus"
# What KubeVirt's CPUsWithDRA asks for: a capacity request per guest socket, and a distinct socket per
# request when the guest has more than one. The socket attribute is named as an attribute can be: the
# API server refuses a name whose part after the domain is not a C identifier (`dra.cpu/socket-id`),
# as an attribute and in a claim's distinctAttribute alike (tests/cluster/test_cluster_kubevirt_cpu.py).
KUBEVIRT_CPU_CAPACITY = "dra.cpu/cpu"
KUBEVIRT_SOCKET = "dra.cpu/socketID"


# Whole CPUs, any number of them: the scheduler hands out slices of one device to many claims.
def cpu_request_policy() -> dict[str, Any]:
    return {"default": "1", "validRange": {"min": "1", "step": "1"}}


def cpu_node_allocatable(capacity: str = CPU_CAPACITY) -> dict[str, Any]:
    return {"cpu": {"mapping": {"capacityKey": capacity, "capacityMultiplier": "1"}}}


def cpu_capacity_name(kubevirt: bool) -> str:
    return KUBEVIRT_CPU_CAPACITY if kubevirt else CPU_CAPACITY


def cpu_cores(cpus: list[int], siblings: dict[int, set[int]]) -> tuple[tuple[int, ...], ...]:
    """The device's CPUs grouped by core (each group its online hardware threads among `cpus`), in the
    order of their first CPU."""
    seen: set[int] = set()
    cores: list[tuple[int, ...]] = []
    mine = set(cpus)
    for cpu in cpus:
        if cpu in seen:
            continue
        core = tuple(sorted((siblings.get(cpu, {cpu}) & mine) | {cpu}))
        seen.update(core)
        cores.append(core)
    return tuple(cores)


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
        siblings = {c: cpu_siblings(root, c) & online for c in cpus}
        facts = CpuFacts(tuple(cpus), cpu_cores(cpus, siblings))
        attrs = attributes(facts) | {NUMA_NODE: node}
        packages = [p for c in cpus if (p := cpu_package(root, c)) is not None]
        if packages:
            attrs["socket"] = packages[0]
        kubevirt = self.settings.kubevirt_cpu
        if kubevirt and packages and len(set(packages)) == 1:
            # Only when the socket is one: a distinctAttribute over sockets must never take two requests on
            # one package for two (a node without NUMA spans every package of the machine).
            attrs[KUBEVIRT_SOCKET] = packages[0]
        attrs["smt"] = any(siblings[c] - {c} for c in cpus)
        shared = self.node_allocatable or kubevirt
        name = cpu_capacity_name(kubevirt)
        return Device(
            name=f"cpu-numa{node}",
            kind=Kind.CPU,
            attributes=attrs,
            capacity={name: Capacity(quantity.decimal(len(cpus)),
                                     request_policy=cpu_request_policy() if shared else None)},
            allow_multiple_allocations=shared,
            node_allocatable=cpu_node_allocatable(name) if self.node_allocatable else None,
            node=facts,
        )

"""Plain records that discovery produces and the rest of the agent consumes.

A `Device` carries two kinds of facts: what is published in the ResourceSlice
(`attributes`, `capacity`, `taints`, ...) and what only this node needs to
prepare it (`node`, typed per kind in `agent.facts`: the GPU and its form, the
interface and addresses, ...; `device_nodes`). Inventory modules build them,
the published attributes from the facts; nothing else creates devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.facts import DeviceFacts, GpuFacts, GpuIdentity, PassthroughFacts
from agent.kinds import Kind

PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"


@dataclass(frozen=True, slots=True)
class Version:
    """A semantic version attribute value (published as `{"version": ...}`)."""

    value: str

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class IntList:
    """A list-valued int attribute (published as `{"ints": [...]}`; the `DRAListTypeAttributes` gate).

    `scalar` is the attribute's scalar form, published instead where the cluster does not take lists
    (`agent.publish.dropped`): for the standard `numaNode` that is the device's own node, the first
    element."""

    values: tuple[int, ...]

    @property
    def scalar(self) -> int:
        return self.values[0]


AttrValue = bool | int | str | Version | IntList


def attribute_wire(value: AttrValue) -> dict[str, Any]:
    """The API's one-of form: `{"string": "x"}`, `{"int": 3}`, `{"bool": true}`, `{"version": "1.2.3"}`,
    `{"ints": [0, 1]}`."""
    if isinstance(value, IntList):
        return {"ints": list(value.values)}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, Version):
        return {"version": value.value}
    if isinstance(value, str):
        return {"string": value}
    raise TypeError(f"unsupported attribute value {value!r}")


def attribute_from_wire(wire: Mapping[str, Any]) -> AttrValue:
    (key, value), = wire.items()
    if key == "version":
        return Version(value)
    if key == "ints":
        return IntList(tuple(int(v) for v in value))
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Capacity:
    """A capacity: `value` is a canonical Kubernetes quantity string."""

    value: str
    request_policy: Mapping[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"value": self.value}
        if self.request_policy:
            out["requestPolicy"] = dict(self.request_policy)
        return out


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    effect: str  # None | NoSchedule | NoExecute
    value: str = ""
    time_added: str = ""  # RFC 3339, kept stable while the taint lasts

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "effect": self.effect}
        if self.value:
            out["value"] = self.value
        if self.time_added:
            out["timeAdded"] = self.time_added
        return out


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node a container needs: `path` inside, `host_path` on this node."""

    path: str
    host_path: str


@dataclass(frozen=True, slots=True)
class CounterSet:
    """A shared counter set (`ResourceSlice.spec.sharedCounters[]`): what one piece of hardware has,
    which the devices made from it consume. `counters` maps DNS-label names to quantity strings."""

    name: str
    counters: Mapping[str, str]

    def wire(self) -> dict[str, Any]:
        return {"name": self.name, "counters": {k: {"value": v} for k, v in sorted(self.counters.items())}}


@dataclass(frozen=True, slots=True)
class CounterConsumption:
    """What a device takes from one counter set when it is allocated (`consumesCounters[]`).

    It holds the set itself, not just its name: the slice builder publishes every set some device
    consumes, so a device can never refer to a set the pool does not have. `compatibility_groups`
    (KEP-5963, alpha in 1.37) is set by the slice builder only, by device kind
    (`counters.with_compatibility_groups`), never by discovery."""

    counter_set: CounterSet
    counters: Mapping[str, str]
    compatibility_groups: tuple[str, ...] = ()

    @classmethod
    def all_of(cls, counter_set: CounterSet) -> CounterConsumption:
        """The whole set: a device that takes the hardware entirely (a whole GPU, a passthrough function)."""
        return cls(counter_set, dict(counter_set.counters))

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"counterSet": self.counter_set.name,
                               "counters": {k: {"value": v} for k, v in sorted(self.counters.items())}}
        if self.compatibility_groups:
            out["compatibilityGroups"] = list(self.compatibility_groups)
        return out


@dataclass(slots=True)
class Device:
    name: str
    kind: Kind
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    capacity: dict[str, Capacity] = field(default_factory=dict)
    taints: list[Taint] = field(default_factory=list)
    allow_multiple_allocations: bool = False
    node_allocatable: dict[str, Any] | None = None
    # What only this node knows (`agent.facts`): the GPU and the form of it, the NIC's interface, ...
    node: DeviceFacts | None = None
    # The device nodes a container gets: a GPU's from discovery, a partition's or a passthrough
    # function's once prepare has made or bound it.
    device_nodes: tuple[DeviceNode, ...] = ()
    consumes_counters: tuple[CounterConsumption, ...] = ()

    def __post_init__(self) -> None:
        if self.node is not None and self.node.kind is not self.kind:
            raise ValueError(f"device {self.name}: a {self.kind} device with the facts of a {self.node.kind} device")

    @property
    def gpu(self) -> GpuIdentity | None:
        """The GPU a form of a GPU (whole, shared, MIG, vGPU) is made of; None for any other device."""
        return self.node.gpu if isinstance(self.node, GpuFacts) else None

    @property
    def pci_bus_id(self) -> str:
        """The PCI function the device is, or is made of ("" for none: CPU, memory, a virtual NIC)."""
        return self.node.pci_bus_id if self.node is not None else ""

    @property
    def gpu_function(self) -> str | None:
        """The PCI function of the GPU the device hands out, whole or in part (a GPU's passthrough
        variant included); None for a device of no GPU."""
        if isinstance(self.node, GpuFacts):
            return self.node.pci_bus_id
        if isinstance(self.node, PassthroughFacts) and self.node.native is Kind.GPU:
            return self.node.pci_bus_id
        return None

    def wire(self) -> dict[str, Any]:
        """The device as it appears in `ResourceSlice.spec.devices[]`."""
        out: dict[str, Any] = {"name": self.name}
        if self.attributes:
            out["attributes"] = {k: attribute_wire(v) for k, v in sorted(self.attributes.items())}
        if self.capacity:
            out["capacity"] = {k: c.wire() for k, c in sorted(self.capacity.items())}
        if self.taints:
            out["taints"] = [t.wire() for t in self.taints]
        if self.allow_multiple_allocations:
            out["allowMultipleAllocations"] = True
        if self.node_allocatable:
            out["nodeAllocatableResources"] = self.node_allocatable
        if self.consumes_counters:
            out["consumesCounters"] = [c.wire() for c in self.consumes_counters]
        return out

    def summary(self) -> dict[str, Any]:
        """`{name, kind, attributes, capacity}` for `dra-agent devices -o json`."""
        wire = self.wire()
        return {
            "name": self.name,
            "kind": str(self.kind),
            "attributes": wire.get("attributes", {}),
            "capacity": wire.get("capacity", {}),
        }

"""Fields the API server drops from the slices it stores, and what publishing does about them.

An API server whose feature gate for a field is off does not refuse a slice that carries the
field: it stores the slice without it (`compatibilityGroups` with `DRADeviceCompatibilityGroups`
off, `nodeAllocatableResources` with `DRANodeAllocatableResources` off). What is stored then never
equals what was sent, and a publisher that compares the two would rewrite the same slices at every
sync. So `ApiPublisher` compares each slice the server answers a write with (or a dry run of it)
against what it sent: a field sent and missing from the answer is dropped. It is logged once,
naming the field and the gate that most likely dropped it, and left out of every slice sent
afterwards (`strip_devices`, `strip_counter_sets`).

Compatibility groups are what keeps a MIG device and a vGPU of one GPU apart (`agent.vgpupolicy`);
without them the published vGPU devices must follow the policy for a cluster without groups
(`exact_without_groups`), or the scheduler could hand out both forms of one GPU.

A list-valued attribute is the exception: without `DRAListTypeAttributes` the API server drops the
list from the attribute and then refuses the slice, whose attribute has no value left (422). So a
refusal of that shape (`refuses_lists`) counts as the list values dropped (`LIST_VALUES`): the agent
publishes each list attribute in its scalar form from then on (`slices.SliceLayout.list_attributes`).
A fractional request policy is kept by every 1.37 API server, but read in whole units where
`DRAFractionalCapacityRange` is off: nothing is dropped, so a dry run of `FRACTION_PROBE` asks instead
(`ApiPublisher`), and shared GPUs then offer `computePercent` (`agent.computeshare`).
The slice-level fields (`partitionTypeAttribute`, `skipNodeOperations`) are not stripped but not made:
the layout of the pool's slices follows what the server keeps (`layout`).

Field paths are relative to `spec`: `devices[].consumesCounters[].compatibilityGroups`; a key of a
map whose keys are names (attributes, capacities, counters, node-allocatable resources) is `*`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent import kube
from agent.computeshare import has_fractions
from agent.config import Settings
from agent.facts import GpuFacts, VgpuType
from agent.inventory.published import PARTITION_TYPE
from agent.kinds import Kind
from agent.model import Device
from agent.publish.slices import SliceLayout
from agent.vgpupolicy import VgpuPolicy

COMPATIBILITY_GROUPS = "devices[].consumesCounters[].compatibilityGroups"
LIST_VALUES = "devices[].attributes.*.ints"
PARTITION_TYPE_ATTRIBUTE = "partitionTypeAttribute"
SKIP_NODE_OPERATIONS = "skipNodeOperations"
BINDING_CONDITIONS = "devices[].bindingConditions"
# The gate that, switched off, makes the API server drop a field (pkg/features of 1.37).
GATES: Mapping[str, str] = {
    COMPATIBILITY_GROUPS: "DRADeviceCompatibilityGroups",
    "devices[].nodeAllocatableResources": "DRANodeAllocatableResources",
    "devices[].allowMultipleAllocations": "DRAConsumableCapacity",
    "devices[].capacity.*.requestPolicy": "DRAConsumableCapacity",
    "devices[].taints": "DRADeviceTaints",
    "devices[].consumesCounters": "DRAPartitionableDevices",
    "sharedCounters": "DRAPartitionableDevices",
    LIST_VALUES: "DRAListTypeAttributes",
    PARTITION_TYPE_ATTRIBUTE: "DRAPartitionableDevicesType",
    SKIP_NODE_OPERATIONS: "DRAOptionalNodeOperations",
    BINDING_CONDITIONS: "DRADeviceBindingConditions",
    "devices[].bindingFailureConditions": "DRADeviceBindingConditions",
}
# Fractional request policies are kept by every 1.37 API server; with DRAFractionalCapacityRange off it
# reads their bounds rounded up to whole numbers (`agent.computeshare`). This device tells the two apart in
# a dry run: a default of 3 is a whole number of 1.5 steps above 0 counted in thousandths, and not one of
# 2 steps (1.5 rounded up) counted in whole units, so only a server counting in thousandths accepts it.
FRACTIONS_GATE = "DRAFractionalCapacityRange"
FRACTION_PROBE: Mapping[str, Any] = {
    "name": "fraction-probe", "allowMultipleAllocations": True,
    "capacity": {"probe": {"value": "4", "requestPolicy": {"default": "3", "validRange": {"min": "0",
                                                                                       "step": "1500m"}}}}}
# The fields of gates that are off by default in 1.37 (alpha): a cluster without them is common, so
# a pool that carries one is tried in a dry run before its first write (`ApiPublisher`).
OFF_BY_DEFAULT = frozenset({COMPATIBILITY_GROUPS, "devices[].nodeAllocatableResources", LIST_VALUES,
                            PARTITION_TYPE_ATTRIBUTE, SKIP_NODE_OPERATIONS})
# Where a refusal of one device attribute points: `spec.devices[3].attributes[<name>]` and below.
_ATTRIBUTE_FIELD = re.compile(r"^spec\.devices\[\d+\]\.attributes\[(?P<name>[^\]]+)\]")
# Fields whose value is a map keyed by names the agent chose.
_NAMED_MAPS = frozenset({"attributes", "capacity", "counters", "nodeAllocatableResources"})


def gate_of(path: str) -> str:
    return GATES.get(path, "a feature gate of the API server")


def layout(settings: Settings, node: kube.NodeInfo, dropped: Iterable[str] = ()) -> SliceLayout:
    """What the pool's device slices say (`slices.SliceLayout`) for these settings and this Node, without
    what the API server is known to drop: partition types with `--partition-type-attribute`; skipped
    node operations for `--skip-node-operations` kinds where the Node declares DRAOptionalNodeOperations
    (the scheduler puts a claim whose devices skip them only on such a node: declared elsewhere, the
    devices could not be allocated at all); list attributes unless refused; binding conditions on the
    `--binding-conditions` kinds unless dropped."""
    gone = set(dropped)
    partition = f"{settings.driver_name}/{PARTITION_TYPE}" if settings.partition_type_attribute and \
        PARTITION_TYPE_ATTRIBUTE not in gone else ""
    skip = frozenset(Kind(k) for k in settings.skip_node_operations) if node.optional_node_operations and \
        SKIP_NODE_OPERATIONS not in gone else frozenset()
    # Binding conditions dropped (the gate off): the scheduler would not wait for them, and the devices are
    # prepared by the kubelet as any other.
    binding = frozenset(Kind(k) for k in settings.binding_conditions) if BINDING_CONDITIONS not in gone \
        else frozenset()
    return SliceLayout(partition_type_attribute=partition, skip_kinds=skip, list_attributes=LIST_VALUES not in gone,
                       binding_kinds=binding)


def fractional_policies(spec: Mapping[str, Any]) -> bool:
    """Whether a slice's spec has a capacity whose request policy holds a fraction."""
    return any(has_fractions(cap.get("requestPolicy")) for dev in spec.get("devices") or []
               for cap in (dev.get("capacity") or {}).values() if isinstance(cap, Mapping))


def list_attributes(spec: Mapping[str, Any]) -> set[str]:
    """The names of the attributes a slice's spec sends as lists."""
    return {name for dev in spec.get("devices") or [] for name, value in (dev.get("attributes") or {}).items()
            if isinstance(value, Mapping) and {"ints", "bools", "strings", "versions"} & set(value)}


def refuses_lists(exc: BaseException, lists: set[str]) -> bool:
    """Whether the API server refused a slice (422) for nothing but attributes the agent sent as lists
    (`lists`): what a list comes to where `DRAListTypeAttributes` is off (the server drops the list,
    then finds the attribute without a value)."""
    if not lists or kube.status_code(exc) != 422:
        return False
    fields = kube.status_cause_fields(exc)
    return bool(fields) and all((m := _ATTRIBUTE_FIELD.match(f)) is not None and m["name"] in lists
                                for f in fields)


def dropped_fields(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> set[str]:
    """The paths of fields `sent` (a slice's spec) has and `stored` lacks. An empty value counts as
    absent: the API server does not keep empty lists and maps."""
    out: set[str] = set()
    _walk(sent, stored, "", out, named=False)
    return out


def _walk(sent: Any, stored: Any, path: str, out: set[str], *, named: bool, nested: bool = False) -> None:
    """Add the paths of what `sent` has and `stored` lacks to `out`; `nested`: also of what is below a
    field `stored` lacks (every path of `sent` when `stored` is empty)."""
    if isinstance(sent, Mapping) and isinstance(stored, Mapping):
        for key, value in sent.items():
            here = f"{path}.{'*' if named else key}" if path else key
            child_named = key in _NAMED_MAPS and not named
            if key not in stored or _empty(stored[key]):
                if not _empty(value):
                    out.add(here)
                    if nested:
                        _walk(value, {} if isinstance(value, Mapping) else [], here, out, named=child_named,
                              nested=True)
                continue
            _walk(value, stored[key], here, out, named=child_named, nested=nested)
    elif isinstance(sent, list) and isinstance(stored, list):
        for i, a in enumerate(sent):
            b = stored[i] if i < len(stored) else ({} if nested else None)
            if b is not None:
                _walk(a, b, path + "[]", out, named=False, nested=nested)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, list | dict) and not value)


def fields_of(spec: Mapping[str, Any]) -> set[str]:
    """The paths of every field with a value in `spec`."""
    out: set[str] = set()
    _walk(spec, {}, "", out, named=False, nested=True)
    return out


def first_difference(sent: Any, stored: Any, path: str = "") -> str | None:
    """Where `stored` first differs from `sent` (for a log line), or None when they are equal."""
    if isinstance(sent, Mapping) and isinstance(stored, Mapping):
        for key in sorted(set(sent) | set(stored)):
            if (found := first_difference(sent.get(key), stored.get(key), f"{path}.{key}" if path else key)):
                return found
        return None
    if isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        for i, (a, b) in enumerate(zip(sent, stored, strict=True)):
            if (found := first_difference(a, b, f"{path}[{i}]")):
                return found
        return None
    return None if sent == stored else (path or "(the whole object)")


def _strip(node: Any, parts: Sequence[str]) -> None:
    if not isinstance(node, dict) or not parts:
        return
    head, rest = parts[0], parts[1:]
    key, many = head.removesuffix("[]"), head.endswith("[]")
    for k in list(node) if key == "*" else [key]:
        if k not in node:
            continue
        if not rest:
            del node[k]
            continue
        for item in node[k] if many and isinstance(node[k], list) else [node[k]]:
            _strip(item, rest)


def _under(prefix: str, paths: Iterable[str]) -> list[list[str]]:
    return [p.removeprefix(prefix).split(".") for p in sorted(paths) if p.startswith(prefix)]


def strip_devices(devices: Iterable[Mapping[str, Any]], paths: Iterable[str]) -> None:
    """Remove the `devices[].…` fields in `paths` from each device, in place (the API-form dicts
    `slices.chunk_devices` made)."""
    parts = _under("devices[].", paths)
    for dev in devices:
        for p in parts:
            _strip(dev, p)


def strip_counter_sets(sets: Iterable[dict[str, Any]], paths: Iterable[str]) -> None:
    """Remove the `sharedCounters[].…` fields in `paths` from each counter set, in place."""
    parts = _under("sharedCounters[].", paths)
    for cs in sets:
        for p in parts:
            _strip(cs, p)


def exact_without_groups(devices: Sequence[Device], vgpu_types: str) -> list[Device]:
    """`devices` with the vGPU devices the policy without compatibility groups would not publish
    (`VgpuPolicy.of(vgpu_types, False)`): none for `auto`, the one type named and only on GPUs with
    no MIG placement; several types named (which that policy refuses) publish none."""
    try:
        policy = VgpuPolicy.of(vgpu_types, compatibility_groups=False)
    except ValueError:
        policy = VgpuPolicy(frozenset(), exclusive=True, enabled=False)
    with_mig = {d.gpu_function for d in devices if d.kind is Kind.MIG}
    out = []
    for dev in devices:
        if dev.kind is Kind.VGPU:
            facts = dev.node
            vgpu = facts.target if isinstance(facts, GpuFacts) else None
            if (not policy.enabled or not isinstance(vgpu, VgpuType) or dev.gpu_function in with_mig
                    or not policy.wants(vgpu.id, vgpu.name)):
                continue
        out.append(dev)
    return out

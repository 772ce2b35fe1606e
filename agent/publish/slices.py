"""Inventory -> ResourceSlice objects: validation, splitting, rendering and the publish plan.

Everything here is pure: both publishers (API server and offline directory) feed
it what they read and carry out the plan it returns, so the generation rules are
decided in one place. Whatever the API server would reject is dropped, value
by value, with a warning naming the device, because one rejected field would
otherwise keep the whole pool unpublished.

This module splits the pool into slices (`chunk_devices`) and builds a fresh pool (`build_slices`);
the other roles have their own modules, re-exported here under the names callers use
(`slices.plan_pool`, `slices.new_slice_name`, ...):

- `slicesanitize`: one device in API form with whatever the API server would reject removed
- `slicerender`: what a slice carries, its name and owner, the rendered object
- `sliceplan`: the publish plan (write in place, new generation, deletes)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent import apirules, counters
from agent.bindingconditions import BINDING_CONDITIONS, BINDING_FAILURE_CONDITIONS
from agent.inventory.published import PARTITION_TYPE
from agent.kinds import Kind
from agent.model import Device, IntList
from agent.publish.plan import (
    PoolPlan,
    SliceWrite,
    comparable,
    is_ours,
    plan_pool,
    pool_generation,
    same_slice,
)
from agent.publish.render import (
    API_VERSION,
    KIND,
    MAX_GENERATE_NAME,
    NAME_ALPHABET,
    NAME_SUFFIX,
    Chunk,
    CounterChunk,
    DeviceChunk,
    NodeRef,
    generate_name,
    new_slice_name,
    owner_references,
    render_slice,
)
from agent.publish.sanitize import STANDARD_DOMAIN, sanitize_device

__all__ = [
    "API_VERSION", "KIND", "KIND_ORDER", "MAX_GENERATE_NAME", "NAME_ALPHABET", "NAME_SUFFIX", "SKIP_NODE_OPERATIONS",
    "STANDARD_DOMAIN", "Chunk", "Chunks", "CounterChunk", "DeviceChunk", "NodeRef", "PoolPlan", "SliceLayout",
    "SliceWrite", "build_slices", "chunk_devices", "comparable", "device_order", "generate_name", "is_ours",
    "new_slice_name", "owner_references", "plan_pool", "pool_generation", "pool_rule_errors", "render_slice",
    "same_slice", "sanitize_device",
]

log = logging.getLogger(__name__)

# What a slice of devices whose claims need no node work says: both calls (the API refuses a skipped
# prepare with an unprepare still due), named rather than "*", which would also skip calls added later.
SKIP_NODE_OPERATIONS = ("NodePrepareResources", "NodeUnprepareResources")
# A ResourcePoolStatusRequest summarises at most 32 partition types per pool (the status list's limit):
# a pool with more gets no summary but an error, so the agent names no partition type attribute then.
MAX_PARTITION_TYPES = 32


# The order of the pool's devices, by kind. The scheduler's allocator walks a pool's slices by name and
# each slice's devices in order, evaluating the class's selectors on every device until one matches and is
# free, for every pod and every node: a device's place is what every request for a form after it pays,
# and each device walked past costs by its size (attributes, capacities, counters: the device is
# converted for every selector evaluated on it). So CPUs and memory come first: one or two a NUMA node,
# a handful of attributes each, no counters, so a request for any other form pays little for them,
# where a CPU request behind the GPU forms paid for every one of them. Then the forms asked for most,
# each a single device whose selector is decided by its `type`: whole GPUs, their passthrough variants
# (and NICs'), shares of a GPU; then NICs; then the partitions, vGPUs and MIG placements last: they are
# the many (13 dynamic MIG placements per GPU by default). A MIG request then walks past the few dozen
# devices in front of them, where a request for any other form behind them walked past every placement
# (docs/benchmarks.md, "The scheduler"). Every kind must be named here (tests/test_slice_order.py): a new
# kind has its place decided, not left at the end by default.
KIND_ORDER: tuple[Kind, ...] = (Kind.CPU, Kind.MEMORY, Kind.GPU, Kind.VFIO, Kind.GPUSHARE, Kind.NIC,
                                Kind.VGPU, Kind.MIG)
_RANK = {kind: i for i, kind in enumerate(KIND_ORDER)}


def device_order(dev: Device) -> tuple[int, str]:
    """Where a device goes in the pool: by kind (`KIND_ORDER`), then by name."""
    return _RANK.get(dev.kind, len(KIND_ORDER)), dev.name


@dataclass(frozen=True, slots=True)
class SliceLayout:
    """What the pool's device slices say beyond their devices, and the value forms the cluster takes.

    `partition_type_attribute` (the fully qualified name of `partitionType`; "" for none): MIG and vGPU
    devices go into slices of their own that name it. `skip_kinds`: devices of these kinds go into
    slices of their own whose claims skip the kubelet's prepare and unprepare. `list_attributes` False:
    a list attribute is published in its scalar form (the API server refuses lists without
    DRAListTypeAttributes). `binding_kinds`: devices of these kinds carry the binding conditions
    (`agent.bindingconditions`), the scheduler then waits for the agent before it binds their pods."""

    partition_type_attribute: str = ""
    skip_kinds: frozenset[Kind] = frozenset()
    list_attributes: bool = True
    binding_kinds: frozenset[Kind] = frozenset()


@dataclass(slots=True)
class Chunks:
    """The pool split into slices, counter slices first, plus what had to be dropped on the way."""

    slices: list[Chunk] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    # Pool-wide API rules the split breaks (`pool_rule_errors`); empty unless this module has a bug.
    errors: list[str] = field(default_factory=list)

    @property
    def device_count(self) -> int:
        return sum(len(s) for s in self.slices if not isinstance(s, CounterChunk))

    @property
    def counter_set_count(self) -> int:
        return sum(len(s.sets) for s in self.slices if isinstance(s, CounterChunk))


def chunk_devices(devices: Iterable[Device], *, reported: set[str] | None = None,
                  compatibility_groups: bool = False, layout: SliceLayout | None = None) -> Chunks:
    """The pool's slices: the counter sets the devices consume (at most 8 per slice, `counters.pack`),
    then the validated devices in the pool's order (`device_order`: by kind, then name) packed greedily
    into as few slices as the limits allow (64 per slice once one of them consumes counters or has
    taints). Each slice is rendered with a name that sorts in its place (`render.generate_name`).

    `compatibility_groups`: the cluster has `DRADeviceCompatibilityGroups` on; each device's counter
    consumption then carries the groups of its kind (`counters.with_compatibility_groups`). Off, none
    is sent: the API server would drop them, and the stored slices would never match what is sent.

    `layout` says what the device slices say of their devices (`SliceLayout`): a slice holds devices of
    one kind of slice only, so a new slice starts where the kind of slice changes along the order.

    Every problem is logged; pass `reported` (kept by the caller between calls) to log only the
    ones that are new since the last call, so a periodic republish does not repeat itself.
    """
    layout = layout or SliceLayout()
    out = Chunks()
    seen: set[str] = set()
    valid: list[tuple[Device, dict[str, Any]]] = []
    for dev in sorted(devices, key=device_order):
        if dev.name in seen:
            out.dropped.append(f"device {dev.name!r} dropped: duplicate name")
            continue
        seen.add(dev.name)
        if compatibility_groups:
            dev = counters.with_compatibility_groups(dev)
        if not layout.list_attributes:
            dev = scalar_attributes(dev)
        wire, problems = sanitize_device(dev)
        out.dropped += problems
        if wire is not None:
            if dev.kind in layout.binding_kinds:
                wire |= binding_fields()
            valid.append((dev, wire))
    packed = counters.pack(valid)
    out.dropped += packed.dropped
    out.slices += [CounterChunk(tuple(sets)) for sets in packed.slices]
    current: list[dict[str, Any]] = []
    says: tuple[str, tuple[str, ...]] = ("", ())
    for wire, key in _slice_kinds(packed.devices, layout, out.dropped):
        if current and (key != says or len(current) + 1 > apirules.device_limit([*current, wire])):
            out.slices.append(_chunk(current, *says))
            current = []
        says = key
        current.append(wire)
    if current:
        out.slices.append(_chunk(current, *says))
    out.errors = pool_rule_errors(out.slices)
    for message in out.dropped:
        if reported is None or message not in reported:
            log.warning("not published: %s", message)
    for message in out.errors:
        if reported is None or message not in reported:
            log.error("the pool's slices break an API rule (the API server will refuse them): %s", message)
    if reported is not None:
        reported.clear()
        reported.update(out.dropped, out.errors)
    return out


def binding_fields() -> dict[str, Any]:
    """What a device published with binding conditions carries (`agent.bindingconditions`)."""
    return {"bindingConditions": list(BINDING_CONDITIONS), "bindingFailureConditions": list(BINDING_FAILURE_CONDITIONS)}


def _chunk(wires: list[dict[str, Any]], partition_attr: str, skip: tuple[str, ...]) -> Chunk:
    return DeviceChunk(tuple(wires), partition_attr, skip) if partition_attr or skip else wires


def scalar_attributes(dev: Device) -> Device:
    """The device with each list attribute in its scalar form (`IntList.scalar`)."""
    if not any(isinstance(v, IntList) for v in dev.attributes.values()):
        return dev
    return dataclasses.replace(dev, attributes={k: v.scalar if isinstance(v, IntList) else v
                                                for k, v in dev.attributes.items()})


def _cost(wire: dict[str, Any]) -> str:
    return json.dumps(wire.get("consumesCounters") or [], sort_keys=True)


def _slice_kinds(packed: list[tuple[Device, dict[str, Any]]], layout: SliceLayout,
                 dropped: list[str]) -> list[tuple[dict[str, Any], tuple[str, tuple[str, ...]]]]:
    """Each device (in the order given) with what its slice says: the partition type attribute, the
    skipped calls."""
    skip_kinds, partition_attr = layout.skip_kinds, layout.partition_type_attribute
    partitions = [wire for dev, wire in packed if dev.kind not in skip_kinds and partition_attr
                  and wire.get("consumesCounters")
                  and "string" in ((wire.get("attributes") or {}).get(PARTITION_TYPE) or {})]
    if partitions:
        costs: dict[str, set[str]] = {}
        for wire in partitions:
            costs.setdefault(wire["attributes"][PARTITION_TYPE]["string"], set()).add(_cost(wire))
        mixed = sorted(t for t, c in costs.items() if len(c) > 1)
        if mixed or len(costs) > MAX_PARTITION_TYPES:
            why = (f"devices of partition type {mixed[0]!r} take different counters" if mixed else
                   f"{len(costs)} partition types, more than the {MAX_PARTITION_TYPES} a pool status summarises")
            dropped.append(f"partitionTypeAttribute {partition_attr!r} of the MIG and vGPU slices: {why}")
            partitions = []
    named = {id(wire) for wire in partitions}
    out: list[tuple[dict[str, Any], tuple[str, tuple[str, ...]]]] = []
    for dev, wire in packed:
        if dev.kind in skip_kinds:
            out.append((wire, ("", SKIP_NODE_OPERATIONS)))
        elif id(wire) in named:
            out.append((wire, (partition_attr, ())))
        else:
            out.append((wire, ("", ())))
    return out


# Placeholders for the rendering that `pool_rule_errors` checks: the split does not depend on them,
# and the real driver and node names are checked where they are configured.
_CHECK_DRIVER = "pool-check.example.com"
_CHECK_NODE = "pool-check"


def pool_rule_errors(chunks: Sequence[Chunk]) -> list[str]:
    """The API rules over the whole split as it would be published (`apirules.pool_errors`): each slice
    holds counter sets or devices, never both; at most 8 counter sets per slice and 64 devices once
    they consume counters; at most 2 consumptions per device; counter set names unique in the pool;
    every counter a device consumes published by a set of the pool. The split is built to keep them;
    this checks it rather than trusting the construction."""
    count = len(chunks)
    # A partition type attribute in the driver's domain is found bare on the devices: that driver, then.
    driver = next((c.partition_type_attribute.partition("/")[0] for c in chunks
                   if isinstance(c, DeviceChunk) and c.partition_type_attribute), _CHECK_DRIVER)
    return apirules.pool_errors([render_slice(c, driver=driver, node=_CHECK_NODE, owner=None, generation=1,
                                              count=count, place=i) for i, c in enumerate(chunks)])


def build_slices(devices: Iterable[Device], *, driver: str, node: str, owner: NodeRef | None = None,
                 generation: int = 1, compatibility_groups: bool = False,
                 layout: SliceLayout | None = None) -> list[dict[str, Any]]:
    """The slices for `devices` as one fresh pool (what `dra-agent slices` shows)."""
    chunks = chunk_devices(devices, compatibility_groups=compatibility_groups, layout=layout).slices
    return [render_slice(c, driver=driver, node=node, owner=owner, generation=generation, count=len(chunks),
                         place=i) for i, c in enumerate(chunks)]

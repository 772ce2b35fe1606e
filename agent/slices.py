"""Inventory -> ResourceSlice objects: validation, splitting, rendering and the publish plan.

Everything here is pure: both publishers (API server and offline directory) feed
it what they read and carry out the plan it returns, so the generation rules are
decided in one place. Whatever the API server would reject is dropped here, value
by value, with a warning naming the device, because one rejected field would
otherwise keep the whole pool unpublished.
"""

from __future__ import annotations

import copy
import logging
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent import apirules, counters
from agent.model import Device, attribute_wire

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
STANDARD_DOMAIN = "resource.kubernetes.io/"
# The API server appends 5 random characters to generateName and caps the result at 63.
MAX_GENERATE_NAME = 58
# What the API server draws those characters from; names chosen here look the same.
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
NAME_SUFFIX = 5


@dataclass(frozen=True, slots=True)
class NodeRef:
    """The Node that owns the slices; without a UID no owner reference can be written."""

    name: str
    uid: str = ""


@dataclass(frozen=True, slots=True)
class CounterChunk:
    """One slice's worth of shared counter sets (API form): a slice carries `spec.sharedCounters` or
    `spec.devices`, never both."""

    sets: tuple[dict[str, Any], ...]


# What one slice carries: devices (API form), or counter sets.
Chunk = Sequence[Mapping[str, Any]] | CounterChunk


@dataclass(slots=True)
class Chunks:
    """The pool split into slices, counter slices first, plus what had to be dropped on the way."""

    slices: list[Chunk] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    @property
    def device_count(self) -> int:
        return sum(len(s) for s in self.slices if not isinstance(s, CounterChunk))

    @property
    def counter_set_count(self) -> int:
        return sum(len(s.sets) for s in self.slices if isinstance(s, CounterChunk))


# -- validation ---------------------------------------------------------------------------------

def _drop_rank(key: str, kind: str, mapped: set[str]) -> int:
    """Lower ranks go first when a device has too many attributes and capacities."""
    if kind == "attribute":
        if key.startswith(STANDARD_DOMAIN):
            return 4
        return 3 if key == "type" else 0
    # Capacities carry what claims consume; one mapped to node-allocatable resources is kept longest.
    return 2 if key in mapped else 1


def sanitize_device(dev: Device) -> tuple[dict[str, Any] | None, list[str]]:
    """The device in API form with every invalid part removed, and one message per removal.

    None when the device itself cannot be published (its name is invalid, or what is
    left still breaks a rule).
    """
    problems: list[str] = []
    if errs := apirules.dns_label_errors(dev.name):
        return None, [f"device {dev.name!r} dropped: name {'; '.join(errs)}"]

    # Value by value, in name order (as Device.wire), so one odd value cannot fail the whole device.
    attrs: dict[str, Any] = {}
    for key, value in sorted(dev.attributes.items()):
        errs = apirules.qualified_name_errors(key) or apirules.attribute_value_errors(value)
        if errs:
            problems.append(f"device {dev.name}: attribute {key!r} dropped: {'; '.join(errs)}")
        else:
            attrs[key] = attribute_wire(value)

    caps: dict[str, Any] = {}
    for key, cap in sorted(dev.capacity.items()):
        errs = apirules.qualified_name_errors(key) + apirules.quantity_errors(str(cap.value))
        if cap.request_policy:
            errs += apirules.request_policy_errors(cap.request_policy, cap.value)
        if errs:
            problems.append(f"device {dev.name}: capacity {key!r} dropped: {'; '.join(errs)}")
        else:
            caps[key] = cap.wire()

    alloc: dict[str, Any] = copy.deepcopy(dev.node_allocatable or {})
    mapped = {str(((res or {}).get("mapping") or {}).get("capacityKey")) for res in alloc.values()}
    entries = [(k, "attribute") for k in attrs] + [(k, "capacity") for k in caps]
    excess = len(entries) - apirules.MAX_ATTRIBUTES_AND_CAPACITIES
    if excess > 0:
        # Last names first inside a rank, so the same inventory always loses the same entries.
        by_name = sorted(entries, reverse=True)
        doomed = sorted(by_name, key=lambda e: _drop_rank(e[0], e[1], mapped))[:excess]
        for key, kind in sorted(doomed):
            (attrs if kind == "attribute" else caps).pop(key)
            problems.append(f"device {dev.name}: {kind} {key!r} dropped: more than "
                            f"{apirules.MAX_ATTRIBUTES_AND_CAPACITIES} attributes and capacities")

    taints: list[dict[str, Any]] = []
    for t in (taint.wire() for taint in dev.taints):
        if errs := apirules.taint_errors(t):
            problems.append(f"device {dev.name}: taint {t.get('key')!r} dropped: {'; '.join(errs)}")
        elif len(taints) >= apirules.MAX_TAINTS:
            problems.append(f"device {dev.name}: taint {t.get('key')!r} dropped: more than "
                            f"{apirules.MAX_TAINTS} taints")
        else:
            taints.append(t)

    out: dict[str, Any] = {"name": dev.name}
    if attrs:
        out["attributes"] = attrs
    if caps:
        out["capacity"] = caps
    if taints:
        out["taints"] = taints
    if dev.allow_multiple_allocations:
        out["allowMultipleAllocations"] = True
    if dev.consumes_counters:
        # Never trimmed: a device that took less than its share would let the scheduler hand the
        # hardware out twice. An invalid consumption fails the device below.
        out["consumesCounters"] = [c.wire() for c in dev.consumes_counters]
    if alloc:
        kept = {}
        for key, res in alloc.items():
            errs = apirules.node_allocatable_errors(key, res, caps)
            if errs:
                problems.append(f"device {dev.name}: nodeAllocatableResources {key!r} dropped: "
                                f"{'; '.join(errs)}")
            else:
                kept[key] = res
        if kept:
            out["nodeAllocatableResources"] = kept
    if errs := apirules.device_wire_errors(out):
        return None, [*problems, f"device {dev.name!r} dropped: {'; '.join(errs)}"]
    return out, problems


def chunk_devices(devices: Iterable[Device], *, reported: set[str] | None = None,
                  compatibility_groups: bool = False) -> Chunks:
    """The pool's slices: the counter sets the devices consume (at most 8 per slice, `counters.pack`),
    then the validated devices sorted by name and packed greedily into as few slices as the limits
    allow (64 per slice once one of them consumes counters or has taints).

    `compatibility_groups`: the cluster has `DRADeviceCompatibilityGroups` on; each device's counter
    consumption then carries the groups of its kind (`counters.with_compatibility_groups`). Off, none
    is sent: the API server would drop them, and the stored slices would never match what is sent.

    Every problem is logged; pass `reported` (kept by the caller between calls) to log only the
    ones that are new since the last call, so a periodic republish does not repeat itself.
    """
    out = Chunks()
    seen: set[str] = set()
    valid: list[tuple[Device, dict[str, Any]]] = []
    for dev in sorted(devices, key=lambda d: d.name):
        if dev.name in seen:
            out.dropped.append(f"device {dev.name!r} dropped: duplicate name")
            continue
        seen.add(dev.name)
        if compatibility_groups:
            dev = counters.with_compatibility_groups(dev)
        wire, problems = sanitize_device(dev)
        out.dropped += problems
        if wire is not None:
            valid.append((dev, wire))
    packed = counters.pack(valid)
    out.dropped += packed.dropped
    out.slices += [CounterChunk(tuple(sets)) for sets in packed.slices]
    current: list[dict[str, Any]] = []
    for _, wire in packed.devices:
        if current and len(current) + 1 > apirules.device_limit([*current, wire]):
            out.slices.append(current)
            current = []
        current.append(wire)
    if current:
        out.slices.append(current)
    for message in out.dropped:
        if reported is None or message not in reported:
            log.warning("not published: %s", message)
    if reported is not None:
        reported.clear()
        reported.update(out.dropped)
    return out


# -- rendering ----------------------------------------------------------------------------------

def generate_name(driver: str, node: str) -> str:
    base = f"{driver}-{node}-"
    if len(base) <= MAX_GENERATE_NAME:
        return base
    # The server would cut it anyway; cutting here keeps the name a valid DNS subdomain.
    return base[: MAX_GENERATE_NAME - 1].rstrip(".-") + "-"


def new_slice_name(driver: str, node: str) -> str:
    """A name as generateName would give it, chosen here so that a retried create names the same object."""
    return generate_name(driver, node) + "".join(secrets.choice(NAME_ALPHABET) for _ in range(NAME_SUFFIX))


def owner_references(owner: NodeRef | None) -> list[dict[str, Any]]:
    if owner is None or not owner.uid:
        return []
    return [{"apiVersion": "v1", "kind": "Node", "name": owner.name, "uid": owner.uid, "controller": True}]


def render_slice(chunk: Chunk, *, driver: str, node: str, owner: NodeRef | None,
                 generation: int, count: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {"generateName": generate_name(driver, node)}
    if refs := owner_references(owner):
        metadata["ownerReferences"] = refs
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
        "nodeName": node,
    }
    if isinstance(chunk, CounterChunk):
        spec["sharedCounters"] = copy.deepcopy(list(chunk.sets))
    else:
        spec["devices"] = copy.deepcopy(list(chunk))
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


def build_slices(devices: Iterable[Device], *, driver: str, node: str, owner: NodeRef | None = None,
                 generation: int = 1, compatibility_groups: bool = False) -> list[dict[str, Any]]:
    """The slices for `devices` as one fresh pool (what `dra-agent slices` shows)."""
    chunks = chunk_devices(devices, compatibility_groups=compatibility_groups).slices
    return [render_slice(c, driver=driver, node=node, owner=owner, generation=generation, count=len(chunks))
            for c in chunks]


# -- planning -----------------------------------------------------------------------------------

@dataclass(slots=True)
class SliceWrite:
    """One object to write: `key` None means create, else replace the existing object `key`."""

    obj: dict[str, Any]
    key: str | None = None


@dataclass(slots=True)
class PoolPlan:
    generation: int
    writes: list[SliceWrite] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)  # done after every write has succeeded
    unchanged: list[str] = field(default_factory=list)

    @property
    def noop(self) -> bool:
        return not self.writes and not self.deletes


def pool_generation(obj: Mapping[str, Any]) -> int:
    gen = ((obj.get("spec") or {}).get("pool") or {}).get("generation")
    return gen if isinstance(gen, int) and not isinstance(gen, bool) else 0


def _slice_count(obj: Mapping[str, Any]) -> int | None:
    return ((obj.get("spec") or {}).get("pool") or {}).get("resourceSliceCount")


def _content(chunk: Chunk) -> frozenset[str]:
    """What a chunk holds, by name: `device/<name>` or `counters/<name>` entries."""
    if isinstance(chunk, CounterChunk):
        return frozenset(f"counters/{s.get('name')}" for s in chunk.sets)
    return frozenset(f"device/{d.get('name')}" for d in chunk)


def _held(obj: Mapping[str, Any]) -> frozenset[str]:
    """What a stored slice holds, in `_content`'s terms."""
    spec = obj.get("spec") or {}
    return _content(spec.get("devices") or []) | _content(CounterChunk(tuple(spec.get("sharedCounters") or [])))


def comparable(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a slice the agent owns: what it sends and what the server keeps as sent."""
    meta = obj.get("metadata") or {}
    return {"ownerReferences": meta.get("ownerReferences") or [], "spec": obj.get("spec") or {}}


def _keep_taint_times(desired: dict[str, Any], existing: Mapping[str, Any]) -> None:
    """The API server stamps `timeAdded` on taints sent without one; keep the stamp it chose."""
    old = {str(d.get("name")): d for d in ((existing.get("spec") or {}).get("devices") or [])}
    for dev in desired["spec"].get("devices") or []:
        before = old.get(dev["name"])
        if not before or not dev.get("taints"):
            continue
        stamps = {(t.get("key"), t.get("value", ""), t.get("effect")): t.get("timeAdded")
                  for t in before.get("taints") or []}
        for t in dev["taints"]:
            if "timeAdded" not in t and (stamp := stamps.get((t["key"], t.get("value", ""), t["effect"]))):
                t["timeAdded"] = stamp


def same_slice(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether `existing` already says what `desired` says (server-stamped taint times aside)."""
    wanted = copy.deepcopy(dict(desired))
    _keep_taint_times(wanted, existing)
    return comparable(wanted) == comparable(existing)


def plan_pool(existing: Mapping[str, Mapping[str, Any]], chunks: Sequence[Chunk], *,
              driver: str, node: str, owner: NodeRef | None = None,
              slots: Sequence[str] | None = None) -> PoolPlan:
    """Decide how to turn the `existing` slices of this pool (by key) into `chunks`.

    `slots` pins chunk i to key slots[i] (the directory publisher's file names);
    without it existing objects are reused wherever they fit (API objects, whose
    names mean nothing). An update in place keeps the generation; anything that changes
    the set of slices or which slice holds which device writes a new generation
    everywhere, and only then deletes what is left of the old one.

    Copies of a slice in the current generation (the same devices twice: a create
    retried with generateName after its answer was lost, or another agent) are
    deleted, all but one, keeping the generation: the pool is then what the
    generation always said it was, and nothing else has to be rewritten. A device
    in two slices that are not copies of each other is a different split, so a new
    generation.
    """
    current = max((pool_generation(o) for o in existing.values()), default=0)
    count = len(chunks)
    if count == 0:
        return PoolPlan(generation=current, deletes=sorted(existing))

    def render(i: int, generation: int) -> dict[str, Any]:
        return render_slice(chunks[i], driver=driver, node=node, owner=owner, generation=generation,
                            count=count)

    top = {k: o for k, o in existing.items() if pool_generation(o) == current}
    pairing = _pair_in_place(top, chunks, slots) if current else None
    if pairing is not None and all(_slice_count(o) == count for o in top.values()):
        deletes = set(existing) - set(top)
        plan = PoolPlan(generation=current)
        for i, candidates in enumerate(pairing):
            desired = render(i, current)
            # The copy that already matches stays (no write); else the first by name is rewritten.
            key = next((k for k in candidates if len(candidates) > 1 and same_slice(existing[k], desired)),
                       candidates[0])
            deletes.update(k for k in candidates if k != key)
            _keep_taint_times(desired, existing[key])
            if comparable(desired) == comparable(existing[key]):
                plan.unchanged.append(key)
            else:
                plan.writes.append(SliceWrite(desired, key))
        plan.deletes = sorted(deletes)
        return plan

    generation = current + 1
    plan = PoolPlan(generation=generation)
    reuse = _reuse(existing, chunks, slots)
    for i in range(count):
        desired = render(i, generation)
        target = reuse.get(i)
        if target is not None:
            _keep_taint_times(desired, existing[target])
        elif slots is not None:
            target = slots[i]  # a file that is not there yet: created under its fixed name
        plan.writes.append(SliceWrite(desired, target))
    used = set(reuse.values())
    plan.deletes = sorted(k for k in existing if k not in used)
    return plan


def _pair_in_place(top: Mapping[str, Mapping[str, Any]], chunks: Sequence[Chunk],
                   slots: Sequence[str] | None) -> list[list[str]] | None:
    """For each chunk, the existing keys holding exactly its devices or counter sets (copies included, in name
    order), when the current generation holds exactly the chunks' device sets; else None."""
    if slots is not None:
        # Files have fixed names: one file per chunk, nothing else in the generation.
        if len(top) != len(chunks):
            return None
        keys = list(slots[: len(chunks)])
        if set(keys) != set(top):
            return None
        for key, chunk in zip(keys, chunks, strict=True):
            if _held(top[key]) != _content(chunk):
                return None
        return [[key] for key in keys]
    by_names: dict[frozenset[str], list[str]] = {}
    for key in sorted(top):
        by_names.setdefault(_held(top[key]), []).append(key)
    wanted = [_content(chunk) for chunk in chunks]
    # Every slice of the generation must be some chunk (or a copy of one): a slice holding any
    # other set of devices means the split changed, and that takes a new generation.
    if set(by_names) != set(wanted):
        return None
    return [by_names[names] for names in wanted]


def _reuse(existing: Mapping[str, Mapping[str, Any]], chunks: Sequence[Chunk],
           slots: Sequence[str] | None) -> dict[int, str]:
    """Chunk index -> existing key to overwrite; objects left over are deleted."""
    if slots is not None:
        return {i: slots[i] for i in range(len(chunks)) if slots[i] in existing}
    # Prefer the object that already holds the same devices (a consumer holding it sees the least
    # churn), newest generation first, then hand out the rest in name order.
    free = sorted(existing, key=lambda k: (-pool_generation(existing[k]), k))
    reuse: dict[int, str] = {}
    for i, chunk in enumerate(chunks):
        names = _content(chunk)
        for key in free:
            if _held(existing[key]) == names:
                reuse[i] = key
                free.remove(key)
                break
    for i in range(len(chunks)):
        if i not in reuse and free:
            reuse[i] = free.pop(0)
    return reuse


def is_ours(obj: Mapping[str, Any], *, driver: str, node: str) -> bool:
    """A slice of this driver's pool on this node (field selectors are not trusted alone)."""
    spec = obj.get("spec") or {}
    return spec.get("driver") == driver and spec.get("nodeName") == node

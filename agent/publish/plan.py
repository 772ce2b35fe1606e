"""The publish plan: how to turn the slices a pool has (API objects or files) into the slices it
should have, which to rewrite in place, which to create in a new generation, which to delete
afterwards. Pure: both publishers (API server and offline directory) feed it what they read and
carry out the plan it returns, so the generation rules are decided in one place."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.publish.render import Chunk, CounterChunk, NodeRef, generate_name, render_slice


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


def _generate_name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("generateName") or "")


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
    without it (API objects) chunk i goes only to an object whose name starts with
    its place (`generate_name(driver, node, i, count)`): the allocator walks the
    pool's slices by name, and a name cannot change, so an object named for another
    place (or by an older agent, with no place) is never rewritten with chunk i but
    replaced, in a new generation. An update in place keeps the generation; anything that changes
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
                            count=count, place=i)

    # Which keys may hold chunk i: its file, or an object named for its place.
    places = [generate_name(driver, node, i, count) for i in range(count)] if slots is None else None
    top = {k: o for k, o in existing.items() if pool_generation(o) == current}
    pairing = _pair_in_place(top, chunks, slots, places) if current else None
    if pairing is not None and all(_slice_count(o) == count for o in top.values()):
        deletes = set(existing) - set(top)
        plan = PoolPlan(generation=current)
        for i, candidates in enumerate(pairing):
            desired = render(i, current)
            # The copy that already matches stays (no write); else the first by name is rewritten.
            # Only a copy named for the chunk's place may stay (`_pair_in_place` puts those first).
            fit = [k for k in candidates if places is None or k.startswith(places[i])]
            key = next((k for k in fit if len(candidates) > 1 and same_slice(existing[k], desired)), fit[0])
            deletes.update(k for k in candidates if k != key)
            _keep_taint_times(desired, existing[key])
            # A file is what someone creates the slice from: its generateName (the place) counts too.
            if comparable(desired) == comparable(existing[key]) and \
                    (slots is None or _generate_name(desired) == _generate_name(existing[key])):
                plan.unchanged.append(key)
            else:
                plan.writes.append(SliceWrite(desired, key))
        plan.deletes = sorted(deletes)
        return plan

    generation = current + 1
    plan = PoolPlan(generation=generation)
    reuse = _reuse(existing, chunks, slots, places)
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
                   slots: Sequence[str] | None, places: Sequence[str] | None) -> list[list[str]] | None:
    """For each chunk, the existing keys holding exactly its devices or counter sets (copies included, in name
    order, those named for the chunk's place first), when the current generation holds exactly the chunks'
    device sets and each chunk has one named for its place; else None."""
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
    assert places is not None
    pairing: list[list[str]] = []
    for names, prefix in zip(wanted, places, strict=True):
        keys = by_names[names]
        # A copy named for another place is deleted; none named for this one: the slice must be
        # replaced by one that sorts in its place, and that changes which slice holds the devices.
        fit = [k for k in keys if k.startswith(prefix)]
        if not fit:
            return None
        pairing.append(fit + [k for k in keys if not k.startswith(prefix)])
    return pairing


def _reuse(existing: Mapping[str, Mapping[str, Any]], chunks: Sequence[Chunk],
           slots: Sequence[str] | None, places: Sequence[str] | None) -> dict[int, str]:
    """Chunk index -> existing key to overwrite; objects left over are deleted. An object is only ever
    given the chunk its name has the place of (`places`)."""
    if slots is not None:
        return {i: slots[i] for i in range(len(chunks)) if slots[i] in existing}
    assert places is not None
    # Prefer the object that already holds the same devices (a consumer holding it sees the least
    # churn), newest generation first, then hand out the rest in name order.
    free = sorted(existing, key=lambda k: (-pool_generation(existing[k]), k))
    reuse: dict[int, str] = {}
    for i, chunk in enumerate(chunks):
        names = _content(chunk)
        for key in free:
            if key.startswith(places[i]) and _held(existing[key]) == names:
                reuse[i] = key
                free.remove(key)
                break
    for i in range(len(chunks)):
        if i not in reuse and (fits := next((k for k in free if k.startswith(places[i])), None)) is not None:
            reuse[i] = fits
            free.remove(fits)
    return reuse


def is_ours(obj: Mapping[str, Any], *, driver: str, node: str) -> bool:
    """A slice of this driver's pool on this node (field selectors are not trusted alone)."""
    spec = obj.get("spec") or {}
    return spec.get("driver") == driver and spec.get("nodeName") == node

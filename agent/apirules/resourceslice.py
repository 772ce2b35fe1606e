"""The API server's rules for a whole ResourceSlice and for the slices of one pool: driver and pool
fields, how many devices a slice may hold, devices and counter sets exclusive, device names unique,
one generation per pool, every consumed counter published in the pool. The rules for one device are
in `devices`, for counter sets in `countersets`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.apirules.countersets import shared_counters_errors
from agent.apirules.devices import device_wire_errors
from agent.apirules.formats import (
    MAX_DRIVER_NAME,
    dns_label_errors,
    dns_subdomain_errors,
    pool_name_errors,
    qualified_name_errors,
)

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_RESTRICTED = 64  # any taint, counter consumption or list attribute in the slice


def device_limit(devices: list[Mapping[str, Any]]) -> int:
    """How many devices a slice holding `devices` may have."""
    restricted = any(
        d.get("taints") or d.get("consumesCounters")
        or any(len(a) == 1 and next(iter(a)) in ("ints", "bools", "strings", "versions")
               for a in (d.get("attributes") or {}).values())
        for d in devices
    )
    return MAX_DEVICES_PER_SLICE_RESTRICTED if restricted else MAX_DEVICES_PER_SLICE


def pool_errors(objs: list[Mapping[str, Any]]) -> list[str]:
    """Rules that span the slices of one pool: each slice valid, one generation and the right slice
    count, counter set names unique in the pool, and every counter a device consumes published by
    a counter set of the same pool (the scheduler cannot allocate a device whose counters it cannot
    find). Nothing is counted twice: the per-slice rules come from `slice_errors`."""
    errs: list[str] = []
    sets: dict[str, set[str]] = {}
    for i, obj in enumerate(objs):
        errs += [f"slice {i}: {e}" for e in slice_errors(obj)]
        for cs in (obj.get("spec") or {}).get("sharedCounters") or []:
            name = str(cs.get("name", ""))
            if name in sets:
                errs.append(f"slice {i}: counter set {name!r} is published twice in the pool")
            sets[name] = set((cs.get("counters") or {}).keys())
    pools = {(int(p.get("generation", -1)), int(p.get("resourceSliceCount", -1)))
             for p in ((o.get("spec") or {}).get("pool") or {} for o in objs)}
    if len(pools) > 1:
        errs.append(f"the slices disagree on the pool's generation and slice count: {sorted(pools)}")
    elif pools and (count := next(iter(pools))[1]) != len(objs):
        errs.append(f"resourceSliceCount is {count} but the pool has {len(objs)} slices")
    for obj in objs:
        for dev in (obj.get("spec") or {}).get("devices") or []:
            for c in dev.get("consumesCounters") or []:
                known = sets.get(str(c.get("counterSet")))
                if known is None:
                    errs.append(f"device {dev.get('name')!r} consumes counter set {c.get('counterSet')!r}, "
                                "which the pool does not publish")
                elif missing := sorted(set(c.get("counters") or {}) - known):
                    errs.append(f"device {dev.get('name')!r} consumes counters {missing} that counter set "
                                f"{c.get('counterSet')!r} does not have")
    return errs


def slice_errors(obj: Mapping[str, Any]) -> list[str]:
    """Whole-object check of a ResourceSlice as the agent emits it; empty when the API would accept it."""
    spec = obj.get("spec") or {}
    errs: list[str] = []
    errs += [f"spec.driver {e}" for e in dns_subdomain_errors(str(spec.get("driver", "")), MAX_DRIVER_NAME)]
    pool = spec.get("pool") or {}
    errs += [f"spec.pool.name {e}" for e in pool_name_errors(str(pool.get("name", "")))]
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        errs.append("spec.pool.generation must be a non-negative int")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        errs.append("spec.pool.resourceSliceCount must be >= 1")
    devices = spec.get("devices") or []
    counter_sets = spec.get("sharedCounters") or []
    if devices and counter_sets:
        errs.append("spec.devices and spec.sharedCounters are mutually exclusive")
    errs += shared_counters_errors(counter_sets)
    if len(devices) > (limit := device_limit(devices)):
        errs.append(f"spec.devices has {len(devices)} entries, more than {limit}")
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        where = f"spec.devices[{i}]"
        name = str(dev.get("name", ""))
        if name in seen:
            errs.append(f"{where}.name {name!r} is duplicated")
        seen.add(name)
        errs += [f"{where}.name {e}" for e in dns_label_errors(name)]
        errs += [f"{where}: {e}" for e in device_wire_errors(dev)]
    errs += _partition_type_errors(spec)
    skip = spec.get("skipNodeOperations") or []
    if not set(skip) <= SKIP_OPERATIONS:
        errs.append(f"spec.skipNodeOperations may hold only {sorted(SKIP_OPERATIONS)}")
    if "NodePrepareResources" in skip and not {"NodeUnprepareResources", "*"} & set(skip):
        errs.append("spec.skipNodeOperations: NodePrepareResources cannot be skipped unless NodeUnprepareResources is")
    return errs


SKIP_OPERATIONS = frozenset({"NodePrepareResources", "NodeUnprepareResources", "*"})


def _partition_type_errors(spec: Mapping[str, Any]) -> list[str]:
    """`partitionTypeAttribute`: a fully qualified name, on a slice of devices some of which consume
    counters, each of those carrying it as a string (a name in the driver's domain may be bare)."""
    name = spec.get("partitionTypeAttribute")
    if name is None:
        return []
    domain, sep, bare = str(name).partition("/")
    if not sep or qualified_name_errors(str(name)):
        return [f"spec.partitionTypeAttribute {name!r} must be a fully qualified attribute name"]
    consumers = [d for d in spec.get("devices") or [] if d.get("consumesCounters")]
    if not consumers:
        return ["spec.partitionTypeAttribute may only be set on a slice of devices that consume counters"]
    errs = []
    for dev in consumers:
        attrs = dev.get("attributes") or {}
        value = attrs.get(name) or (attrs.get(bare) if domain == spec.get("driver") else None)
        if not isinstance(value, Mapping) or "string" not in value:
            errs.append(f"device {dev.get('name')!r} consumes counters and lacks the string attribute {name!r} "
                        "the slice's partitionTypeAttribute names")
    return errs

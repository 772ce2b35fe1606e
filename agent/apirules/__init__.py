"""The API server's validation rules for what the agent sends (resource.k8s.io/v1, 1.37): ResourceSlices
(their devices, shared counter sets and counter consumption, and the rules spanning a pool's slices)
here, and the `status.devices` entries of ResourceClaims in `agent.apirules.status` (re-exported).

Each check returns a list of human-readable problems (empty = valid), so the
slice builder can drop exactly the offending value and say why, instead of
having the whole slice rejected by the API server.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agent import quantity
from agent.model import AttrValue, Version

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_RESTRICTED = 64  # any taint, counter consumption or list attribute in the slice
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_VALUE_LENGTH = 64
MAX_TAINTS = 16
MAX_POOL_NAME = 253
MAX_DRIVER_NAME = 63
MAX_ID_LENGTH = 32
MAX_DOMAIN_LENGTH = 63
MAX_VALID_VALUES = 10
# Shared counters (KEP-4815, DRAPartitionableDevices, on by default since 1.36). The limits as the 1.37
# OpenAPI schema that tests validate against states them (kubernetes_validate's v1.37.0 schemas:
# resourceslicespec-resource-v1.json, device-resource-v1.json, counterset-resource-v1.json,
# devicecounterconsumption-resource-v1.json).
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2  # one entry per counter set
MAX_COUNTERS_PER_CONSUMPTION = 32
# Compatibility groups (KEP-5963, DRADeviceCompatibilityGroups, alpha in 1.37): a list of strings, at most
# 2, unique (the v1.37.0 schema's devicecounterconsumption-resource-v1.json and the field's API comment).
# The format of one name is not confirmed from any source here: the agent holds its own names to DNS
# labels, the strictest format the API uses for names in this object.
MAX_COMPATIBILITY_GROUPS = 2
TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")
NODE_ALLOCATABLE_KEYS = re.compile(r"^(cpu|memory|ephemeral-storage|hugepages-[0-9A-Za-z.]+)\Z")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?\Z"
, re.ASCII)
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?\Z")


def dns_label_errors(value: str, max_len: int = 63) -> list[str]:
    errs = []
    if len(value) > max_len:
        errs.append(f"must be no more than {max_len} characters")
    if not _DNS_LABEL.match(value):
        errs.append("must be a DNS label (lower-case alphanumerics and '-', starting and ending "
                    "with an alphanumeric)")
    return errs


def dns_subdomain_errors(value: str, max_len: int = 253) -> list[str]:
    errs = []
    if len(value) > max_len:
        errs.append(f"must be no more than {max_len} characters")
    if not value or not all(_DNS_LABEL.match(part) for part in value.split(".")):
        errs.append("must be a DNS subdomain (lower-case alphanumerics, '-' and '.')")
    return errs


def semver_errors(value: str) -> list[str]:
    errs = []
    if len(value) > MAX_VALUE_LENGTH:
        errs.append(f"must be no more than {MAX_VALUE_LENGTH} characters")
    if not _SEMVER.match(value):
        errs.append("must be a semantic version (semver 2.0.0)")
    return errs


def normalize_version(text: str) -> str | None:
    """`570.124.06` -> `570.124.6`, `12.8` -> `12.8.0`; None when it is not numeric dotted."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    nums = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(nums)


def qualified_name_errors(name: str) -> list[str]:
    """Attribute and capacity names: `<C identifier>` or `<DNS subdomain>/<C identifier>`."""
    domain, sep, ident = name.rpartition("/")
    errs = []
    if sep:
        if not domain:
            errs.append("has an empty domain")
        else:
            errs += [f"domain {e}" for e in dns_subdomain_errors(domain, MAX_DOMAIN_LENGTH)]
    if len(ident) > MAX_ID_LENGTH:
        errs.append(f"identifier must be no more than {MAX_ID_LENGTH} characters")
    if not _C_IDENTIFIER.match(ident):
        errs.append("identifier must be a C identifier")
    return errs


def label_key_errors(key: str) -> list[str]:
    """Taint keys follow the label key rules."""
    prefix, sep, name = key.rpartition("/")
    errs = []
    if sep:
        errs += [f"prefix {e}" for e in dns_subdomain_errors(prefix)]
    if len(name) > 63 or not _LABEL_NAME.match(name):
        errs.append("name must be 63 characters or less, alphanumerics, '-', '_' or '.'")
    return errs


def label_value_errors(value: str) -> list[str]:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return ["must be 63 characters or less, alphanumerics, '-', '_' or '.'"]
    return []


def attribute_value_errors(value: AttrValue) -> list[str]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            return ["int out of 64-bit range"]
        return []
    if isinstance(value, Version):
        return semver_errors(value.value)
    if isinstance(value, str):
        if len(value) > MAX_VALUE_LENGTH:
            return [f"string must be no more than {MAX_VALUE_LENGTH} characters (is {len(value)})"]
        return []
    return [f"unsupported value type {type(value).__name__}"]


def quantity_errors(value: str) -> list[str]:
    return [] if _QUANTITY.match(value) else [f"{value!r} is not a quantity"]


def _amount(text: object) -> int | None:
    """An integer quantity as a number, for comparisons; None when it is not one (fractions, `500m`)."""
    try:
        return quantity.parse_int(str(text))
    except ValueError:
        return None


def request_policy_errors(policy: Mapping[str, Any], capacity: str | None = None) -> list[str]:
    """A capacity's `requestPolicy`; with `capacity` (the capacity's value) also the rules that relate
    them (the 1.37 schema's capacityrequestpolicy and capacityrequestpolicyrange descriptions): a range
    needs a default inside it, min <= max <= capacity, min + step <= capacity, max and default multiples
    of step; valid values need a default among them, ascending. Compared only where every quantity
    involved is an integer one."""
    errs = []
    unknown = set(policy) - {"default", "validValues", "validRange"}
    if unknown:
        errs.append(f"unknown requestPolicy fields {sorted(unknown)}")
    if "validValues" in policy and "validRange" in policy:
        errs.append("validValues and validRange are mutually exclusive")
    values = policy.get("validValues") or []
    if len(values) > MAX_VALID_VALUES:
        errs.append(f"at most {MAX_VALID_VALUES} validValues")
    for v in values:
        errs += quantity_errors(str(v))
    rng = policy.get("validRange")
    if rng is not None:
        if "min" not in rng:
            errs.append("validRange needs min")
        for k in ("min", "max", "step"):
            if k in rng:
                errs += quantity_errors(str(rng[k]))
    if "default" in policy:
        errs += quantity_errors(str(policy["default"]))
    return errs or _policy_bounds_errors(policy, capacity)


def _policy_bounds_errors(policy: Mapping[str, Any], capacity: str | None) -> list[str]:
    errs = []
    cap = _amount(capacity) if capacity is not None else None
    default = _amount(policy["default"]) if "default" in policy else None
    if "validValues" in policy:
        values = [_amount(v) for v in policy.get("validValues") or []]
        if "default" not in policy:
            errs.append("validValues needs a default")
        if None not in values:
            known = [v for v in values if v is not None]
            if known != sorted(set(known)):
                errs.append("validValues must be ascending, without repeats")
            if default is not None and default not in known:
                errs.append("default must be one of validValues")
    rng = policy.get("validRange")
    if rng is not None:
        if "default" not in policy:
            errs.append("validRange needs a default")
        low, high, step = (_amount(rng[k]) if k in rng else None for k in ("min", "max", "step"))
        if low is not None and high is not None and low > high:
            errs.append("validRange.min must not be above max")
        if default is not None and ((low is not None and default < low) or (high is not None and default > high)):
            errs.append("default must lie within validRange")
        if step is not None and step > 0:
            errs += [f"{name} must be a multiple of validRange.step"
                     for name, v in (("max", high), ("default", default)) if v is not None and v % step]
        if cap is not None:
            if (low is not None and low > cap) or (high is not None and high > cap):
                errs.append("validRange must not go above the capacity's value")
            if low is not None and step is not None and low + step > cap:
                errs.append("validRange.min + step must not be above the capacity's value")
    return errs


def taint_errors(taint: Mapping[str, Any]) -> list[str]:
    errs = [f"key {e}" for e in label_key_errors(str(taint.get("key", "")))]
    if taint.get("value"):
        errs += [f"value {e}" for e in label_value_errors(str(taint["value"]))]
    if taint.get("effect") not in TAINT_EFFECTS:
        errs.append(f"effect must be one of {', '.join(TAINT_EFFECTS)}")
    return errs


def pool_name_errors(name: str) -> list[str]:
    errs = []
    if len(name) > MAX_POOL_NAME:
        errs.append(f"must be no more than {MAX_POOL_NAME} characters")
    for part in name.split("/"):
        if dns_subdomain_errors(part):
            errs.append("each '/'-separated part must be a DNS subdomain")
            break
    return errs


def device_limit(devices: list[Mapping[str, Any]]) -> int:
    """How many devices a slice holding `devices` may have."""
    restricted = any(
        d.get("taints") or d.get("consumesCounters")
        or any(len(a) == 1 and next(iter(a)) in ("ints", "bools", "strings", "versions")
               for a in (d.get("attributes") or {}).values())
        for d in devices
    )
    return MAX_DEVICES_PER_SLICE_RESTRICTED if restricted else MAX_DEVICES_PER_SLICE


def _counters_errors(counters: object, limit: int) -> list[str]:
    """A counter map: 1 to `limit` entries, DNS-label names, `{value: <quantity>}` values."""
    if not isinstance(counters, Mapping) or not counters:
        return ["counters must name at least one counter"]
    errs = []
    if len(counters) > limit:
        errs.append(f"{len(counters)} counters, more than {limit}")
    for name, counter in counters.items():
        errs += [f"counter {name!r} name {e}" for e in dns_label_errors(str(name))]
        value = counter.get("value") if isinstance(counter, Mapping) else None
        if not isinstance(value, str):
            errs.append(f"counter {name!r} needs a value")
        else:
            errs += [f"counter {name!r} {e}" for e in quantity_errors(value)]
    return errs


def counter_set_errors(counter_set: Mapping[str, Any]) -> list[str]:
    """One `sharedCounters[]` entry."""
    errs = [f"name {e}" for e in dns_label_errors(str(counter_set.get("name", "")))]
    return errs + _counters_errors(counter_set.get("counters"), MAX_COUNTERS_PER_SET)


def consumption_errors(consumption: Mapping[str, Any]) -> list[str]:
    """One `consumesCounters[]` entry of a device."""
    errs = [f"counterSet {e}" for e in dns_label_errors(str(consumption.get("counterSet", "")))]
    errs += _counters_errors(consumption.get("counters"), MAX_COUNTERS_PER_CONSUMPTION)
    if "compatibilityGroups" in consumption:
        errs += compatibility_groups_errors(consumption["compatibilityGroups"])
    return errs


def compatibility_groups_errors(groups: object) -> list[str]:
    """`consumesCounters[].compatibilityGroups`: a list of at most 2 unique names (see
    MAX_COMPATIBILITY_GROUPS for what is confirmed and what is the agent's own rule)."""
    if groups is None:
        return []
    if not isinstance(groups, list):
        return ["compatibilityGroups must be a list of names"]
    errs = []
    if len(groups) > MAX_COMPATIBILITY_GROUPS:
        errs.append(f"{len(groups)} compatibilityGroups, more than {MAX_COMPATIBILITY_GROUPS}")
    if len(set(map(str, groups))) != len(groups):
        errs.append("compatibilityGroups must be unique")
    for g in groups:
        if not isinstance(g, str):
            errs.append(f"compatibility group {g!r} must be a string")
        else:
            errs += [f"compatibility group {g!r} {e}" for e in dns_label_errors(g)]
    return errs


def shared_counters_errors(sets: list[Mapping[str, Any]]) -> list[str]:
    """`spec.sharedCounters` of one slice."""
    errs = []
    if len(sets) > MAX_COUNTER_SETS_PER_SLICE:
        errs.append(f"spec.sharedCounters has {len(sets)} counter sets, more than {MAX_COUNTER_SETS_PER_SLICE}")
    seen: set[str] = set()
    for i, cs in enumerate(sets):
        name = str(cs.get("name", ""))
        if name in seen:
            errs.append(f"spec.sharedCounters[{i}].name {name!r} is duplicated")
        seen.add(name)
        errs += [f"spec.sharedCounters[{i}]: {e}" for e in counter_set_errors(cs)]
    return errs


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
    return errs


def device_wire_errors(dev: Mapping[str, Any]) -> list[str]:
    errs: list[str] = []
    attrs = dev.get("attributes") or {}
    caps = dev.get("capacity") or {}
    if len(attrs) + len(caps) > MAX_ATTRIBUTES_AND_CAPACITIES:
        errs.append(f"{len(attrs) + len(caps)} attributes and capacities, more than "
                    f"{MAX_ATTRIBUTES_AND_CAPACITIES}")
    n_values = 0
    for key, wire in attrs.items():
        errs += [f"attribute {key!r} name {e}" for e in qualified_name_errors(key)]
        if not isinstance(wire, Mapping) or len(wire) != 1:
            errs.append(f"attribute {key!r} must set exactly one value")
            continue
        (kind, value), = wire.items()
        if kind in ("ints", "bools", "strings", "versions"):
            n_values += len(value)
            continue
        n_values += 1
        if kind == "version":
            errs += [f"attribute {key!r} {e}" for e in semver_errors(str(value))]
        elif kind == "string":
            if not isinstance(value, str) or len(value) > MAX_VALUE_LENGTH:
                errs.append(f"attribute {key!r} string must be no more than {MAX_VALUE_LENGTH} characters")
        elif kind == "int":
            if not isinstance(value, int) or isinstance(value, bool):
                errs.append(f"attribute {key!r} int must be an integer")
        elif kind == "bool":
            if not isinstance(value, bool):
                errs.append(f"attribute {key!r} bool must be a boolean")
        else:
            errs.append(f"attribute {key!r} has unknown value type {kind!r}")
    if n_values > MAX_ATTRIBUTE_VALUES:
        errs.append(f"{n_values} attribute values, more than {MAX_ATTRIBUTE_VALUES}")
    for key, cap in caps.items():
        errs += [f"capacity {key!r} name {e}" for e in qualified_name_errors(key)]
        errs += [f"capacity {key!r} {e}" for e in quantity_errors(str(cap.get("value", "")))]
        if cap.get("requestPolicy"):
            policy_errs = request_policy_errors(cap["requestPolicy"], str(cap.get("value")))
            errs += [f"capacity {key!r} {e}" for e in policy_errs]
            if not dev.get("allowMultipleAllocations"):
                errs.append(f"capacity {key!r} has a requestPolicy but the device does not allow multiple "
                            "allocations")
    taints = dev.get("taints") or []
    if len(taints) > MAX_TAINTS:
        errs.append(f"{len(taints)} taints, more than {MAX_TAINTS}")
    for t in taints:
        errs += [f"taint {t.get('key')!r} {e}" for e in taint_errors(t)]
    consumptions = dev.get("consumesCounters") or []
    if len(consumptions) > MAX_CONSUMPTIONS_PER_DEVICE:
        errs.append(f"{len(consumptions)} counter consumptions, more than {MAX_CONSUMPTIONS_PER_DEVICE}")
    used: set[str] = set()
    for c in consumptions:
        where = f"consumesCounters[{c.get('counterSet')!r}]"
        if c.get("counterSet") in used:
            errs.append(f"{where} appears twice (one entry per counter set)")
        used.add(str(c.get("counterSet")))
        errs += [f"{where} {e}" for e in consumption_errors(c)]
    for key, res in (dev.get("nodeAllocatableResources") or {}).items():
        errs += node_allocatable_errors(key, res, caps)
    return errs


def node_allocatable_errors(key: str, res: Any, caps: Mapping[str, Any]) -> list[str]:
    """One `nodeAllocatableResources` entry (the 1.37 schema: NodeAllocatableResource {mapping, overhead}).

    `mapping` {capacityKey + capacityMultiplier | deviceMultiplier} and `overhead` {perPod, perContainer}
    are both optional in the schema; an entry with neither says nothing, so it is refused here (the
    agent's own rule). A capacityKey must name a capacity of the device and needs capacityMultiplier,
    which is valid only with a capacityKey (the field comments)."""
    where = f"nodeAllocatableResources[{key!r}]"
    errs = []
    if not NODE_ALLOCATABLE_KEYS.match(key):
        errs.append(f"nodeAllocatableResources key {key!r} is not a node-allocatable resource")
    if not isinstance(res, Mapping):
        return [*errs, f"{where} must be an object"]
    unknown = sorted(set(res) - {"mapping", "overhead"})
    if unknown:
        errs.append(f"{where} has unknown fields {unknown}")
    if not res.get("mapping") and not res.get("overhead"):
        errs.append(f"{where} needs a mapping or an overhead")
    if (mapping := res.get("mapping")) is not None:
        if not isinstance(mapping, Mapping):
            return [*errs, f"{where}.mapping must be an object"]
        if bool(mapping.get("capacityKey")) == bool(mapping.get("deviceMultiplier")):
            errs.append(f"{where}.mapping needs exactly one of capacityKey and deviceMultiplier")
        if mapping.get("capacityKey"):
            if mapping["capacityKey"] not in caps:
                errs.append(f"{where} maps unknown capacity {mapping['capacityKey']!r}")
            if "capacityMultiplier" not in mapping:
                errs.append(f"{where}.mapping needs capacityMultiplier with capacityKey")
        elif "capacityMultiplier" in mapping:
            errs.append(f"{where}.mapping has capacityMultiplier without capacityKey")
        for field in ("capacityMultiplier", "deviceMultiplier"):
            if field in mapping:
                errs += [f"{where}.mapping.{field} {e}" for e in quantity_errors(str(mapping[field]))]
    if (overhead := res.get("overhead")) is not None:
        if not isinstance(overhead, Mapping):
            return [*errs, f"{where}.overhead must be an object"]
        if unknown := sorted(set(overhead) - {"perPod", "perContainer"}):
            errs.append(f"{where}.overhead has unknown fields {unknown}")
        for field in ("perPod", "perContainer"):
            if field in overhead:
                text = str(overhead[field])
                errs += [f"{where}.overhead.{field} {e}" for e in quantity_errors(text)]
                if text.startswith("-"):
                    errs.append(f"{where}.overhead.{field} must not be negative")
    return errs


# The claim status rules, under the one name callers use (`apirules.clip_device_status`).
from agent.apirules.status import (  # noqa: E402
    CONDITION_STATUSES,
    MAX_CONDITION_MESSAGE,
    MAX_CONDITION_REASON,
    MAX_CONDITION_TYPE,
    MAX_HARDWARE_ADDRESS,
    MAX_INTERFACE_NAME,
    MAX_NETWORK_IPS,
    MAX_STATUS_CONDITIONS,
    MAX_STATUS_DATA,
    DeviceKey,
    clip_device_status,
    condition_errors,
    device_key,
    interface_address_errors,
)

__all__ = [
    "CONDITION_STATUSES", "MAX_CONDITION_MESSAGE", "MAX_CONDITION_REASON", "MAX_CONDITION_TYPE",
    "MAX_HARDWARE_ADDRESS", "MAX_INTERFACE_NAME", "MAX_NETWORK_IPS", "MAX_STATUS_CONDITIONS", "MAX_STATUS_DATA",
    "DeviceKey", "clip_device_status", "condition_errors", "device_key", "interface_address_errors",
]

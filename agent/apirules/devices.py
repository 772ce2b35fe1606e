"""The API server's rules for one device of a ResourceSlice as the agent emits it: attributes and
capacities (names, values, how many), a capacity's request policy, taints, the device's counter
consumption entries (their own rules in `countersets`) and its node-allocatable resources."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from agent import quantity
from agent.apirules.countersets import MAX_CONSUMPTIONS_PER_DEVICE, consumption_errors
from agent.apirules.formats import (
    MAX_VALUE_LENGTH,
    label_key_errors,
    label_value_errors,
    qualified_name_errors,
    quantity_errors,
    semver_errors,
)

MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUES = 48
MAX_TAINTS = 16
MAX_BINDING_CONDITIONS = 4  # each of bindingConditions and bindingFailureConditions
MAX_VALID_VALUES = 10
TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")
NODE_ALLOCATABLE_KEYS = re.compile(r"^(cpu|memory|ephemeral-storage|hugepages-[0-9A-Za-z.]+)\Z")


def _amount(text: object) -> Fraction | None:
    """A quantity as an exact number, for comparisons; None when it is not one."""
    try:
        return quantity.exact(str(text))
    except ValueError:
        return None


def request_policy_errors(policy: Mapping[str, Any], capacity: str | None = None) -> list[str]:
    """A capacity's `requestPolicy`; with `capacity` (the capacity's value) also the rules that relate
    them (the 1.37 schema's capacityrequestpolicy and capacityrequestpolicyrange descriptions): a range
    needs a default inside it, min <= max <= capacity, min + step <= capacity, max and default a whole
    number of steps above min; valid values need a default among them, ascending. A range with a
    fraction in it (DRAFractionalCapacityRange) is compared in thousandths, so each of its values must be
    a whole number of them. Compared exactly (`quantity.exact`)."""
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
        if step is not None and step > 0 and low is not None:
            errs += [f"{name} must be a whole number of validRange.step above min"
                     for name, v in (("max", high), ("default", default))
                     if v is not None and ((v - low) / step).denominator != 1]
        bounds = [v for v in (low, high, step, default) if v is not None]
        if any(v.denominator != 1 for v in bounds) and any((v * 1000).denominator != 1 for v in bounds):
            errs.append("a fractional validRange counts in thousandths: every value must be a whole number of them")
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
            if not isinstance(value, list) or not value:
                errs.append(f"attribute {key!r} {kind} must be a list that is not empty")
                continue
            if kind == "ints" and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                errs.append(f"attribute {key!r} ints must be integers")
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
    errs += binding_condition_errors(dev.get("bindingConditions") or [], dev.get("bindingFailureConditions") or [])
    return errs


def binding_condition_errors(conditions: Sequence[str], failures: Sequence[str]) -> list[str]:
    """A device's `bindingConditions` and `bindingFailureConditions` (DRADeviceBindingConditions): at most
    4 of each, each a qualified name, no duplicates, the two lists apart, neither without the other."""
    errs: list[str] = []
    for field, names in (("bindingConditions", conditions), ("bindingFailureConditions", failures)):
        if len(names) > MAX_BINDING_CONDITIONS:
            errs.append(f"{field}: {len(names)} conditions, more than {MAX_BINDING_CONDITIONS}")
        for name in names:
            errs += [f"{field} {name!r} {e}" for e in label_key_errors(str(name))]
        if len(set(names)) != len(names):
            errs.append(f"{field} has duplicates")
    if overlap := sorted(set(conditions) & set(failures)):
        errs.append(f"bindingFailureConditions must not repeat bindingConditions ({', '.join(overlap)})")
    if bool(conditions) != bool(failures):
        errs.append("bindingConditions and bindingFailureConditions are each required with the other")
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

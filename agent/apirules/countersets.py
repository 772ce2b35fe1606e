"""The API server's rules for shared counters: a slice's counter sets (`spec.sharedCounters`) and a
device's counter consumption (`consumesCounters`, with its compatibility groups). The rules that
relate counter sets across a pool's slices are in `resourceslice.pool_errors`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.apirules.formats import dns_label_errors, quantity_errors

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

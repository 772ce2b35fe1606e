"""An oracle for the ResourceSlice rules the OpenAPI schema does not carry (agent/apirules/): hand-written
slices, each breaking one rule of the API server's ResourceSlice validation (resource.k8s.io/v1, 1.37) by
one step, and beside it its near miss, the same slice one step inside the rule.

Every slice here is written out as the API server would receive it, not built by the agent's slice
code, so a mistake in `apirules` (a limit off by one, a rule forgotten, a rule applied to the wrong
field) shows here as an example the checker accepts or a near miss it refuses. Each invalid example
must be refused with exactly one problem, the one naming its rule; each near miss must pass both the
1.37 OpenAPI schema and `apirules`.

The limits, as the API server states them for resource.k8s.io/v1 in 1.37: 128 devices per slice, 64
when any device of the slice has taints or consumes counters; 32 attributes and capacities together
per device, 48 attribute values per device (a list counts each element); attribute and capacity names
are C identifiers of at most 32 characters, optionally behind a DNS subdomain; string and version
values at most 64 characters, versions semver 2.0.0; 16 taints per device, effect None, NoSchedule or
NoExecute; 2 counter consumptions per device, one per counter set; 8 counter sets per slice, 32
counters per set and per consumption; `devices` and `sharedCounters` never in one slice; device names
unique in a slice, counter set names unique in a pool; a device consumes only counters its pool
publishes; one generation per pool.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kubernetes_validate
import pytest

from agent import apirules

DRIVER = "gpu.example.com"
NODE = "worker-1"

Obj = dict[str, Any]


def resource_slice(name: str, *, devices: list[Obj] | None = None, shared: list[Obj] | None = None,
                   count: int = 1, generation: int = 3) -> Obj:
    spec: Obj = {"driver": DRIVER, "nodeName": NODE,
                 "pool": {"name": NODE, "generation": generation, "resourceSliceCount": count}}
    if devices is not None:
        spec["devices"] = devices
    if shared is not None:
        spec["sharedCounters"] = shared
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}


def plain(i: int) -> Obj:
    return {"name": f"dev-{i}", "attributes": {"model": {"string": "x1"}}}


def tainted(i: int) -> Obj:
    return {**plain(i), "taints": [{"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}]}


def consuming(i: int) -> Obj:
    return {**plain(i), "consumesCounters": [{"counterSet": "gpu-0", "counters": {"memory": {"value": "1Gi"}}}]}


def listing(i: int) -> Obj:
    return {"name": f"dev-{i}", "attributes": {"links": {"strings": ["a", "b"]}}}


def counter_set(name: str, counters: int = 1) -> Obj:
    return {"name": name, "counters": {f"c{j}": {"value": "1"} for j in range(counters)}}


def one_device(**fields: Any) -> list[Obj]:
    return [resource_slice("s-0", devices=[{"name": "gpu-0", **fields}])]


def attrs(n: int, **extra: Obj) -> Obj:
    return {**{f"a{j}": {"int": j} for j in range(n)}, **extra}


def caps(n: int) -> Obj:
    return {f"k{j}": {"value": "1"} for j in range(n)}


@dataclass(frozen=True)
class Rule:
    """One rule: the slices of a pool breaking it by one step, the same one step inside it, and the
    message `apirules` gives for it."""

    name: str
    invalid: Callable[[], list[Obj]]
    near_miss: Callable[[], list[Obj]]
    message: str
    alone: bool = True  # False: no slice breaks this rule alone (33 counters never fit a set of 32),
    # so the first slice is judged on its own (`slice_errors`) and the pool's other refusals stand


RULES = [
    Rule("at most 128 devices in a slice",
         lambda: [resource_slice("s-0", devices=[plain(i) for i in range(129)])],
         lambda: [resource_slice("s-0", devices=[plain(i) for i in range(128)])],
         "spec.devices has 129 entries, more than 128"),
    Rule("at most 64 devices in a slice where one has taints",
         lambda: [resource_slice("s-0", devices=[tainted(0)] + [plain(i) for i in range(1, 65)])],
         lambda: [resource_slice("s-0", devices=[tainted(0)] + [plain(i) for i in range(1, 64)])],
         "spec.devices has 65 entries, more than 64"),
    Rule("at most 64 devices in a slice where one consumes counters",
         lambda: [resource_slice("s-0", devices=[consuming(0)] + [plain(i) for i in range(1, 65)], count=2),
                  resource_slice("s-1", shared=[counter_set("gpu-0") | {"counters": {"memory": {"value": "80Gi"}}}],
                                 count=2)],
         lambda: [resource_slice("s-0", devices=[consuming(0)] + [plain(i) for i in range(1, 64)], count=2),
                  resource_slice("s-1", shared=[counter_set("gpu-0") | {"counters": {"memory": {"value": "80Gi"}}}],
                                 count=2)],
         "spec.devices has 65 entries, more than 64"),
    Rule("at most 64 devices in a slice where one has a list attribute",
         lambda: [resource_slice("s-0", devices=[listing(0)] + [plain(i) for i in range(1, 65)])],
         lambda: [resource_slice("s-0", devices=[listing(0)] + [plain(i) for i in range(1, 64)])],
         "spec.devices has 65 entries, more than 64"),
    Rule("an attribute name is an identifier of at most 32 characters",
         lambda: one_device(attributes={"a" * 33: {"int": 1}}),
         lambda: one_device(attributes={"a" * 32: {"int": 1}}),
         "identifier must be no more than 32 characters"),
    Rule("a domain-qualified attribute name's identifier is at most 32 characters",
         lambda: one_device(attributes={"gpu.example.com/" + "b" * 33: {"int": 1}}),
         lambda: one_device(attributes={"gpu.example.com/" + "b" * 32: {"int": 1}}),
         "identifier must be no more than 32 characters"),
    Rule("an attribute name's identifier is a C identifier",
         lambda: one_device(attributes={"1model": {"int": 1}}),
         lambda: one_device(attributes={"_model1": {"int": 1}}),
         "identifier must be a C identifier"),
    Rule("a capacity name is an identifier of at most 32 characters",
         lambda: one_device(capacity={"m" * 33: {"value": "1"}}),
         lambda: one_device(capacity={"m" * 32: {"value": "1"}}),
         "identifier must be no more than 32 characters"),
    Rule("a string attribute is at most 64 characters",
         lambda: one_device(attributes={"serial": {"string": "s" * 65}}),
         lambda: one_device(attributes={"serial": {"string": "s" * 64}}),
         "string must be no more than 64 characters"),
    Rule("a version attribute is semver 2.0.0",
         lambda: one_device(attributes={"driverVersion": {"version": "570.124"}}),
         lambda: one_device(attributes={"driverVersion": {"version": "570.124.6"}}),
         "must be a semantic version"),
    Rule("a version attribute has no leading zeros",
         lambda: one_device(attributes={"driverVersion": {"version": "570.124.06"}}),
         lambda: one_device(attributes={"driverVersion": {"version": "570.124.6-rc.1+build.06"}}),
         "must be a semantic version"),
    Rule("a version attribute is at most 64 characters",
         lambda: one_device(attributes={"fw": {"version": "1.2.3+" + "b" * 59}}),
         lambda: one_device(attributes={"fw": {"version": "1.2.3+" + "b" * 58}}),
         "must be no more than 64 characters"),
    Rule("at most 32 attributes and capacities together",
         lambda: one_device(attributes=attrs(20), capacity=caps(13)),
         lambda: one_device(attributes=attrs(20), capacity=caps(12)),
         "33 attributes and capacities, more than 32"),
    Rule("at most 48 attribute values, each list element counted",
         lambda: one_device(attributes=attrs(1, l1={"ints": list(range(24))}, l2={"strings": ["x"] * 24})),
         lambda: one_device(attributes=attrs(1, l1={"ints": list(range(23))}, l2={"strings": ["x"] * 24})),
         "49 attribute values, more than 48"),
    Rule("at most 16 taints on a device",
         lambda: one_device(taints=[{"key": f"gpu.example.com/t{j}", "effect": "NoSchedule"} for j in range(17)]),
         lambda: one_device(taints=[{"key": f"gpu.example.com/t{j}", "effect": "NoSchedule"} for j in range(16)]),
         "17 taints, more than 16"),
    Rule("a taint's effect is None, NoSchedule or NoExecute",
         lambda: one_device(taints=[{"key": "gpu.example.com/xid", "effect": "PreferNoSchedule"}]),
         lambda: one_device(taints=[{"key": "gpu.example.com/xid", "effect": "None"}]),
         "effect must be one of None, NoSchedule, NoExecute"),
    Rule("at most 2 counter consumptions on a device",
         lambda: [resource_slice("s-0", devices=[{"name": "gpu-0", "consumesCounters": [
                      {"counterSet": f"set-{j}", "counters": {"c0": {"value": "1"}}} for j in range(3)]}], count=2),
                  resource_slice("s-1", shared=[counter_set(f"set-{j}") for j in range(3)], count=2)],
         lambda: [resource_slice("s-0", devices=[{"name": "gpu-0", "consumesCounters": [
                      {"counterSet": f"set-{j}", "counters": {"c0": {"value": "1"}}} for j in range(2)]}], count=2),
                  resource_slice("s-1", shared=[counter_set(f"set-{j}") for j in range(3)], count=2)],
         "3 counter consumptions, more than 2"),
    Rule("one consumption per counter set on a device",
         lambda: [resource_slice("s-0", devices=[{"name": "gpu-0", "consumesCounters": [
                      {"counterSet": "set-0", "counters": {"c0": {"value": "1"}}}] * 2}], count=2),
                  resource_slice("s-1", shared=[counter_set("set-0", 2)], count=2)],
         lambda: [resource_slice("s-0", devices=[{"name": "gpu-0", "consumesCounters": [
                      {"counterSet": "set-0", "counters": {"c0": {"value": "1"}, "c1": {"value": "1"}}}]}], count=2),
                  resource_slice("s-1", shared=[counter_set("set-0", 2)], count=2)],
         "appears twice"),
    Rule("at most 8 counter sets in a slice",
         lambda: [resource_slice("s-0", shared=[counter_set(f"set-{j}") for j in range(9)])],
         lambda: [resource_slice("s-0", shared=[counter_set(f"set-{j}") for j in range(8)])],
         "spec.sharedCounters has 9 counter sets, more than 8"),
    Rule("at most 32 counters in a counter set",
         lambda: [resource_slice("s-0", shared=[counter_set("set-0", 33)])],
         lambda: [resource_slice("s-0", shared=[counter_set("set-0", 32)])],
         "33 counters, more than 32"),
    Rule("at most 32 counters in one consumption",
         lambda: [resource_slice("s-0", devices=[{"name": "gpu-0", "consumesCounters": [
                      {"counterSet": "set-0", "counters": {f"c{j}": {"value": "1"} for j in range(33)}}]}], count=2),
                  resource_slice("s-1", shared=[counter_set("set-0", 32), counter_set("set-1")], count=2)],
         lambda: [resource_slice("s-0", devices=[{"name": "gpu-0", "consumesCounters": [
                      {"counterSet": "set-0", "counters": {f"c{j}": {"value": "1"} for j in range(32)}}]}], count=2),
                  resource_slice("s-1", shared=[counter_set("set-0", 32), counter_set("set-1")], count=2)],
         "33 counters, more than 32", alone=False),
    Rule("devices and sharedCounters are never in one slice",
         lambda: [resource_slice("s-0", devices=[consuming(0)], shared=[counter_set("gpu-0") | {
                      "counters": {"memory": {"value": "80Gi"}}}])],
         lambda: [resource_slice("s-0", devices=[consuming(0)], count=2),
                  resource_slice("s-1", shared=[counter_set("gpu-0") | {"counters": {"memory": {"value": "80Gi"}}}],
                                 count=2)],
         "spec.devices and spec.sharedCounters are mutually exclusive"),
    Rule("device names are unique in a slice",
         lambda: [resource_slice("s-0", devices=[plain(0), plain(0)])],
         lambda: [resource_slice("s-0", devices=[plain(0), plain(1)])],
         "is duplicated"),
    Rule("counter set names are unique in a pool",
         lambda: [resource_slice("s-0", shared=[counter_set("gpu-0")], count=2),
                  resource_slice("s-1", shared=[counter_set("gpu-0")], count=2)],
         lambda: [resource_slice("s-0", shared=[counter_set("gpu-0")], count=2),
                  resource_slice("s-1", shared=[counter_set("gpu-1")], count=2)],
         "is published twice in the pool"),
    Rule("a device consumes only counter sets its pool publishes",
         lambda: [resource_slice("s-0", devices=[consuming(0)])],
         lambda: [resource_slice("s-0", devices=[consuming(0)], count=2),
                  resource_slice("s-1", shared=[counter_set("gpu-0") | {"counters": {"memory": {"value": "80Gi"}}}],
                                 count=2)],
         "which the pool does not publish"),
    Rule("a device consumes only counters its counter set has",
         lambda: [resource_slice("s-0", devices=[consuming(0)], count=2),
                  resource_slice("s-1", shared=[counter_set("gpu-0")], count=2)],
         lambda: [resource_slice("s-0", devices=[consuming(0)], count=2),
                  resource_slice("s-1", shared=[counter_set("gpu-0") | {"counters": {"memory": {"value": "80Gi"}}}],
                                 count=2)],
         "that counter set 'gpu-0' does not have"),
    Rule("the slices of a pool agree on its generation",
         lambda: [resource_slice("s-0", devices=[plain(0)], count=2),
                  resource_slice("s-1", devices=[plain(1)], count=2, generation=4)],
         lambda: [resource_slice("s-0", devices=[plain(0)], count=2, generation=4),
                  resource_slice("s-1", devices=[plain(1)], count=2, generation=4)],
         "disagree on the pool's generation"),
    Rule("a capacity with a request policy needs a device allowing multiple allocations",
         lambda: one_device(capacity={"memory": {"value": "80Gi", "requestPolicy": {
             "default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}}}),
         lambda: one_device(allowMultipleAllocations=True, capacity={"memory": {"value": "80Gi", "requestPolicy": {
             "default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}}}),
         "does not allow multiple allocations"),
]


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_the_invalid_example_is_refused_for_its_rule_alone(rule: Rule) -> None:
    slices = rule.invalid()
    errors = apirules.pool_errors(slices) if rule.alone else apirules.slice_errors(slices[0])
    assert len(errors) == 1 and rule.message in errors[0], errors


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_the_near_miss_is_accepted_by_the_schema_and_the_rules(rule: Rule) -> None:
    slices = rule.near_miss()
    for obj in slices:
        kubernetes_validate.validate(copy.deepcopy(obj), "1.37.0", strict=True)
    assert apirules.pool_errors(slices) == []


def test_every_limit_the_agent_declares_has_an_example() -> None:
    """The limits `apirules` exports are the ones the examples step across (a changed constant shows here)."""
    assert (apirules.MAX_DEVICES_PER_SLICE, apirules.MAX_DEVICES_PER_SLICE_RESTRICTED) == (128, 64)
    assert (apirules.MAX_ATTRIBUTES_AND_CAPACITIES, apirules.MAX_ATTRIBUTE_VALUES, apirules.MAX_TAINTS) == (32, 48, 16)
    assert (apirules.MAX_ID_LENGTH, apirules.MAX_VALUE_LENGTH) == (32, 64)
    assert (apirules.MAX_CONSUMPTIONS_PER_DEVICE, apirules.MAX_COUNTER_SETS_PER_SLICE) == (2, 8)
    assert (apirules.MAX_COUNTERS_PER_SET, apirules.MAX_COUNTERS_PER_CONSUMPTION) == (32, 32)

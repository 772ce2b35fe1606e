"""One inventory device -> its ResourceSlice entry with whatever the API server would reject removed.

Value by value, with one message per removal naming the device, because one rejected field would
otherwise keep the whole pool unpublished (`slices.chunk_devices` logs the messages). Pure.
"""

from __future__ import annotations

import copy
from typing import Any

from agent import apirules
from agent.model import Device, attribute_wire

STANDARD_DOMAIN = "resource.kubernetes.io/"


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

"""Selectors, merge patches and ResourceClaim status validation as the API server does them (for the emulator
in kubeapi.py)."""

from __future__ import annotations

import copy
import ipaddress
import json
import re
from collections.abc import Mapping
from typing import Any


def status_body(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    out = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code}
    if details:
        out["details"] = details
    return out


class ApiAnswer(Exception):
    """An error answer; raised inside handlers, turned into a Status response."""

    def __init__(self, code: int, reason: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.body = status_body(code, reason, message, **details)
        self.code = code


def _path_value(obj: Mapping[str, Any], dotted: str) -> str:
    cur: Any = obj
    for part in dotted.split("."):
        cur = cur.get(part) if isinstance(cur, Mapping) else None
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def _split_requirements(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def field_matcher(selector: str, allowed: frozenset[str]) -> Any:
    reqs = []
    for req in _split_requirements(selector):
        m = re.fullmatch(r"([^=!]+?)\s*(==|=|!=)\s*(.*)", req)
        if not m:
            raise ApiAnswer(400, "BadRequest", f"invalid field selector: {req!r}")
        key, op, value = m.groups()
        if key not in allowed:
            raise ApiAnswer(400, "BadRequest", f'field label not supported: {key}')
        reqs.append((key, op != "!=", value))
    return lambda obj: all((_path_value(obj, k) == v) == eq for k, eq, v in reqs)


def label_matcher(selector: str) -> Any:
    reqs: list[tuple[str, str, frozenset[str]]] = []  # (key, operator, values)
    for req in _split_requirements(selector):
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", req):
            reqs.append((m.group(1), m.group(2), frozenset(v.strip() for v in m.group(3).split(","))))
        elif m := re.fullmatch(r"([^=!]+?)\s*(==|=|!=)\s*(.*)", req):
            reqs.append((m.group(1), "notin" if m.group(2) == "!=" else "in", frozenset({m.group(3)})))
        elif m := re.fullmatch(r"!\s*(\S+)", req):
            reqs.append((m.group(1), "absent", frozenset()))
        elif re.fullmatch(r"[A-Za-z0-9_./-]+", req):
            reqs.append((req, "present", frozenset()))
        else:
            raise ApiAnswer(400, "BadRequest", f"invalid label selector: {req!r}")

    def check(labels: Mapping[str, str], key: str, op: str, values: frozenset[str]) -> bool:
        if op == "present":
            return key in labels
        if op == "absent":
            return key not in labels
        return (labels.get(key) in values) == (op == "in")

    return lambda obj: all(check((obj.get("metadata") or {}).get("labels") or {}, *r) for r in reqs)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, null removes, everything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# -- ResourceClaim status.devices, as the API server validates a status write (1.37) -----------------
# Written from the API server's validation rules, apart from agent/apirules/, so that a test
# catches the agent sending what the server refuses.

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?\Z")
_QUALIFIED = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})\Z")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


def _subdomain(value: str, limit: int = 253) -> bool:
    return 0 < len(value) <= limit and all(_DNS_LABEL.match(p) for p in value.split("."))


def _cause(kind: str, field: str, message: str) -> dict[str, str]:
    return {"reason": kind, "field": field, "message": message}


def _invalid(field: str, value: Any, why: str) -> dict[str, str]:
    return _cause("FieldValueInvalid", field, f"Invalid value: {json.dumps(value)}: {why}")


def _too_many(field: str, n: int, limit: int) -> dict[str, str]:
    return _cause("FieldValueTooMany", field, f"Too many: {n}: must have at most {limit} items")


def _too_long(field: str, limit: int, unit: str = "bytes") -> dict[str, str]:
    return _cause("FieldValueTooLong", field, f"Too long: may not be more than {limit} {unit}")


def _interface_address(value: Any) -> str | None:
    try:
        if "/" not in str(value):
            raise ValueError("no prefix length")
        iface = ipaddress.ip_interface(str(value))
    except ValueError:
        return "must be a valid address in CIDR form, (e.g. 10.9.8.7/24 or 2001:db8::1/64)"
    canonical = f"{iface.ip.compressed}/{iface.network.prefixlen}"
    return None if str(value) == canonical else f'must be in canonical form ("{canonical}")'


def _condition_causes(cond: Any, path: str) -> list[dict[str, str]]:
    if not isinstance(cond, Mapping):
        return [_invalid(path, cond, "must be an object")]
    out = []
    if not _QUALIFIED.match(str(cond.get("type") or "")):
        out.append(_invalid(f"{path}.type", cond.get("type"), "must be a qualified name"))
    if cond.get("status") not in ("True", "False", "Unknown"):
        out.append(_cause("FieldValueNotSupported", f"{path}.status",
                          f'Unsupported value: {json.dumps(cond.get("status"))}: supported values: "False", '
                          '"True", "Unknown"'))
    reason = cond.get("reason")
    if not reason:
        out.append(_cause("FieldValueRequired", f"{path}.reason", "Required value"))
    elif len(str(reason)) > 1024 or not _REASON.match(str(reason)):
        out.append(_invalid(f"{path}.reason", reason, "a condition reason must start with alphabetic character, "
                            "optionally followed by a string of alphanumeric characters or '_,:', and must end "
                            "with an alphanumeric character or '_'"))
    if len(str(cond.get("message") or "")) > 32768:
        out.append(_too_long(f"{path}.message", 32768))
    if not _TIME.match(str(cond.get("lastTransitionTime") or "")):
        out.append(_cause("FieldValueRequired", f"{path}.lastTransitionTime", "Required value: must be set"))
    return out


def allocated_devices(obj: Mapping[str, Any]) -> set[tuple[str, str, str, str]]:
    results = (((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return {(str(r.get("driver")), str(r.get("pool")), str(r.get("device")), str(r.get("shareID") or ""))
            for r in results if isinstance(r, Mapping)}


def device_status_causes(obj: Mapping[str, Any]) -> list[dict[str, str]]:
    """Why the API server would refuse `status.devices` of this claim (empty: it would not)."""
    allocated = allocated_devices(obj)
    causes: list[dict[str, str]] = []
    seen: set[tuple[str, str, str, str]] = set()
    for i, entry in enumerate((obj.get("status") or {}).get("devices") or []):
        path = f"status.devices[{i}]"
        if not isinstance(entry, Mapping):
            causes.append(_invalid(path, entry, "must be an object"))
            continue
        driver, pool, device = str(entry.get("driver", "")), str(entry.get("pool", "")), str(entry.get("device", ""))
        share = str(entry.get("shareID") or "")
        if not _subdomain(driver, 63):
            causes.append(_invalid(f"{path}.driver", driver, "a lowercase RFC 1123 subdomain"))
        if not pool or len(pool) > 253 or not all(_subdomain(p) for p in pool.split("/")):
            causes.append(_invalid(f"{path}.pool", pool, "a lowercase RFC 1123 subdomain"))
        if not _DNS_LABEL.match(device) or len(device) > 63:
            causes.append(_invalid(f"{path}.device", device, "a lowercase RFC 1123 label"))
        if "shareID" in entry and not _UUID.match(share):
            causes.append(_invalid(f"{path}.shareID", share, "uid must be in RFC 4122 normalized form"))
        key = (driver, pool, device, share)
        if key not in allocated:
            shown = f"{driver}/{pool}/{device}" + (f"/{share}" if share else "")
            causes.append(_invalid(path, shown, "must be an allocated device in the claim"))
        if key in seen:
            causes.append(_cause("FieldValueDuplicate", path, f"Duplicate value: {json.dumps(list(key))}"))
        seen.add(key)
        conditions = entry.get("conditions") or []
        if len(conditions) > 8:
            causes.append(_too_many(f"{path}.conditions", len(conditions), 8))
        for j, cond in enumerate(conditions):
            causes += _condition_causes(cond, f"{path}.conditions[{j}]")
        if "data" in entry:
            data = entry["data"]
            if len(json.dumps(data, separators=(",", ":")).encode()) > 10 * 1024:
                causes.append(_too_long(f"{path}.data", 10 * 1024))
            elif not isinstance(data, Mapping):
                causes.append(_invalid(f"{path}.data", "<value omitted>", "must be a valid JSON object"))
        net = entry.get("networkData")
        if isinstance(net, Mapping):
            if len(str(net.get("interfaceName") or "")) > 256:
                causes.append(_too_long(f"{path}.networkData.interfaceName", 256))
            if len(str(net.get("hardwareAddress") or "")) > 128:
                causes.append(_too_long(f"{path}.networkData.hardwareAddress", 128))
            ips = net.get("ips") or []
            if len(ips) > 16:
                causes.append(_too_many(f"{path}.networkData.ips", len(ips), 16))
            else:
                for j, ip in enumerate(ips):
                    if why := _interface_address(ip):
                        causes.append(_invalid(f"{path}.networkData.ips[{j}]", ip, why))
                    if ip in ips[:j]:
                        causes.append(_cause("FieldValueDuplicate", f"{path}.networkData.ips[{j}]",
                                             f"Duplicate value: {json.dumps(ip)}"))
    return causes


# -- ResourceSlice fields behind alpha gates, as the API server drops them (1.37) ---------------------------

COMPATIBILITY_GROUPS_GATE = "DRADeviceCompatibilityGroups"


def _uses_groups(obj: Mapping[str, Any] | None) -> bool:
    return any("compatibilityGroups" in c for d in ((obj or {}).get("spec") or {}).get("devices") or []
               for c in d.get("consumesCounters") or [])


def drop_disabled_slice_fields(obj: dict[str, Any], old: Mapping[str, Any] | None, gates: set[str]) -> None:
    """With `DRADeviceCompatibilityGroups` off the API server strips `consumesCounters[].compatibilityGroups`
    from a new or updated ResourceSlice, unless the stored object already had the field (the gate's
    documented version-skew rule, kubernetes/website#56288)."""
    if COMPATIBILITY_GROUPS_GATE in gates or _uses_groups(old):
        return
    for dev in (obj.get("spec") or {}).get("devices") or []:
        for c in dev.get("consumesCounters") or []:
            c.pop("compatibilityGroups", None)


def invalid_answer(kind: str, group: str, name: str, causes: list[dict[str, str]]) -> ApiAnswer:
    """422 Invalid as the API server words it: `Kind.group "name" is invalid: [field: message, ...]`."""
    listed = [f"{c['field']}: {c['message']}" for c in causes]
    text = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
    return ApiAnswer(422, "Invalid", f'{kind}.{group} "{name}" is invalid: {text}', name=name, group=group,
                     kind=kind, causes=causes)

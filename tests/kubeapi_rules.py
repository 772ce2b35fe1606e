"""Selectors and merge patches as the API server applies them (for the emulator in kubeapi.py)."""

from __future__ import annotations

import copy
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

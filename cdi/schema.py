"""Strict validation of one CDI spec in its dict form, as the CDI library's strict parser judges it.

An unknown field anywhere fails the whole file in a runtime, so it is a problem
here too. JSON null counts as absent, as it does for the library's decoder.
Every problem names where it is (`devices[2].containerEdits.mounts[0].containerPath`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from cdi import names
from cdi.spec import KNOWN_VERSIONS, is_known_version, minimum_version, version_key

HOOK_NAMES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")
DEVICE_NODE_TYPES = ("c", "b", "u", "p")  # char, block, unbuffered char, FIFO (as mknod(1) names them)
MAX_ANNOTATIONS_SIZE = 256 * 1024  # the Kubernetes limit the CDI library applies to annotations

_INT64 = (-(2**63), 2**63 - 1)
_UINT32 = (0, 2**32 - 1)
_ANNOTATION_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")

Check = Callable[["_Problems", str, Any], object]


class _Problems:
    def __init__(self, version: tuple[int, int, int] | None) -> None:
        self.items: list[str] = []
        self.version = version  # None when cdiVersion itself is unusable

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}" if path else message)


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _object(p: _Problems, path: str, value: Any, fields: dict[str, Check],
            required: tuple[str, ...] = ()) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        p.add(path, f"must be an object, not {_type_name(value)}")
        return None
    for key in value:
        if key not in fields:
            p.add(path, f"unknown field {key!r}")
    for key in required:
        if value.get(key) is None:
            p.add(f"{path}.{key}" if path else key, "is required")
    for key, check in fields.items():
        if value.get(key) is not None:
            check(p, f"{path}.{key}" if path else key, value[key])
    return value


def _string(p: _Problems, path: str, value: Any) -> bool:
    if not isinstance(value, str):
        p.add(path, f"must be a string, not {_type_name(value)}")
        return False
    return True


def _boolean(p: _Problems, path: str, value: Any) -> None:
    if not isinstance(value, bool):
        p.add(path, f"must be a boolean, not {_type_name(value)}")


def _integer(bounds: tuple[int, int], positive: bool = False) -> Check:
    def check(p: _Problems, path: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            p.add(path, f"must be an integer, not {_type_name(value)}")
        elif not bounds[0] <= value <= bounds[1]:
            p.add(path, f"{value} is out of range {bounds[0]}..{bounds[1]}")
        elif positive and value <= 0:
            p.add(path, f"must be greater than zero, not {value}")
    return check


def _list_of(item: Check) -> Check:
    def check(p: _Problems, path: str, value: Any) -> None:
        if not isinstance(value, list):
            p.add(path, f"must be a list, not {_type_name(value)}")
            return
        for i, v in enumerate(value):
            if v is None:
                p.add(f"{path}[{i}]", "must not be null")
            else:
                item(p, f"{path}[{i}]", v)
    return check


def _absolute_path(p: _Problems, path: str, value: Any) -> None:
    if _string(p, path, value):
        if not value:
            p.add(path, "is empty")
        elif not value.startswith("/"):
            p.add(path, f"{value!r} is not an absolute path")


def _non_empty(p: _Problems, path: str, value: Any) -> None:
    if _string(p, path, value) and not value:
        p.add(path, "is empty")


def _env_entry(p: _Problems, path: str, value: Any) -> None:
    if _string(p, path, value) and value.find("=") <= 0:
        p.add(path, f"{value!r} is not of the form NAME=VALUE")


def _interface_name(p: _Problems, path: str, value: Any) -> None:
    """The kernel's rule for a network interface name (dev_valid_name)."""
    if not _string(p, path, value):
        return
    if not value:
        p.add(path, "is empty")
    elif len(value.encode()) > 15 or value in (".", "..") or any(c in value for c in "/:") \
            or any(c.isspace() for c in value):
        p.add(path, f"{value!r} is not a valid network interface name (at most 15 bytes, no '/', ':' "
                    "or white space)")


def _device_node_type(p: _Problems, path: str, value: Any) -> None:
    if _string(p, path, value) and value not in ("", *DEVICE_NODE_TYPES):
        p.add(path, f"{value!r} is not one of {', '.join(DEVICE_NODE_TYPES)}")


def _permissions(p: _Problems, path: str, value: Any) -> None:
    if _string(p, path, value) and any(c not in "rwm" for c in value):
        p.add(path, f"{value!r} may only hold the letters r, w and m")


def _hook_name(p: _Problems, path: str, value: Any) -> None:
    if _string(p, path, value) and value not in HOOK_NAMES:
        p.add(path, f"{value!r} is not one of {', '.join(HOOK_NAMES)}")


def _clos_id(p: _Problems, path: str, value: Any) -> None:
    if _string(p, path, value) and (len(value) >= 4096 or value in (".", "..")
                                    or "/" in value or "\n" in value):
        p.add(path, f"{value!r} is not a valid file name")


_DEVICE_NODE = {
    "path": _absolute_path, "hostPath": _absolute_path, "type": _device_node_type,
    "major": _integer(_INT64), "minor": _integer(_INT64), "fileMode": _integer(_UINT32),
    "permissions": _permissions, "uid": _integer(_UINT32), "gid": _integer(_UINT32),
}
_MOUNT = {"hostPath": _non_empty, "containerPath": _absolute_path,
          "options": _list_of(_string), "type": _string}
_HOOK = {"hookName": _hook_name, "path": _absolute_path, "args": _list_of(_string),
         "env": _list_of(_env_entry), "timeout": _integer(_INT64, positive=True)}
_NET_DEVICE: dict[str, Check] = {"hostInterfaceName": _interface_name, "name": _interface_name}
_INTEL_RDT_ALWAYS = {"closID": _clos_id, "l3CacheSchema": _string, "memBwSchema": _string}
_INTEL_RDT_BEFORE_1_1 = {"enableCMT": _boolean, "enableMBM": _boolean}
_INTEL_RDT_SINCE_1_1 = {"schemata": _list_of(_string), "enableMonitoring": _boolean}


def _intel_rdt(p: _Problems, path: str, value: Any) -> None:
    # 1.1.0 dropped enableCMT/enableMBM for enableMonitoring. The 1.1.0 fields are always known here:
    # below 1.1.0 the minimum-version check names the version they need, which says more.
    fields: dict[str, Check] = {**_INTEL_RDT_ALWAYS, **_INTEL_RDT_SINCE_1_1}
    if p.version is None or p.version < (1, 1, 0):
        fields.update(_INTEL_RDT_BEFORE_1_1)
    _object(p, path, value, fields)


def _item(fields: dict[str, Check], required: tuple[str, ...]) -> Check:
    def check(p: _Problems, path: str, value: Any) -> None:
        _object(p, path, value, fields, required)
    return check


_EDITS: dict[str, Check] = {
    "env": _list_of(_env_entry),
    "deviceNodes": _list_of(_item(_DEVICE_NODE, ("path",))),
    "mounts": _list_of(_item(_MOUNT, ("hostPath", "containerPath"))),
    "hooks": _list_of(_item(_HOOK, ("hookName", "path"))),
    "additionalGids": _list_of(_integer(_UINT32)),
    "intelRdt": _intel_rdt,
    "netDevices": _list_of(_item(_NET_DEVICE, ("hostInterfaceName", "name"))),
}


def _edits(p: _Problems, path: str, value: Any) -> None:
    _object(p, path, value, _EDITS)


def _edits_empty(edits: dict[str, Any]) -> bool:
    return not any(edits.get(k) not in (None, [], {}) for k in _EDITS)


def _annotation_key_error(key: str) -> str | None:
    prefix, sep, name = key.rpartition("/")
    if sep and (not prefix or len(prefix) > 253
                or not all(_DNS_LABEL.fullmatch(label) for label in prefix.split("."))):
        return "its prefix must be a DNS subdomain (lower-case alphanumerics, '-' and '.')"
    if not name or len(name) > 63 or not _ANNOTATION_NAME.fullmatch(name):
        return ("its name must be at most 63 characters, alphanumerics, '-', '_' and '.', "
                "starting and ending with an alphanumeric")
    return None


def _annotations(p: _Problems, path: str, value: Any) -> None:
    if not isinstance(value, dict):
        p.add(path, f"must be an object, not {_type_name(value)}")
        return
    size = 0
    for key, v in value.items():
        where = f"{path}[{key!r}]"
        if not isinstance(key, str):
            p.add(where, "key must be a string")
            continue
        err = _annotation_key_error(key)
        if err:
            p.add(where, f"invalid key: {err}")
        if _string(p, where, v):
            size += len(key) + len(v)
    if size > MAX_ANNOTATIONS_SIZE:
        p.add(path, f"total size {size} exceeds {MAX_ANNOTATIONS_SIZE} bytes")


def _kind(p: _Problems, path: str, value: Any) -> None:
    err = names.kind_error(value)
    if err:
        p.add(path, err)


def _device_name(p: _Problems, path: str, value: Any) -> None:
    err = names.device_name_error(value)
    if err:
        p.add(path, err)


_DEVICE: dict[str, Check] = {"name": _device_name, "annotations": _annotations, "containerEdits": _edits}


def _devices(p: _Problems, path: str, value: Any) -> None:
    if not isinstance(value, list):
        p.add(path, f"must be a list, not {_type_name(value)}")
        return
    if not value:
        p.add(path, "must hold at least one device")
    seen: set[str] = set()
    for i, device in enumerate(value):
        where = f"{path}[{i}]"
        d = _object(p, where, device, _DEVICE, ("name", "containerEdits"))
        if d is None:
            continue
        name = d.get("name")
        if isinstance(name, str):
            if name in seen:
                p.add(f"{where}.name", f"device {name!r} is defined more than once")
            seen.add(name)
        if isinstance(d.get("containerEdits"), dict) and _edits_empty(d["containerEdits"]):
            p.add(f"{where}.containerEdits", "is empty: a device must edit the container somehow")


def _cdi_version(p: _Problems, path: str, value: Any) -> None:
    if _string(p, path, value) and not is_known_version(value):
        p.add(path, f"{value!r} is not a known CDI version ({', '.join(KNOWN_VERSIONS)})")


_SPEC: dict[str, Check] = {
    "cdiVersion": _cdi_version, "kind": _kind, "annotations": _annotations,
    "devices": _devices, "containerEdits": _edits,
}


def validate_spec(obj: Any) -> list[str]:
    """Every reason a runtime would refuse `obj` as a CDI spec; empty when it would accept it."""
    raw_version = obj.get("cdiVersion") if isinstance(obj, dict) else None
    version = version_key(raw_version) if is_known_version(raw_version) else None
    p = _Problems(version)
    if _object(p, "", obj, _SPEC, ("cdiVersion", "kind", "devices")) is None:
        return p.items
    if version is not None:
        needed = minimum_version(obj)
        if version < version_key(needed):
            p.add("cdiVersion", f"{raw_version} is lower than {needed}, which the fields used need")
    return p.items

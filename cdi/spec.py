"""The CDI spec model: a builder that emits plain dicts, and the minimum cdiVersion a spec needs.

Runtimes in the field (podman 4.x, containerd 1.7) refuse any cdiVersion above
0.5.0, so a spec must carry the lowest version its fields need, never simply the
newest one. `minimum_version` works on the dict form, so specs built by hand and
specs read from disk are judged by the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

KNOWN_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
BASELINE_VERSION = "0.3.0"  # the earliest version the CDI library still parses
RUNTIME_MAX_VERSION = "0.5.0"  # the newest that podman 4.x and containerd 1.7 accept


def version_key(version: str) -> tuple[int, int, int]:
    """`0.5.0` (or `v0.5.0`, as the CDI library also accepts) -> (0, 5, 0); ValueError if not x.y.z."""
    parts = version.removeprefix("v").split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{version!r} is not a version of the form x.y.z")
    return int(parts[0]), int(parts[1]), int(parts[2])


def is_known_version(version: Any) -> TypeGuard[str]:
    return isinstance(version, str) and version.removeprefix("v") in KNOWN_VERSIONS


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _all_edits(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    edits = [_dict(spec.get("containerEdits"))]
    edits += [_dict(_dict(d).get("containerEdits")) for d in _list(spec.get("devices"))]
    return edits


def _needs_1_1_0(spec: Mapping[str, Any]) -> bool:
    for e in _all_edits(spec):
        if _list(e.get("netDevices")):
            return True
        rdt = e.get("intelRdt")
        if isinstance(rdt, dict) and (rdt.get("schemata") is not None or rdt.get("enableMonitoring")):
            return True
    return False


def _needs_0_7_0(spec: Mapping[str, Any]) -> bool:
    return any(e.get("intelRdt") is not None or _list(e.get("additionalGids")) for e in _all_edits(spec))


def _needs_0_6_0(spec: Mapping[str, Any]) -> bool:
    if _dict(spec.get("annotations")):
        return True
    if any(_dict(_dict(d).get("annotations")) for d in _list(spec.get("devices"))):
        return True
    kind = spec.get("kind")
    if isinstance(kind, str) and "/" in kind:
        return "." in kind.split("/", 1)[1]
    return False


def _needs_0_5_0(spec: Mapping[str, Any]) -> bool:
    for d in _list(spec.get("devices")):
        name = _dict(d).get("name")
        if isinstance(name, str) and "0" <= name[:1] <= "9":
            return True
    return any(_dict(n).get("hostPath") for e in _all_edits(spec) for n in _list(e.get("deviceNodes")))


def _needs_0_4_0(spec: Mapping[str, Any]) -> bool:
    return any(_dict(m).get("type") for e in _all_edits(spec) for m in _list(e.get("mounts")))


_RULES = (("1.1.0", _needs_1_1_0), ("0.7.0", _needs_0_7_0), ("0.6.0", _needs_0_6_0),
          ("0.5.0", _needs_0_5_0), ("0.4.0", _needs_0_4_0))


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion whose schema has every field `spec` uses (the dict form).

    Malformed parts are ignored here; `cdi.validate.validate_spec` reports them.
    """
    for version, needed in _RULES:
        if needed(spec):
            return version
    return BASELINE_VERSION


# -- builder --------------------------------------------------------------------------------------

def _put(out: dict[str, Any], key: str, value: Any) -> None:
    """Omit what is unset, as the CDI library's own encoder does, so no field raises the version."""
    if value is None or value == [] or value == {} or value == "":
        return
    out[key] = value


@dataclass(slots=True)
class DeviceNode:
    path: str
    host_path: str | None = None
    type: str | None = None  # "c", "b", "u" or "p"; the runtime reads it from the host node when unset
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    permissions: str | None = None  # cgroup access, any of "rwm"
    uid: int | None = None
    gid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path}
        _put(out, "hostPath", self.host_path)
        _put(out, "type", self.type)
        _put(out, "major", self.major)
        _put(out, "minor", self.minor)
        _put(out, "fileMode", self.file_mode)
        _put(out, "permissions", self.permissions)
        _put(out, "uid", self.uid)
        _put(out, "gid", self.gid)
        return out


@dataclass(slots=True)
class Mount:
    host_path: str
    container_path: str
    options: list[str] = field(default_factory=list)
    type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hostPath": self.host_path, "containerPath": self.container_path}
        _put(out, "options", list(self.options))
        _put(out, "type", self.type)
        return out


@dataclass(slots=True)
class Hook:
    hook_name: str  # an OCI hook point: prestart, createRuntime, createContainer, startContainer, ...
    path: str
    args: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    timeout: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hookName": self.hook_name, "path": self.path}
        _put(out, "args", list(self.args))
        _put(out, "env", list(self.env))
        _put(out, "timeout", self.timeout)
        return out


@dataclass(slots=True)
class NetDevice:
    host_interface_name: str
    name: str

    def to_dict(self) -> dict[str, Any]:
        return {"hostInterfaceName": self.host_interface_name, "name": self.name}


@dataclass(slots=True)
class IntelRdt:
    clos_id: str | None = None
    l3_cache_schema: str | None = None
    mem_bw_schema: str | None = None
    schemata: list[str] | None = None  # 1.1.0
    enable_monitoring: bool = False  # 1.1.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        _put(out, "closID", self.clos_id)
        _put(out, "l3CacheSchema", self.l3_cache_schema)
        _put(out, "memBwSchema", self.mem_bw_schema)
        if self.schemata is not None:
            out["schemata"] = list(self.schemata)
        if self.enable_monitoring:
            out["enableMonitoring"] = True
        return out


def env_list(env: Mapping[str, str]) -> list[str]:
    """{"K": "V"} -> ["K=V"], sorted so the spec file is the same for the same input."""
    return [f"{k}={v}" for k, v in sorted(env.items())]


@dataclass(slots=True)
class ContainerEdits:
    env: list[str] = field(default_factory=list)
    device_nodes: list[DeviceNode] = field(default_factory=list)
    mounts: list[Mount] = field(default_factory=list)
    hooks: list[Hook] = field(default_factory=list)
    additional_gids: list[int] = field(default_factory=list)
    intel_rdt: IntelRdt | None = None
    net_devices: list[NetDevice] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.mounts or self.hooks or self.additional_gids
                    or self.intel_rdt is not None or self.net_devices)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        _put(out, "env", list(self.env))
        _put(out, "deviceNodes", [n.to_dict() for n in self.device_nodes])
        _put(out, "mounts", [m.to_dict() for m in self.mounts])
        _put(out, "hooks", [h.to_dict() for h in self.hooks])
        _put(out, "additionalGids", list(self.additional_gids))
        if self.intel_rdt is not None:
            out["intelRdt"] = self.intel_rdt.to_dict()
        _put(out, "netDevices", [n.to_dict() for n in self.net_devices])
        return out


@dataclass(slots=True)
class Device:
    name: str
    container_edits: ContainerEdits
    annotations: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        _put(out, "annotations", dict(self.annotations))
        out["containerEdits"] = self.container_edits.to_dict()
        return out


@dataclass(slots=True)
class Spec:
    kind: str
    devices: Sequence[Device]
    container_edits: ContainerEdits | None = None
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_version: str | None = None  # None: the minimum the fields need

    def to_dict(self) -> dict[str, Any]:
        """The spec as a runtime reads it; ValueError if an explicit cdi_version is too low for it."""
        out: dict[str, Any] = {"cdiVersion": "", "kind": self.kind}
        _put(out, "annotations", dict(self.annotations))
        out["devices"] = [d.to_dict() for d in self.devices]
        if self.container_edits is not None:
            _put(out, "containerEdits", self.container_edits.to_dict())
        needed = minimum_version(out)
        if self.cdi_version is None:
            out["cdiVersion"] = needed
        elif version_key(self.cdi_version) < version_key(needed):
            raise ValueError(f"cdiVersion {self.cdi_version} is lower than {needed}, which the fields need")
        else:
            out["cdiVersion"] = self.cdi_version
        return out

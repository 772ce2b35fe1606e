"""Container Device Interface specs: build them, name devices, validate, write them atomically.

This package knows CDI and nothing of the agent, so the CLI, the tests and the
agent share one definition of what a runtime accepts.

The names below are loaded on first use (PEP 562): `cdi.atomic`, which every agent write goes
through, must not pull in the schema and the validator, whose import is a large part of a CLI
command's start-up time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cdi.names import (
        InvalidName,
        QualifiedDevice,
        is_qualified,
        parse_kind,
        parse_qualified,
        qualified_name,
    )
    from cdi.schema import validate_spec
    from cdi.spec import (
        RUNTIME_MAX_VERSION,
        ContainerEdits,
        Device,
        DeviceNode,
        Hook,
        IntelRdt,
        Mount,
        NetDevice,
        Spec,
        env_list,
        minimum_version,
    )
    from cdi.store import InvalidFilename, InvalidSpec, remove_spec, transient_spec_name, write_spec
    from cdi.validate import DirReport, SpecFile, format_report, validate_dirs, validate_file

_WHERE = {
    "ContainerEdits": "cdi.spec",
    "Device": "cdi.spec",
    "DeviceNode": "cdi.spec",
    "DirReport": "cdi.validate",
    "Hook": "cdi.spec",
    "IntelRdt": "cdi.spec",
    "InvalidFilename": "cdi.store",
    "InvalidName": "cdi.names",
    "InvalidSpec": "cdi.store",
    "Mount": "cdi.spec",
    "NetDevice": "cdi.spec",
    "QualifiedDevice": "cdi.names",
    "RUNTIME_MAX_VERSION": "cdi.spec",
    "Spec": "cdi.spec",
    "SpecFile": "cdi.validate",
    "env_list": "cdi.spec",
    "format_report": "cdi.validate",
    "is_qualified": "cdi.names",
    "minimum_version": "cdi.spec",
    "parse_kind": "cdi.names",
    "parse_qualified": "cdi.names",
    "qualified_name": "cdi.names",
    "remove_spec": "cdi.store",
    "transient_spec_name": "cdi.store",
    "validate_dirs": "cdi.validate",
    "validate_file": "cdi.validate",
    "validate_spec": "cdi.schema",
    "write_spec": "cdi.store",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'cdi' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "RUNTIME_MAX_VERSION",
    "ContainerEdits",
    "Device",
    "DeviceNode",
    "DirReport",
    "Hook",
    "IntelRdt",
    "InvalidFilename",
    "InvalidName",
    "InvalidSpec",
    "Mount",
    "NetDevice",
    "QualifiedDevice",
    "Spec",
    "SpecFile",
    "env_list",
    "format_report",
    "is_qualified",
    "minimum_version",
    "parse_kind",
    "parse_qualified",
    "qualified_name",
    "remove_spec",
    "transient_spec_name",
    "validate_dirs",
    "validate_file",
    "validate_spec",
    "write_spec",
]

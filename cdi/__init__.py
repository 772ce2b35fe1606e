"""Container Device Interface specs: build them, name devices, validate, write them atomically.

This package knows CDI and nothing of the agent, so the CLI, the tests and the
agent share one definition of what a runtime accepts.
"""

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

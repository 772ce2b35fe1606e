"""Validation of CDI spec files and of the spec directories a runtime reads (`dra-agent cdi validate`).

A runtime reads only `*.json` and `*.yaml` directly inside each CDI directory. Of two
directories, the later one in the list wins (`/var/run/cdi` over `/etc/cdi`): a device
it defines shadows the same device in an earlier directory. Two files in the same
directory that define the same device are a conflict, and runtimes then refuse that
device altogether, whichever directory also defines it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cdi.schema import validate_spec
from cdi.spec import RUNTIME_MAX_VERSION, is_known_version, version_key

__all__ = ["DirReport", "SpecFile", "format_report", "inspect_file", "load_spec_file", "validate_dirs",
           "validate_file", "validate_spec"]

SPEC_SUFFIXES = (".json", ".yaml")


class _StrictYamlLoader(yaml.SafeLoader):
    """Refuses a repeated key, as the CDI library's strict YAML parser does."""


def _construct_mapping(loader: _StrictYamlLoader, node: yaml.MappingNode,
                       deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"repeated key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"repeated key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_spec_file(path: Path) -> Any:
    """The parsed content of a `.json` or `.yaml` spec file; ValueError or OSError when unreadable."""
    data = path.read_bytes()
    if path.suffix == ".yaml":
        try:
            return yaml.load(data, Loader=_StrictYamlLoader)
        except yaml.YAMLError as e:
            raise ValueError(f"not valid YAML: {e}") from None
    try:
        return json.loads(data, object_pairs_hook=_json_pairs, parse_constant=_no_constant)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None


@dataclass(slots=True)
class SpecFile:
    path: Path
    problems: list[str] = field(default_factory=list)  # any problem: a runtime refuses the file
    warnings: list[str] = field(default_factory=list)
    kind: str | None = None
    cdi_version: str | None = None
    devices: list[str] = field(default_factory=list)  # qualified device IDs, when the file is valid

    @property
    def ok(self) -> bool:
        return not self.problems


def inspect_file(path: Path) -> SpecFile:
    result = SpecFile(Path(path))
    try:
        obj = load_spec_file(result.path)
    except (OSError, ValueError) as e:
        result.problems.append(str(e) if isinstance(e, ValueError) else f"cannot read: {e.strerror or e}")
        return result
    result.problems = validate_spec(obj)
    if isinstance(obj, dict):
        kind, version = obj.get("kind"), obj.get("cdiVersion")
        result.kind = kind if isinstance(kind, str) else None
        result.cdi_version = version if isinstance(version, str) else None
        if result.ok:
            result.devices = [f"{kind}={d['name']}" for d in obj["devices"]]
        if is_known_version(version) and version_key(version) > version_key(RUNTIME_MAX_VERSION):
            result.warnings.append(f"cdiVersion {version} is above {RUNTIME_MAX_VERSION}: podman 4.x and "
                                   "containerd 1.7 refuse the file")
    return result


def validate_file(path: Path) -> list[str]:
    """Every reason a runtime would refuse the spec file at `path` (`.json` or `.yaml`)."""
    return inspect_file(path).problems


@dataclass(slots=True)
class DirReport:
    dirs: list[Path]
    files: list[SpecFile] = field(default_factory=list)
    missing: list[Path] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)  # problems: runtimes refuse these devices
    shadowed: list[str] = field(default_factory=list)  # notes: a later directory wins
    unusable: list[str] = field(default_factory=list)  # problems: named paths that hold no CDI spec

    @property
    def ok(self) -> bool:
        return not self.conflicts and not self.unusable and all(f.ok for f in self.files)

    @property
    def devices(self) -> list[str]:
        return sorted({d for f in self.files for d in f.devices})


def spec_files(directory: Path) -> list[Path]:
    """The files a runtime reads in `directory`: `*.json` and `*.yaml` directly inside, sorted."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [Path(e.path) for e in entries
            if e.name.endswith(SPEC_SUFFIXES) and not e.is_dir(follow_symlinks=True)]


def validate_dirs(dirs: Iterable[Path]) -> DirReport:
    """Validate every spec file a runtime would read from `dirs`, lowest priority first."""
    return _validate(dirs, named=False)


def validate_paths(paths: Iterable[Path]) -> DirReport:
    """Like `validate_dirs`, for paths a person named: a spec file is checked on its own (at its place in
    the order), and a path that does not exist or is neither a directory nor a spec file is a problem (a
    runtime's directory may be missing; a path named by hand that holds no spec is a mistake)."""
    return _validate(paths, named=True)


def _validate(targets: Iterable[Path], *, named: bool) -> DirReport:
    report = DirReport([Path(d) for d in targets])
    defined: dict[str, list[tuple[int, Path]]] = {}
    for priority, directory in enumerate(report.dirs):
        if directory.is_dir():
            files = spec_files(directory)
        elif not named:
            report.missing.append(directory)
            continue
        elif directory.is_file() and directory.name.endswith(SPEC_SUFFIXES):
            files = [directory]
        else:
            report.unusable.append(f"{directory}: no such file or directory" if not directory.exists() else
                                   f"{directory}: not a CDI spec directory or spec file "
                                   f"({', '.join('*' + s for s in SPEC_SUFFIXES)})")
            continue
        for path in files:
            spec = inspect_file(path)
            report.files.append(spec)
            for device in spec.devices:
                defined.setdefault(device, []).append((priority, path))
    for device, where in sorted(defined.items()):
        by_priority: dict[int, list[Path]] = {}
        for priority, path in where:
            by_priority.setdefault(priority, []).append(path)
        for paths in by_priority.values():
            if len(paths) > 1:
                report.conflicts.append(f"{device} is defined in {_join(paths)} (the same directory): "
                                        "runtimes refuse this device")
        top = max(by_priority)
        winner = by_priority[top][0]
        for priority, paths in sorted(by_priority.items()):
            if priority < top:
                report.shadowed.append(f"{device} in {_join(paths)} is shadowed by {winner}")
    return report


def _join(paths: Sequence[Path]) -> str:
    return ", ".join(str(p) for p in paths)


def format_report(report: DirReport) -> str:
    """The report for a person at a terminal: one line per file, its problems indented below it."""
    lines: list[str] = []
    for directory in report.missing:
        lines.append(f"{directory}: no such directory (runtimes skip it)")
    lines.extend(report.unusable)
    for f in report.files:
        if f.ok:
            n = len(f.devices)
            lines.append(f"{f.path}: ok (kind {f.kind}, cdiVersion {f.cdi_version}, "
                         f"{n} device{'' if n == 1 else 's'})")
        else:
            lines.append(f"{f.path}: INVALID, runtimes refuse the whole file")
            lines.extend(f"  - {problem}" for problem in f.problems)
        lines.extend(f"  warning: {w}" for w in f.warnings)
    lines.extend(f"conflict: {c}" for c in report.conflicts)
    lines.extend(f"note: {s}" for s in report.shadowed)
    bad = sum(not f.ok for f in report.files)
    if not report.files:
        lines.append(f"no spec files in {_join(report.dirs)}")
    lines.append(f"{len(report.files)} file{'' if len(report.files) == 1 else 's'}, {bad} invalid, "
                 f"{len(report.devices)} devices, {len(report.conflicts)} conflicts: "
                 f"{'OK' if report.ok else 'FAILED'}")
    return "\n".join(lines)

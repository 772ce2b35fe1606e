"""Writing and removing CDI spec files in a directory that runtimes read at any moment.

A spec is written to a temp file in the same directory and renamed over the
target (`cdi.atomic`, the project's one atomic write), so a runtime sees the old
file or the new one, never half of one. There
is no fsync: CDI directories are tmpfs on real nodes, and a spec is re-derived from
the claim's durable record after a crash.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from cdi import atomic, names
from cdi.schema import validate_spec

SPEC_SUFFIXES = (".json", ".yaml")
SPEC_MODE = 0o644
_TEMP_EXTRA = len(".") + len(".tmp-") + 8  # what the temp name adds to the spec's name
_NAME_MAX = 255


class InvalidFilename(ValueError):
    pass


class InvalidSpec(ValueError):
    def __init__(self, filename: str, problems: list[str]) -> None:
        super().__init__(f"CDI spec {filename} is invalid: " + "; ".join(problems))
        self.problems = problems


def check_filename(filename: str) -> None:
    """A spec file name that stays inside its directory and that runtimes read; else InvalidFilename."""
    if not isinstance(filename, str) or not filename:
        raise InvalidFilename("spec file name is empty")
    if "/" in filename or "\0" in filename or ".." in filename:
        raise InvalidFilename(f"spec file name {filename!r} must not hold '/', NUL or '..'")
    if not filename.endswith(SPEC_SUFFIXES) or filename in SPEC_SUFFIXES:
        raise InvalidFilename(f"spec file name {filename!r} must end in .json or .yaml (runtimes read "
                              "nothing else)")
    if len(filename.encode()) + _TEMP_EXTRA > _NAME_MAX:
        raise InvalidFilename(f"spec file name {filename!r} is too long (at most "
                              f"{_NAME_MAX - _TEMP_EXTRA} bytes)")


def transient_spec_name(vendor: str, cls: str, claim_id: str) -> str:
    """`<vendor>-<class>_<id>.json`: the name of a spec that lives as long as one claim."""
    err = names.vendor_error(vendor) or names.class_error(cls)
    if err:
        raise InvalidFilename(err)
    if not claim_id or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in claim_id):
        raise InvalidFilename(f"spec ID {claim_id!r} may only hold ASCII letters, digits, '-', '_' and '.'")
    filename = f"{vendor}-{cls}_{claim_id}.json"
    check_filename(filename)
    return filename


def encode_spec(spec: Mapping[str, Any]) -> bytes:
    return orjson.dumps(spec, option=orjson.OPT_INDENT_2) + b"\n"


def write_spec(directory: Path | str, filename: str, spec: Mapping[str, Any], check: bool = True) -> Path:
    """Atomically write `spec` as `directory/filename` (mode 0644) and return its path.

    `check` refuses (InvalidSpec) a spec that runtimes would refuse, before anything
    reaches the directory. The directory is created when missing.
    """
    check_filename(filename)
    if check:
        problems = validate_spec(spec)
        if problems:
            raise InvalidSpec(filename, problems)
    data = encode_spec(spec)
    directory = Path(directory)
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        atomic.write_at(dir_fd, filename, data, SPEC_MODE)
    finally:
        os.close(dir_fd)
    target = directory / filename
    return target


def remove_spec(path: Path | str) -> bool:
    """Remove a spec file; True if it was there. Removing one that is gone is not an error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True

"""Finds the NVIDIA Container Toolkit's own CDI devices (`nvidia.com/gpu=<uuid|index>`).

Where the toolkit has generated a spec, a prepared GPU also gets the toolkit's
device ID, so the runtime injects the driver libraries and hooks exactly as the
toolkit defines them instead of the agent re-deriving them. The directories are
re-read when their modification time changes (a spec written, renamed or
removed), and each spec only when its own (mtime, size) changes. The agent's own
per-claim specs change the dynamic directory on every prepare, so a directory is
listed at most once per `min_interval` seconds: a prepare never pays for listing
thousands of claim specs.

The directories are shared with other software, so any file in them may be
broken. A file that cannot be read or parsed, or a toolkit spec of the wrong
shape, is skipped with one warning per version of the file (the warning repeats
only when its (mtime, size) changes): one bad neighbour never fails a prepare,
and the good specs beside it are still used.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path

import orjson
import yaml

log = logging.getLogger(__name__)

KIND = "nvidia.com/gpu"
# Toolkit specs are kilobytes; a file far larger is not one, and is not worth the memory.
MAX_SPEC_BYTES = 16 << 20

_Version = tuple[int, int]  # (mtime_ns, size): a new version of a file changes one of them
_Entry = tuple[_Version, frozenset[str]]
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class SpecError(ValueError):
    """Why one CDI spec file is skipped (the message names the problem, the log line the file)."""


class ToolkitSpecs:
    def __init__(self, directories: list[Path], skip_prefixes: tuple[str, ...] = (),
                 min_interval: float = 2.0) -> None:
        self.directories = directories
        self.min_interval = min_interval
        self._scanned_at = -math.inf
        self.skip_prefixes = skip_prefixes  # our own per-claim specs: never the toolkit's
        self._dir_stamp: tuple[tuple[str, int], ...] | None = None
        self._files: dict[Path, _Entry] = {}
        self._names: frozenset[str] = frozenset()

    def device_id(self, uuid: str, index: int) -> str | None:
        """`nvidia.com/gpu=<uuid>` (or `=<index>`) when a toolkit spec defines it. Blocking."""
        self._refresh()
        if uuid and uuid in self._names:
            return f"{KIND}={uuid}"
        if index >= 0 and str(index) in self._names:
            return f"{KIND}={index}"
        return None

    def names(self) -> frozenset[str]:
        """Every device name the toolkit's specs define (`<uuid>`, `<index>`, `all`, ...). Blocking."""
        self._refresh()
        return self._names

    def warm(self) -> None:
        """Read the specs now (at start, off the kubelet's path), leaving the next lookup to look again at
        once: it then costs a stat of each directory, and lists them only if a spec came or went since
        (one written just after the start is seen by the first prepare, as without this). Blocking."""
        self._refresh()
        self._scanned_at = -math.inf

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._scanned_at < self.min_interval:
            return  # looked at most `min_interval` ago: not even a stat (this runs in every prepare)
        self._scanned_at = now
        stamp: list[tuple[str, int]] = []
        for d in self.directories:
            try:
                stamp.append((str(d), os.stat(d).st_mtime_ns))
            except OSError:
                stamp.append((str(d), -1))
        if tuple(stamp) == self._dir_stamp:
            return
        self._dir_stamp = tuple(stamp)
        files: dict[Path, _Entry] = {}
        for d in self.directories:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for entry in entries:
                if not entry.name.endswith((".json", ".yaml")) or entry.name.startswith(self.skip_prefixes):
                    continue
                path = Path(entry.path)
                try:
                    st = entry.stat()
                    version: _Version = (st.st_mtime_ns, st.st_size)
                except OSError:
                    # A dangling link, or gone since the listing: remembered as a version of its own
                    # so that it is reported once, not on every scan.
                    version = (-1, -1)
                cached = self._files.get(path)
                files[path] = cached if cached and cached[0] == version else _load(path, version)
        self._files = files
        self._names = frozenset().union(*(names for _, names in files.values()))


def _load(path: Path, listed: _Version) -> _Entry:
    """The GPU names of one file; a file that is not a usable spec is logged once and has none."""
    try:
        version, data = _read(path, listed)
    except SpecError as exc:
        log.warning("ignoring CDI spec %s: %s", path, exc)
        return listed, frozenset()
    try:
        return version, gpu_names(_decode(path, data))
    except SpecError as exc:
        log.warning("ignoring CDI spec %s: %s", path, exc)
        return version, frozenset()


def _read(path: Path, listed: _Version) -> tuple[_Version, bytes]:
    """The file's bytes and the version they belong to (from the open file, not the listing: a
    file rewritten in between is then cached under the version that was read)."""
    if listed == (-1, -1):
        raise SpecError("cannot stat it (a dangling link?)")
    try:
        # O_NONBLOCK: a FIFO named *.json must not hang the prepare that reads it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SpecError(f"cannot open it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        version = (st.st_mtime_ns, st.st_size)
        if stat.S_ISDIR(st.st_mode):
            raise SpecError("it is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise SpecError("it is not a regular file")
        if st.st_size > MAX_SPEC_BYTES:
            raise SpecError(f"it is larger than {MAX_SPEC_BYTES} bytes ({st.st_size})")
        chunks: list[bytes] = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return version, b"".join(chunks)
    except OSError as exc:
        raise SpecError(f"cannot read it: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _decode(path: Path, data: bytes) -> object:
    try:
        if path.suffix == ".json":
            return orjson.loads(data)
        return yaml.load(data, Loader=_LOADER)
    except (ValueError, yaml.YAMLError) as exc:  # orjson's error and a UTF-8 error are ValueErrors
        raise SpecError(f"not valid {path.suffix[1:].upper()}: {_one_line(exc)}") from None
    except RecursionError:  # the pure-Python YAML composer recurses once per nesting level
        raise SpecError("nested too deeply") from None


def gpu_names(spec: object) -> frozenset[str]:
    """The device names of a toolkit spec (`kind: nvidia.com/gpu`); none for a spec of another kind.

    A toolkit spec of the wrong shape is refused as a whole: the runtime parses specs strictly
    and refuses the whole file too, so an ID taken from its good devices would only move the
    failure to container creation."""
    if not isinstance(spec, Mapping):
        raise SpecError(f"the document must be an object, not {_kind(spec)}")
    if spec.get("kind") != KIND:
        return frozenset()
    devices = spec.get("devices")
    if devices is None:
        return frozenset()
    if not isinstance(devices, list):
        raise SpecError(f"devices must be a list, not {_kind(devices)}")
    names: set[str] = set()
    for i, device in enumerate(devices):
        if not isinstance(device, Mapping):
            raise SpecError(f"devices[{i}] must be an object, not {_kind(device)}")
        name = device.get("name")
        if not isinstance(name, str):
            raise SpecError(f"devices[{i}].name must be a string, not {_kind(name)}")
        names.add(name)
    return frozenset(names)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."

"""Finds the NVIDIA Container Toolkit's own CDI devices (`nvidia.com/gpu=<uuid|index>`).

Where the toolkit has generated a spec, a prepared GPU also gets the toolkit's
device ID, so the runtime injects the driver libraries and hooks exactly as the
toolkit defines them instead of the agent re-deriving them. The directories are
re-read when their modification time changes (a spec written, renamed or
removed), and each spec only when its own (mtime, size) changes. The agent's own
per-claim specs change the dynamic directory on every prepare, so a directory is
listed at most once per `min_interval` seconds: a prepare never pays for listing
thousands of claim specs.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import orjson
import yaml

log = logging.getLogger(__name__)

KIND = "nvidia.com/gpu"


class ToolkitSpecs:
    def __init__(self, directories: list[Path], skip_prefixes: tuple[str, ...] = (),
                 min_interval: float = 2.0) -> None:
        self.directories = directories
        self.min_interval = min_interval
        self._scanned_at = -math.inf
        self.skip_prefixes = skip_prefixes  # our own per-claim specs: never the toolkit's
        self._dir_stamp: tuple[tuple[str, int], ...] | None = None
        self._files: dict[Path, tuple[tuple[int, int], frozenset[str]]] = {}
        self._names: frozenset[str] = frozenset()

    def device_id(self, uuid: str, index: int) -> str | None:
        """`nvidia.com/gpu=<uuid>` (or `=<index>`) when a toolkit spec defines it. Blocking."""
        self._refresh()
        if uuid and uuid in self._names:
            return f"{KIND}={uuid}"
        if index >= 0 and str(index) in self._names:
            return f"{KIND}={index}"
        return None

    def _refresh(self) -> None:
        stamp = []
        for d in self.directories:
            try:
                stamp.append((str(d), os.stat(d).st_mtime_ns))
            except OSError:
                stamp.append((str(d), -1))
        if tuple(stamp) == self._dir_stamp or time.monotonic() - self._scanned_at < self.min_interval:
            return
        self._dir_stamp = tuple(stamp)
        self._scanned_at = time.monotonic()
        files: dict[Path, tuple[tuple[int, int], frozenset[str]]] = {}
        for d in self.directories:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for entry in entries:
                if not entry.name.endswith((".json", ".yaml")) or entry.name.startswith(self.skip_prefixes):
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue
                path = Path(entry.path)
                key = (st.st_mtime_ns, st.st_size)
                cached = self._files.get(path)
                files[path] = cached if cached and cached[0] == key else (key, _gpu_names(path))
        self._files = files
        self._names = frozenset().union(*(names for _, names in files.values()))


def _gpu_names(path: Path) -> frozenset[str]:
    try:
        data = path.read_bytes()
        spec = orjson.loads(data) if path.suffix == ".json" else yaml.safe_load(data)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        log.debug("skipping unreadable CDI spec %s: %s", path, exc)
        return frozenset()
    if not isinstance(spec, dict) or spec.get("kind") != KIND:
        return frozenset()
    return frozenset(str(d.get("name")) for d in spec.get("devices") or [] if isinstance(d, dict))

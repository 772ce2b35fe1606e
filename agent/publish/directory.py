"""Offline publishing: ResourceSlices as YAML files in a directory, when the agent has no API server.

`DirectoryPublisher` writes `DIR/resourceslices/<driver>-<node>-<i>.yaml`, exactly the objects
`ApiPublisher` would POST. Like it, it reads what is there, lets `slices.plan_pool` decide, and
carries the plan out: writes first (atomically), deletes after; an unchanged inventory writes
nothing. Temp files a crash left behind are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from agent.config import Settings
from agent.fsutil import atomic_write, is_temp_name, makedirs, unlink_quiet
from agent.kube import NodeInfo
from agent.model import Device
from agent.publish import dropped, slices
from agent.publish.loop import PublishError, SyncResult, log_result, owner_ref

# The one logger of publishing, as before the publishers had modules of their own.
log = logging.getLogger("agent.publish.apiserver")

MAX_FILE_NAME = 255
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def render_yaml(obj: Mapping[str, Any]) -> bytes:
    return yaml.dump(dict(obj), Dumper=_YAML_DUMPER, sort_keys=True, default_flow_style=False,
                     allow_unicode=True).encode()


def file_stem(driver: str, node: str) -> str:
    """`<driver>-<node>`, shortened with a digest where a file name would exceed NAME_MAX."""
    stem = f"{driver}-{node}"
    if len(stem) + len("-9999.yaml") <= MAX_FILE_NAME:
        return stem
    digest = hashlib.sha256(stem.encode()).hexdigest()[:16]
    return f"{stem[: MAX_FILE_NAME - 40]}-{digest}"


class DirectoryPublisher:
    """Slices as YAML files, `DIR/resourceslices/<driver>-<node>-<i>.yaml`: exactly what would be POSTed."""

    def __init__(self, directory: Path, settings: Settings, node: NodeInfo) -> None:
        self.dir = Path(directory) / "resourceslices"
        self.settings = settings
        self.driver = settings.driver_name
        self.groups = settings.compatibility_groups  # the cluster runs DRADeviceCompatibilityGroups
        self.node = node
        self.stem = file_stem(self.driver, node.name)
        self._pattern = re.compile(re.escape(self.stem) + r"-(0|[1-9][0-9]*)\.yaml")
        self._reported: set[str] = set()

    async def sync(self, devices: Sequence[Device]) -> SyncResult:
        chunks = slices.chunk_devices(devices, reported=self._reported, compatibility_groups=self.groups,
                                      layout=dropped.layout(self.settings, self.node))
        if chunks.errors:  # what the API server would refuse is not written either: the files stay
            msg = f"not writing ResourceSlices to {self.dir}: the pool's slices break API rules: " + \
                "; ".join(chunks.errors)
            log.error(msg)
            raise PublishError(msg)
        try:
            result = await asyncio.to_thread(self._sync_blocking, chunks.slices)
        except OSError as exc:
            msg = f"writing ResourceSlices to {self.dir} failed: {exc}"
            log.error(msg)
            raise PublishError(msg) from exc
        result.devices, result.dropped = chunks.device_count, chunks.dropped
        log_result(str(self.dir), result)
        return result

    async def close(self) -> None:
        pass

    def path(self, index: int) -> Path:
        return self.dir / f"{self.stem}-{index}.yaml"

    def existing(self) -> dict[str, bytes]:
        """This pool's files by stem, with their bytes."""
        found: dict[str, bytes] = {}
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return found
        for name in names:
            if self._pattern.fullmatch(name):
                with contextlib.suppress(FileNotFoundError):
                    found[name.removesuffix(".yaml")] = (self.dir / name).read_bytes()
            elif is_temp_name(name) and name.startswith(f".{self.stem}-"):
                unlink_quiet(self.dir / name)  # left by a crash mid-write
        return found

    def _sync_blocking(self, chunks: list[slices.Chunk]) -> SyncResult:
        makedirs(self.dir)
        raw = self.existing()
        existing = {key: _parse(data) for key, data in raw.items()}
        slots = [self.path(i).name.removesuffix(".yaml") for i in range(len(chunks))]
        plan = slices.plan_pool(existing, chunks, driver=self.driver, node=self.node.name,
                                owner=owner_ref(self.node), slots=slots)
        result = SyncResult(generation=plan.generation, slices=len(chunks))
        for write in plan.writes:
            assert write.key is not None  # slots give every chunk its file
            data = render_yaml(write.obj)
            if raw.get(write.key) == data:
                continue
            atomic_write(self.dir / f"{write.key}.yaml", data)
            (result.updated if write.key in raw else result.created).append(write.key)
        for key in plan.deletes:
            if unlink_quiet(self.dir / f"{key}.yaml"):
                result.deleted.append(key)
        return result


def _parse(data: bytes) -> dict[str, Any]:
    """A slice file's object; an unreadable one counts as an empty slice, so it gets rewritten."""
    try:
        obj = yaml.load(data, Loader=_YAML_LOADER)
    except yaml.YAMLError:
        return {}
    return obj if isinstance(obj, dict) else {}

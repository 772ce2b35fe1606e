"""Offline publishing: ResourceSlices as YAML files in a directory, when the agent has no API server.

`DirectoryPublisher` writes `DIR/resourceslices/<driver>-<node>-<i>.yaml`, exactly the objects
`ApiPublisher` would POST. Like it, it reads what is there, lets `slices.plan_pool` decide, and
carries the plan out: writes first (atomically), deletes after; an unchanged inventory writes
nothing. Temp files a crash left behind are removed.

The publish loop checks the files every minute or so (`PublishLoop.verify_interval`): when the devices
are those of the last sync and no file of the pool has changed since it (the same names, each with the
same inode, size, mtime and ctime), that check is a listing and a stat per file, not the pool rebuilt and
every file parsed again (0.2 to 0.4 s of CPU with the simulated dgx-h100's 231 devices, each minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
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


FileStamps = dict[str, tuple[int, int, int, int]]  # name -> inode, size, mtime, ctime


@dataclass(frozen=True)
class _Synced:
    """What the last sync left: its devices, the pool's files as it left them, its result."""

    devices: list[Device]
    stamps: FileStamps
    result: SyncResult


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
        self._synced: _Synced | None = None

    async def sync(self, devices: Sequence[Device]) -> SyncResult:
        last = self._synced
        if last is not None and list(devices) == last.devices and await asyncio.to_thread(self.stamps) == last.stamps:
            log.debug("slices in %s unchanged since generation %d", self.dir, last.result.generation)
            return replace(last.result, created=[], updated=[], deleted=[], dropped=list(last.result.dropped))
        self._synced = None
        chunks = slices.chunk_devices(devices, reported=self._reported, compatibility_groups=self.groups,
                                      layout=dropped.layout(self.settings, self.node))
        if chunks.errors:  # what the API server would refuse is not written either: the files stay
            msg = f"not writing ResourceSlices to {self.dir}: the pool's slices break API rules: " + \
                "; ".join(chunks.errors)
            log.error(msg)
            raise PublishError(msg)
        try:
            result, stamps = await asyncio.to_thread(self._sync_blocking, chunks.slices)
        except OSError as exc:
            msg = f"writing ResourceSlices to {self.dir} failed: {exc}"
            log.error(msg)
            raise PublishError(msg) from exc
        result.devices, result.dropped = chunks.device_count, chunks.dropped
        log_result(str(self.dir), result)
        # A copy: the devices compared at the next check are those written now, whatever becomes of these.
        self._synced = _Synced(copy.deepcopy(list(devices)), stamps, replace(result, dropped=list(result.dropped)))
        return result

    async def close(self) -> None:
        pass

    def path(self, index: int) -> Path:
        return self.dir / f"{self.stem}-{index}.yaml"

    def stamps(self) -> FileStamps:
        """The identity of every file of this pool (its temp files too): a write by anyone changes the
        size or the times (to the clock tick: the same size rewritten within a tick of the last sync
        would go unseen), an atomic replacement the inode."""
        found: FileStamps = {}
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return found
        for name in names:
            if self._pattern.fullmatch(name) or name.startswith(f".{self.stem}-"):
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(self.dir / name)
                    found[name] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        return found

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

    def _sync_blocking(self, chunks: list[slices.Chunk]) -> tuple[SyncResult, FileStamps]:
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
        return result, self.stamps()


def _parse(data: bytes) -> dict[str, Any]:
    """A slice file's object; an unreadable one counts as an empty slice, so it gets rewritten."""
    try:
        obj = yaml.load(data, Loader=_YAML_LOADER)
    except yaml.YAMLError:
        return {}
    return obj if isinstance(obj, dict) else {}

"""The prepare/unprepare engine: claim -> devices -> CDI specs + metadata files -> durable record.

Claims are independent: a lock per claim UID and a lock per device, never one
global lock, so the claims of one kubelet call (and of concurrent calls) are
prepared in parallel. All file I/O of one claim happens in a single worker
thread hop; the record, written last, is the only fsync.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import cdispecs, failpoints, metadata
from agent.allocation import Allocation, ClaimError, parse_claim
from agent.claims import ClaimNotFound, ClaimSourceError
from agent.config import Settings
from agent.fsutil import atomic_write, makedirs, unlink_quiet
from agent.inventory import Inventory
from agent.names import ClaimRef, InvalidName, base_request, check_claim_ref
from agent.state import ClaimRecord, ClaimStore, FileRecord
from agent.toolkit import ToolkitSpecs
from cdi.store import encode_spec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrepareResult:
    devices: list[dict[str, Any]] = field(default_factory=list)  # record form, see ClaimRecord.devices
    error: str = ""


class KeyedLocks:
    """asyncio locks by key, dropped again when nobody holds or waits for them."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, keys: Iterable[str]) -> AsyncIterator[None]:
        ordered = sorted(set(keys))  # one global order: no deadlock between claims sharing devices
        taken: list[str] = []
        acquired: set[str] = set()
        try:
            for key in ordered:
                lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
                self._locks[key] = (lock, users + 1)
                taken.append(key)
                await lock.acquire()
                acquired.add(key)
            yield
        finally:
            for key in reversed(taken):
                lock, users = self._locks[key]
                if key in acquired:
                    lock.release()
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


class DeviceLocks:
    """Thread locks by device name, held by the worker thread doing a claim's side effects, so a
    claim costs one worker-thread hop; dropped again when nobody holds or waits for them."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def hold(self, keys: Iterable[str]) -> Iterator[None]:
        ordered = sorted(set(keys))  # one global order: no deadlock between claims sharing devices
        with self._guard:
            locks = []
            for key in ordered:
                lock, users = self._locks.get(key) or (threading.Lock(), 0)
                self._locks[key] = (lock, users + 1)
                locks.append(lock)
        acquired: list[threading.Lock] = []
        try:
            for lock in locks:
                lock.acquire()
                acquired.append(lock)
            yield
        finally:
            for lock in reversed(acquired):
                lock.release()
            with self._guard:
                for key in ordered:
                    lock, users = self._locks[key]
                    if users == 1:
                        del self._locks[key]
                    else:
                        self._locks[key] = (lock, users - 1)


class PrepareEngine:
    def __init__(self, settings: Settings, inventory: Inventory, claims: Any, store: ClaimStore,
                 toolkit: ToolkitSpecs | None = None) -> None:
        self.settings = settings
        self.inventory = inventory
        self.claims = claims
        self.store = store
        self.toolkit = toolkit or ToolkitSpecs([settings.static_cdi_dir, settings.cdi_dir],
                                               skip_prefixes=(settings.cdi_vendor,))
        self.records: dict[str, ClaimRecord] = {}
        # metadata dir -> UIDs of the records holding files in it. Two records share one only when a
        # claim was deleted and re-created under the same name before the old one was unprepared.
        self._dir_owners: dict[str, set[str]] = {}
        self._device_claims: dict[str, set[str]] = {}  # device name -> UIDs of claims holding it
        self._claim_locks = KeyedLocks()
        self._device_locks = DeviceLocks()

    # -- kubelet entry points -------------------------------------------------------------------

    async def prepare(self, refs: Iterable[ClaimRef]) -> dict[str, PrepareResult]:
        unique = {ref.uid: ref for ref in refs}
        results = await asyncio.gather(*(self.prepare_claim(ref) for ref in unique.values()))
        return dict(zip(unique, results, strict=True))

    async def unprepare(self, refs: Iterable[ClaimRef]) -> dict[str, str]:
        unique = {ref.uid: ref for ref in refs}
        results = await asyncio.gather(*(self.unprepare_claim(ref) for ref in unique.values()))
        return dict(zip(unique, results, strict=True))

    async def prepare_claim(self, ref: ClaimRef) -> PrepareResult:
        started = time.monotonic()
        try:
            check_claim_ref(ref)
        except InvalidName as exc:
            return self._failed("prepare", ref, str(exc), started)
        try:
            async with self._claim_locks.hold([ref.uid]):
                record = self.records.get(ref.uid)
                if record is not None:
                    if (record.namespace, record.name) != (ref.namespace, ref.name):
                        return self._failed("prepare", ref, f"UID {ref.uid} is prepared for claim "
                                            f"{record.namespace}/{record.name}", started)
                    log.debug("%s already prepared", ref)
                    return PrepareResult(devices=record.devices)
                read = getattr(self.claims, "read", None)
                if read is None:  # the API server: an async GET, then the rest in one hop
                    claim = await self.claims.get(ref.namespace, ref.name)
                    record = await asyncio.to_thread(self._prepare_blocking, ref, lambda _ns, _n: claim)
                else:  # a local source reads in the same worker thread as the side effects
                    record = await asyncio.to_thread(self._prepare_blocking, ref, read)
                self.adopt(record)
        except (ClaimError, ClaimNotFound, ClaimSourceError, InvalidName, PrepareFailed) as exc:
            return self._failed("prepare", ref, str(exc), started)
        except Exception as exc:
            log.exception("prepare of %s failed unexpectedly", ref)
            return self._failed("prepare", ref, f"internal error: {exc!r}", started)
        log.info("prepared %s", ref, extra={
            "claim": f"{ref.namespace}/{ref.name}", "uid": ref.uid,
            "devices": [d["device"] for d in record.devices],
            "ms": round((time.monotonic() - started) * 1000, 2)})
        return PrepareResult(devices=record.devices)

    async def unprepare_claim(self, ref: ClaimRef) -> str:
        started = time.monotonic()
        try:
            check_claim_ref(ref)
        except InvalidName as exc:
            return self._failed("unprepare", ref, str(exc), started).error
        try:
            async with self._claim_locks.hold([ref.uid]):
                record = self.records.get(ref.uid)
                if record is None:
                    log.debug("%s is not prepared: nothing to undo", ref)
                    return ""
                shared = {d for d in record.dirs if self._dir_owners.get(d, set()) - {ref.uid}}
                await asyncio.to_thread(self._undo, record, shared)
                self.forget(ref.uid)
        except Exception as exc:
            log.exception("unprepare of %s failed", ref)
            return self._failed("unprepare", ref, f"internal error: {exc!r}", started).error
        log.info("unprepared %s", ref, extra={
            "claim": f"{ref.namespace}/{ref.name}", "uid": ref.uid,
            "devices": [d["device"] for d in record.devices],
            "ms": round((time.monotonic() - started) * 1000, 2)})
        return ""

    def adopt(self, record: ClaimRecord) -> None:
        self.records[record.uid] = record
        for d in record.dirs:
            self._dir_owners.setdefault(d, set()).add(record.uid)
        for d in record.devices:
            self._device_claims.setdefault(d["device"], set()).add(record.uid)

    def forget(self, uid: str) -> None:
        record = self.records.pop(uid)
        for index, keys in ((self._dir_owners, record.dirs),
                            (self._device_claims, [d["device"] for d in record.devices])):
            for key in keys:
                owners = index.get(key, set())
                owners.discard(uid)
                if not owners:
                    index.pop(key, None)

    async def refresh_devices(self, names: Iterable[str]) -> int:
        """Rewrite the metadata files of prepared claims whose devices changed (a NIC got its IP
        after prepare): atomically, with generation + 1. Returns how many claims were updated."""
        uids = sorted({uid for n in names for uid in self._device_claims.get(n, ())})
        updated = 0
        for uid in uids:
            async with self._claim_locks.hold([uid]):
                record = self.records.get(uid)
                if record is None:
                    continue
                try:
                    new = await asyncio.to_thread(self._refresh, record)
                except Exception:
                    log.exception("refreshing the metadata of claim %s/%s failed", record.namespace, record.name)
                    continue
                if new is not None:
                    self.records[uid] = new
                    updated += 1
                    log.info("metadata of claim %s/%s updated (generation %d)", new.namespace, new.name,
                             new.generation)
        return updated

    def _failed(self, op: str, ref: ClaimRef, why: str, started: float) -> PrepareResult:
        message = f"{ref}: {why}"
        log.warning("%s failed: %s", op, message, extra={
            "claim": f"{ref.namespace}/{ref.name}"[:300], "uid": ref.uid[:80],
            "ms": round((time.monotonic() - started) * 1000, 2)})
        return PrepareResult(error=message)

    # -- side effects (worker thread) -------------------------------------------------------------

    def plan(self, alloc: Allocation, generation: int = 1) -> ClaimRecord:
        """Every file of the prepared claim with its content, and the kubelet response. No I/O
        except the toolkit lookup."""
        s = self.settings
        ref = alloc.ref
        vendor = s.cdi_vendor
        files: list[FileRecord] = []
        spec = cdispecs.claim_spec(vendor, ref.uid, alloc.devices, alloc.config_env)
        files.append(FileRecord(str(s.cdi_dir / cdispecs.claim_spec_name(vendor, ref.uid)), encode_spec(spec)))
        devices: list[dict[str, Any]] = []
        first_of_request: set[str] = set()
        for a in alloc.devices:
            ids = [cdispecs.claim_device_id(vendor, ref.uid, a.device.name)]
            if a.device.kind == "gpu" and (tk := self.toolkit.device_id(a.device.node.gpu_uuid,
                                                                        a.device.node.gpu_index)):
                ids.append(tk)
            base = base_request(a.request)
            if base not in first_of_request:
                first_of_request.add(base)
                ids.append(cdispecs.metadata_device_id(vendor, ref.uid, base))
            entry: dict[str, Any] = {"request": a.request, "pool": a.pool, "device": a.device.name,
                                     "cdiDeviceIds": ids}
            if a.share_id:
                entry["shareId"] = a.share_id
            devices.append(entry)
        for base, allocs in metadata.group_by_base_request(alloc.devices).items():
            host = metadata.host_file(s.metadata_dir, ref.namespace, ref.name, base)
            content = metadata.render(driver=s.driver_name, namespace=ref.namespace, name=ref.name,
                                      uid=ref.uid, pod_claim_name=alloc.pod_claim_name,
                                      generation=generation, devices=allocs)
            files.append(FileRecord(str(host), content))
            container = metadata.container_file(s.driver_name, ref.name, base, alloc.pod_claim_name)
            mspec = cdispecs.metadata_spec(vendor, ref.uid, base, str(host), container)
            files.append(FileRecord(str(s.cdi_dir / cdispecs.metadata_spec_name(vendor, ref.uid, base)),
                                    encode_spec(mspec)))
        dirs = [str(metadata.host_dir(s.metadata_dir, ref.namespace, ref.name))] if alloc.devices else []
        return ClaimRecord(uid=ref.uid, namespace=ref.namespace, name=ref.name,
                           pod_claim_name=alloc.pod_claim_name, devices=devices, files=files, dirs=dirs,
                           prepared_at=time.time(), generation=generation)

    def _prepare_blocking(self, ref: ClaimRef, read: Callable[[str, str], Mapping[str, Any]]) -> ClaimRecord:
        claim = read(ref.namespace, ref.name)
        alloc = parse_claim(claim, ref, driver=self.settings.driver_name, pool=self.settings.node_name,
                            lookup=self.inventory.get)
        with self._device_locks.hold(a.device.name for a in alloc.devices):
            return self._apply(alloc)

    def _apply(self, alloc: Allocation) -> ClaimRecord:
        for a in alloc.devices:
            for node in a.device.node.device_nodes:
                if not os.path.exists(node.host_path):
                    raise PrepareFailed(f"device {a.device.name}: device node {node.path} is missing "
                                        f"on the host ({node.host_path})")
        record = self.plan(alloc)
        written: list[Path] = []
        created_dirs = [Path(d) for d in record.dirs if not os.path.isdir(d)]
        try:
            for f in record.files:
                path = Path(f.path)
                makedirs(path.parent)
                atomic_write(path, f.content, f.mode)
                written.append(path)
                failpoints.hit(_step(path, self.settings))
            self.store.write(record)
        except BaseException:
            for path in reversed(written):
                unlink_quiet(path)
            for d in created_dirs:
                shutil.rmtree(d, ignore_errors=True)
            raise
        failpoints.hit("after-record")
        return record

    def _refresh(self, record: ClaimRecord) -> ClaimRecord | None:
        allocated = []
        for d in record.devices:
            device = self.inventory.get(d["device"])
            if device is None:
                return None  # gone: health reports it; the file keeps the last known truth
            allocated.append(metadata.AllocatedDevice(d["request"], d["pool"], device, d.get("shareId", "")))
        s = self.settings
        common = {"driver": s.driver_name, "namespace": record.namespace, "name": record.name, "uid": record.uid,
                  "pod_claim_name": record.pod_claim_name}
        contents = {}
        for base, allocs in metadata.group_by_base_request(allocated).items():
            path = str(metadata.host_file(s.metadata_dir, record.namespace, record.name, base))
            contents[path] = allocs
        current = {f.path: f.content for f in record.files}
        if all(current.get(path) == metadata.render(generation=record.generation, devices=allocs, **common)
               for path, allocs in contents.items()):
            return None
        generation = record.generation + 1
        files = [FileRecord(f.path, metadata.render(generation=generation, devices=contents[f.path], **common),
                            f.mode) if f.path in contents else f for f in record.files]
        new = dataclasses.replace(record, files=files, generation=generation)
        for f in files:
            if f.path in contents:
                atomic_write(Path(f.path), f.content, f.mode)
        self.store.write(new)
        return new

    def _undo(self, record: ClaimRecord, shared_dirs: set[str]) -> None:
        with self._device_locks.hold(d["device"] for d in record.devices):
            self._undo_locked(record, shared_dirs)

    def _undo_locked(self, record: ClaimRecord, shared_dirs: set[str]) -> None:
        # Reverse order of prepare: the record goes first, so a crash from here on leaves only
        # files no record owns, which the next start removes.
        self.store.delete(record.uid)
        for f in reversed(record.files):
            if not any(f.path.startswith(d + os.sep) for d in shared_dirs):
                unlink_quiet(Path(f.path))
        for d in record.dirs:
            if d not in shared_dirs:
                shutil.rmtree(d, ignore_errors=True)


class PrepareFailed(RuntimeError):
    pass


def _step(path: Path, settings: Settings) -> str:
    if path.parent == settings.cdi_dir:
        return "after-metadata-spec" if f"_{cdispecs.METADATA_CLASS}_" in path.name else "after-claim-spec"
    return "after-metadata-file"

"""The prepare/unprepare engine: claim -> devices -> CDI specs + metadata files -> durable record.

Every operation on a claim runs whole in one worker thread, holding the claim's
locks (`agent.locks`: this process, then every agent on the node) and then its
devices' locks. The thread also updates the engine's bookkeeping before it
lets go of the locks, so a kubelet call cancelled at its deadline cannot lose
track of a claim: the thread finishes, and the next call for that claim waits
for it and sees its result.

The durable record (`agent.state`) is the truth. The engine keeps a copy of
each record with the identity of its file, and re-reads the file whenever it
changed: a second agent sharing the state directory during a rolling update
may have prepared or unprepared the claim meanwhile.

Order of side effects, so that a crash at any point leaves all or nothing
(start-up recovery, `agent.recovery`, finishes the job):
- prepare: claim files (UID-named) -> record (fsync'd). Without the record the
  files are orphans that recovery removes.
- unprepare: record removed (fsync'd) -> files. Without the record, the rest are orphans.
- metadata refresh: new record (fsync'd) -> files. Recovery rewrites the files from the record.
- passthrough (VFIO) devices bind PCI functions to vfio-pci: intent record -> each step (recorded
  first) -> files -> final record; unprepare: restore intent -> files -> each restore step -> record
  removed (`agent.vfioprep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent import cdispecs, failpoints, metadata
from agent.allocation import Allocation, parse_claim
from agent.claimbook import ClaimBook
from agent.claims import ClaimSource, LocalClaimSource
from agent.config import Settings
from agent.errors import ClaimFailure
from agent.fsutil import Root, UnsafePath
from agent.inventory import Inventory
from agent.locks import ClaimFileLock, LockTable
from agent.metrics import Metrics
from agent.names import ClaimRef, InvalidName, base_request, check_claim_ref
from agent.state import ClaimRecord, ClaimStore, DeviceBinding, FileRecord, PreparedDevice, RecordError, RecordState
from agent.toolkit import ToolkitSpecs
from agent.vfio.errors import VfioError
from agent.vfio.host import VfioHost
from agent.vfioprep import Passthrough, lock_key
from cdi.store import encode_spec

log = logging.getLogger(__name__)


# The kinds of device the engine knows how to prepare; any other kind is refused, never half-prepared.
PREPARABLE_KINDS = ("gpu", "nic", "cpu", "memory", "vfio")


class PrepareFailed(ClaimFailure):
    """The claim is valid but this node cannot prepare it now (a device node missing, ...)."""


@dataclass(slots=True)
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


ClaimReader = Callable[[str, str], Mapping[str, Any]]


class ClaimListener(Protocol):
    """Told, on the event loop, after a claim operation has succeeded (the record is durable).
    Listeners must not block or raise: they queue their own work (the claim status writer)."""

    def claim_prepared(self, record: ClaimRecord) -> None: ...

    def claim_unprepared(self, record: ClaimRecord) -> None: ...

    def claim_refreshed(self, record: ClaimRecord) -> None: ...


class PrepareEngine:
    def __init__(self, settings: Settings, inventory: Inventory, claims: ClaimSource, store: ClaimStore,
                 toolkit: ToolkitSpecs | None = None, claim_lock: ClaimFileLock | None = None,
                 metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics(process=False)
        self.inventory = inventory
        self.claims = claims
        self.store = store
        self.toolkit = toolkit or ToolkitSpecs([settings.static_cdi_dir, settings.cdi_dir],
                                               skip_prefixes=(settings.cdi_vendor,))
        self.cdi_root = Root(settings.cdi_dir)
        self.metadata_root = Root(settings.metadata_dir)
        self.locks = LockTable()
        self.claim_lock = claim_lock or ClaimFileLock(settings.state_dir / "claims.lock")
        self.claim_lock.open()  # now, so a prepare that fails leaves no trace of the first use
        self.book = ClaimBook(store)
        self.passthrough = Passthrough(VfioHost.of(settings), inventory, self.book)
        self.quarantined: list[str] = []  # unreadable records set aside (`*.corrupt`), for reports
        self.listeners: list[ClaimListener] = []
        # `isinstance` against a runtime-checkable Protocol costs tens of microseconds: it is
        # answered once per claim source (tests and tools may swap the source).
        self._checked_source: ClaimSource | None = None
        self._local_read: ClaimReader | None = None
        # Records listed at start-up but not yet checked (`agent.recovery`): any operation on one of
        # these claims runs the check first, under the claim's lock, and never serves the record unchecked.
        self._unverified: set[str] = set()
        self._check: Callable[[str], None] | None = None

    @property
    def records(self) -> dict[str, ClaimRecord]:
        """The prepared claims this agent knows of (a copy)."""
        return self.book.records()

    # -- kubelet entry points -------------------------------------------------------------------

    async def prepare(self, refs: Iterable[ClaimRef]) -> dict[str, PrepareResult]:
        unique = {ref.uid: ref for ref in refs}
        if len(unique) == 1:  # the kubelet's usual call: no task per claim
            ((uid, ref),) = unique.items()
            return {uid: await self.prepare_claim(ref)}
        results = await asyncio.gather(*(self.prepare_claim(ref) for ref in unique.values()))
        return dict(zip(unique, results, strict=True))

    async def unprepare(self, refs: Iterable[ClaimRef]) -> dict[str, str]:
        unique = {ref.uid: ref for ref in refs}
        if len(unique) == 1:
            ((uid, ref),) = unique.items()
            return {uid: await self.unprepare_claim(ref)}
        results = await asyncio.gather(*(self.unprepare_claim(ref) for ref in unique.values()))
        return dict(zip(unique, results, strict=True))

    def _local_reader(self) -> ClaimReader | None:
        """The claim source's blocking `read` when it reads local files, else None."""
        source = self.claims
        if source is not self._checked_source:
            self._checked_source = source
            self._local_read = source.read if isinstance(source, LocalClaimSource) else None
        return self._local_read

    async def prepare_claim(self, ref: ClaimRef) -> PrepareResult:
        with self.metrics.claim_operation("prepare") as op:
            result = await self._prepare_claim(ref)
            op.failed = bool(result.error)
        return result

    async def _prepare_claim(self, ref: ClaimRef) -> PrepareResult:
        started = time.monotonic()
        try:
            check_claim_ref(ref)
            if (read := self._local_reader()) is not None:
                # A local source is read in the same worker thread as the side effects.
                record = await asyncio.to_thread(self._prepare_blocking, ref, read)
                assert record is not None  # with a reader, _prepare_blocking prepares or raises
            else:
                record = await self._prepare_remote(ref, self.claims)
        except (ClaimFailure, InvalidName, UnsafePath) as exc:
            return self._failed("prepare", ref, str(exc), started)
        except Exception as exc:
            log.exception("prepare of %s failed unexpectedly", ref)
            return self._failed("prepare", ref, f"internal error: {exc!r}", started)
        log.info("prepared %s", ref, extra={
            "claim": f"{ref.namespace}/{ref.name}", "uid": ref.uid,
            "devices": [d.device for d in record.devices],
            "ms": round((time.monotonic() - started) * 1000, 2)})
        self._tell(lambda listener: listener.claim_prepared(record), record)
        return PrepareResult(devices=record.devices)

    async def _prepare_remote(self, ref: ClaimRef, source: ClaimSource) -> ClaimRecord:
        # A prepared claim (by this agent or another one on the node) is answered from its record,
        # without asking the API server, which may no longer have it.
        record = await asyncio.to_thread(self._prepare_blocking, ref, None)
        if record is not None:
            return record
        claim = await source.get(ref.namespace, ref.name)
        record = await asyncio.to_thread(self._prepare_blocking, ref, lambda _ns, _n: claim)
        assert record is not None
        return record

    async def unprepare_claim(self, ref: ClaimRef) -> str:
        with self.metrics.claim_operation("unprepare") as op:
            error = await self._unprepare_claim(ref)
            op.failed = bool(error)
        return error

    async def _unprepare_claim(self, ref: ClaimRef) -> str:
        started = time.monotonic()
        try:
            check_claim_ref(ref)
            record = await asyncio.to_thread(self._unprepare_blocking, ref)
        except (ClaimFailure, InvalidName, UnsafePath) as exc:
            return self._failed("unprepare", ref, str(exc), started).error
        except Exception as exc:
            log.exception("unprepare of %s failed", ref)
            return self._failed("unprepare", ref, f"internal error: {exc!r}", started).error
        if record is None:
            log.debug("%s is not prepared: nothing to undo", ref)
            return ""
        log.info("unprepared %s", ref, extra={
            "claim": f"{ref.namespace}/{ref.name}", "uid": ref.uid,
            "devices": [d.device for d in record.devices],
            "ms": round((time.monotonic() - started) * 1000, 2)})
        self._tell(lambda listener: listener.claim_unprepared(record), record)
        return ""

    async def refresh_devices(self, names: Iterable[str]) -> int:
        """Rewrite the metadata files of prepared claims whose devices changed (a NIC got its IP
        after prepare): record first, then the files, with generation + 1. Returns how many
        claims were updated."""
        return await self.refresh_claims(self.book.claims_holding(set(names)))

    async def refresh_claims(self, uids: Iterable[str]) -> int:
        updated = 0
        for uid in uids:
            try:
                new = await asyncio.to_thread(self._refresh_blocking, uid)
            except Exception:
                log.exception("refreshing the metadata of claim %s failed", uid)
                continue
            if new is not None:
                updated += 1
                self._tell_refreshed(new)
                log.info("metadata of claim %s/%s updated (generation %d)", new.namespace, new.name,
                         new.generation)
        return updated

    def _tell_refreshed(self, record: ClaimRecord) -> None:
        self._tell(lambda listener: listener.claim_refreshed(record), record)

    def _tell(self, call: Callable[[ClaimListener], None], record: ClaimRecord) -> None:
        for listener in self.listeners:
            try:
                call(listener)
            except Exception:
                log.exception("a claim listener failed on claim %s/%s", record.namespace, record.name)

    def _failed(self, op: str, ref: ClaimRef, why: str, started: float) -> PrepareResult:
        message = f"{ref}: {why}"
        log.warning("%s failed: %s", op, message, extra={
            "claim": f"{ref.namespace}/{ref.name}"[:300], "uid": ref.uid[:80],
            "ms": round((time.monotonic() - started) * 1000, 2)})
        return PrepareResult(error=message)

    # -- bookkeeping (worker threads, under the claim's locks) ------------------------------------

    @contextlib.contextmanager
    def claim_locked(self, uid: str) -> Iterator[None]:
        """Hold the claim's lock in this process and across the agents of the node."""
        with self.locks.hold([f"claim/{uid}"]), self.claim_lock.hold(uid):
            yield

    def defer_checks(self, uids: Iterable[str], check: Callable[[str], None]) -> None:
        """Claims whose records must pass `check` (called with the claim locked) before any operation
        on them: start-up recovery lists the records at once and checks them in the background."""
        self._check = check
        self._unverified.update(uids)

    def unverified(self) -> list[str]:
        return sorted(self._unverified)

    def ensure_checked(self, uid: str) -> None:
        """Run the deferred start-up check of the claim, if it is still due (call with the claim locked:
        the claim's lock makes the check run once)."""
        if uid in self._unverified:
            assert self._check is not None
            self._check(uid)
            self._unverified.discard(uid)

    def root_of(self, path: str) -> Root:
        for root in (self.cdi_root, self.metadata_root):
            if root.contains(path):
                return root
        raise UnsafePath(0, f"{path} lies outside the agent's CDI and metadata directories")

    # -- side effects (worker thread) -------------------------------------------------------------

    def plan(self, alloc: Allocation, generation: int = 1,
             bindings: list[DeviceBinding] | None = None) -> ClaimRecord:
        """Every file of the prepared claim with its content, and the kubelet response. No I/O
        except the toolkit lookup. Passthrough devices must be bound already (`bindings`), their
        VFIO nodes in their facts (`Passthrough.bound_devices`)."""
        s = self.settings
        ref = alloc.ref
        if unbound := {a.device.name for a in alloc.devices if a.device.kind == "vfio"} - \
                {b.device for b in bindings or ()}:
            raise PrepareFailed(f"passthrough device(s) {', '.join(sorted(unbound))} are not bound to vfio-pci")
        vendor = s.cdi_vendor
        files: list[FileRecord] = []
        spec = cdispecs.claim_spec(vendor, ref.uid, alloc.devices, alloc.config_env)
        files.append(FileRecord(str(s.cdi_dir / cdispecs.claim_spec_name(vendor, ref.uid)), encode_spec(spec)))
        devices: list[PreparedDevice] = []
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
            devices.append(PreparedDevice(request=a.request, pool=a.pool, device=a.device.name,
                                          cdi_device_ids=tuple(ids), share_id=a.share_id))
        for base, allocs in metadata.group_by_base_request(alloc.devices).items():
            host = metadata.host_file(s.metadata_dir, ref.uid, base)
            content = metadata.render(driver=s.driver_name, namespace=ref.namespace, name=ref.name,
                                      uid=ref.uid, pod_claim_name=alloc.pod_claim_name,
                                      generation=generation, devices=allocs)
            files.append(FileRecord(str(host), content))
            container = metadata.container_file(s.driver_name, ref.name, base, alloc.pod_claim_name)
            mspec = cdispecs.metadata_spec(vendor, ref.uid, base, str(host), container)
            files.append(FileRecord(str(s.cdi_dir / cdispecs.metadata_spec_name(vendor, ref.uid, base)),
                                    encode_spec(mspec)))
        dirs = [str(metadata.host_dir(s.metadata_dir, ref.uid))] if alloc.devices else []
        return ClaimRecord(uid=ref.uid, namespace=ref.namespace, name=ref.name,
                           pod_claim_name=alloc.pod_claim_name, devices=devices, files=files, dirs=dirs,
                           prepared_at=time.time(), generation=generation, bindings=list(bindings or ()))

    def _prepare_blocking(self, ref: ClaimRef, read: ClaimReader | None) -> ClaimRecord | None:
        """Prepare the claim unless it is prepared; with `read` None, only look it up."""
        with self.claim_locked(ref.uid):
            self.ensure_checked(ref.uid)
            record = self.current_or_purge(ref.uid)
            if record is not None and (record.namespace, record.name) != (ref.namespace, ref.name):
                raise PrepareFailed(f"UID {ref.uid} is prepared for claim {record.namespace}/{record.name}")
            if record is not None and not record.prepared:
                # A prepare or unprepare of passthrough devices that stopped halfway: settle it first.
                with self.locks.hold(self.passthrough.record_lock_keys(record)):
                    self.settle(record)
                record = None
            if record is not None:
                log.debug("%s already prepared", ref)
                return record
            if read is None:
                return None
            claim = read(ref.namespace, ref.name)
            alloc = parse_claim(claim, ref, driver=self.settings.driver_name, pool=self.settings.node_name,
                                lookup=self.inventory.get)
            with self.locks.hold(lock_key(a.device) for a in alloc.devices):
                return self._apply(alloc)

    def current_or_purge(self, uid: str) -> ClaimRecord | None:
        """The current record; an unreadable one is set aside and the claim's files removed, so the
        claim is cleanly not prepared (its UID names every file, so nothing else is touched)."""
        try:
            return self.book.current(uid)
        except RecordError as exc:
            log.error("claim record of %s is unreadable (%s): setting it aside, removing its files", uid, exc)
            self.book.forget(uid)
            self.quarantined.append(str(self.store.quarantine(self.store.path(uid).name)))
            self.remove_claim_files(uid)
            return None

    def _apply(self, alloc: Allocation) -> ClaimRecord:
        if unknown := sorted(a.device.name for a in alloc.devices if a.device.kind not in PREPARABLE_KINDS):
            # Published ahead of their prepare path (MIG partitions): refused before any side effect.
            raise PrepareFailed(f"device(s) {', '.join(unknown)} cannot be prepared by this agent version yet "
                                f"(it prepares {', '.join(PREPARABLE_KINDS)} devices)")
        self.passthrough.check_forms(alloc.ref.uid, alloc.devices)
        for a in alloc.devices:
            for node in a.device.node.device_nodes:
                if not os.path.exists(node.host_path):
                    raise PrepareFailed(f"device {a.device.name}: device node {node.path} is missing "
                                        f"on the host ({node.host_path})")
        bindings = self.passthrough.plan(alloc)
        if not bindings:
            record = self.plan(alloc)
        else:
            # The intent first: from here on a crash leaves a record that recovery rolls back.
            ref = alloc.ref
            intent = ClaimRecord(uid=ref.uid, namespace=ref.namespace, name=ref.name,
                                 pod_claim_name=alloc.pod_claim_name, prepared_at=time.time(),
                                 devices=[PreparedDevice(a.request, a.pool, a.device.name, ()) for a in alloc.devices],
                                 state=RecordState.BINDING, bindings=bindings)
            self.book.write(intent)
            failpoints.hit("after-bind-intent")
            try:
                bound = self.passthrough.bind(intent, self.book.write)
                devices = self.passthrough.bound_devices(alloc.devices, bound.bindings)
                alloc = dataclasses.replace(alloc, devices=devices)
                record = self.plan(alloc, bindings=bound.bindings)
            except BaseException:
                self._unbind_after_failure(intent)
                raise
        try:
            for f in record.files:
                self.root_of(f.path).write(f.path, f.content, f.mode)
                failpoints.hit(_step(f.path, self.settings))
            self.book.write(record)
        except BaseException:
            if record.bindings:
                self._unbind_after_failure(dataclasses.replace(record, state=RecordState.BINDING, files=[], dirs=[]))
            else:
                self._roll_back(record)
            raise
        failpoints.hit("after-record")
        return record

    def _unbind_after_failure(self, intent: ClaimRecord) -> None:
        """A prepare with bindings failed: put the functions back, then drop the record (its files are
        removed by the caller or were never written). When the functions cannot be put back, the
        `binding` record stays, and the next prepare, unprepare or start rolls it back again."""
        try:
            self.book.write(intent)  # the disk says `binding` (not `prepared`) while this runs
            self.remove_claim_files(intent.uid)
            self.passthrough.restore(intent, None)
        except (VfioError, OSError) as exc:
            log.error("claim %s/%s: could not put its PCI functions back after a failed prepare (%s); its record "
                      "stays in state binding, to be rolled back by the next operation or start",
                      intent.namespace, intent.name, exc)
            return
        with contextlib.suppress(OSError):
            self.store.delete(intent.uid)
        self.book.forget(intent.uid)

    def settle(self, record: ClaimRecord) -> None:
        """Finish a passthrough prepare or unprepare that stopped halfway (call with the claim's locks and
        its devices' locks): `binding` is rolled back, `restoring` finished; the claim's files and record
        go. Raises (record kept) when a function cannot be put back now."""
        self.remove_claim_files(record.uid)
        if record.state is RecordState.BINDING:
            self.passthrough.restore(record, None)
        else:
            self.passthrough.restore(record, self.book.write)
        self.store.delete(record.uid)
        self.book.forget(record.uid)
        log.info("claim %s/%s: %s settled: its PCI functions are back on their drivers", record.namespace,
                 record.name, "an interrupted prepare" if record.state is RecordState.BINDING else
                 "an interrupted unprepare")

    def _roll_back(self, record: ClaimRecord) -> None:
        # The record may be in place already (renamed, then its directory's fsync failed): the
        # prepare is reported as failed, so no record may say otherwise.
        with contextlib.suppress(OSError):
            self.store.delete(record.uid)
        self.book.forget(record.uid)
        for f in reversed(record.files):
            with contextlib.suppress(OSError):
                self.root_of(f.path).unlink(f.path)
        for d in record.dirs:
            with contextlib.suppress(OSError):
                self.metadata_root.remove_tree(d)

    def _unprepare_blocking(self, ref: ClaimRef) -> ClaimRecord | None:
        with self.claim_locked(ref.uid):
            self.ensure_checked(ref.uid)
            record = self.current_or_purge(ref.uid)
            if record is None:
                return None
            with self.locks.hold(self.passthrough.record_lock_keys(record)):
                if not record.prepared:
                    self.settle(record)
                    return record
                if record.bindings:
                    self._unprepare_bound(record)
                    return record
                # The record goes first: a crash from here on leaves only files that no record
                # owns, which the next start removes.
                self.store.delete(record.uid)
                self.book.forget(record.uid)
                failpoints.hit("unprepare-after-record")
                self.remove_files(record)
            return record

    def _unprepare_bound(self, record: ClaimRecord) -> None:
        # The restore intent first (no files: from here on they are orphans the next start removes),
        # then the files, then each function back on its driver, each step recorded first.
        restoring = dataclasses.replace(record, state=RecordState.RESTORING, files=[], dirs=[],
                                        bindings=[dataclasses.replace(b, step=0) for b in record.bindings])
        self.book.write(restoring)
        failpoints.hit("unprepare-after-restore-intent")
        self.remove_files(record)
        self.passthrough.restore(restoring, self.book.write)
        self.store.delete(record.uid)
        self.book.forget(record.uid)
        failpoints.hit("unprepare-after-record")

    def remove_files(self, record: ClaimRecord) -> None:
        for f in reversed(record.files):
            try:
                self.root_of(f.path).unlink(f.path)
            except UnsafePath as exc:
                log.error("claim %s: not removing %s: %s", record.uid, f.path, exc)
            failpoints.hit("unprepare-after-file")
        for d in record.dirs:
            try:
                self.metadata_root.remove_tree(d)
            except UnsafePath as exc:
                log.error("claim %s: not removing %s: %s", record.uid, d, exc)

    def remove_claim_files(self, uid: str) -> list[str]:
        """Every agent-owned file named by this UID (call with the claim locked)."""
        removed = []
        for name in self.cdi_root.listdir():
            if cdispecs.claim_uid_of_spec(name, self.settings.cdi_vendor) == uid and self.cdi_root.unlink(
                    self.cdi_root.path / name):
                removed.append(str(self.cdi_root.path / name))
        path = metadata.host_dir(self.settings.metadata_dir, uid)
        if self.metadata_root.remove_tree(path):
            removed.append(str(path))
        return removed

    def _refresh_blocking(self, uid: str) -> ClaimRecord | None:
        with self.claim_locked(uid):
            self.ensure_checked(uid)
            record = self.current_or_purge(uid)
            if record is None or not record.prepared:
                return None
            return self._refresh(record)

    def _refresh(self, record: ClaimRecord) -> ClaimRecord | None:
        allocated = []
        macs = {b.device: b.mac for b in record.bindings}
        for d in record.devices:
            device = self.inventory.get(d.device)
            if device is None:
                return None  # gone: health reports it; the file keeps the last known truth
            allocated.append(metadata.AllocatedDevice(d.request, d.pool, device, d.share_id, macs.get(d.device, "")))
        s = self.settings
        common: dict[str, Any] = {"driver": s.driver_name, "namespace": record.namespace, "name": record.name,
                                  "uid": record.uid, "pod_claim_name": record.pod_claim_name}
        contents = {str(metadata.host_file(s.metadata_dir, record.uid, base)): allocs
                    for base, allocs in metadata.group_by_base_request(allocated).items()}
        current = {f.path: f.content for f in record.files}
        if all(current.get(path) == metadata.render(generation=record.generation, devices=allocs, **common)
               for path, allocs in contents.items()):
            return None
        generation = record.generation + 1
        files = [FileRecord(f.path, metadata.render(generation=generation, devices=contents[f.path], **common),
                            f.mode) if f.path in contents else f for f in record.files]
        new = dataclasses.replace(record, files=files, generation=generation)
        self.book.write(new)
        failpoints.hit("refresh-after-record")
        for f in files:
            if f.path in contents:
                self.metadata_root.write(f.path, f.content, f.mode)
                failpoints.hit("refresh-after-metadata-file")
        return new


def _step(path: str, settings: Settings) -> str:
    if path.startswith(str(settings.cdi_dir) + os.sep):
        return "after-metadata-spec" if f"_{cdispecs.METADATA_CLASS}_" in path else "after-claim-spec"
    return "after-metadata-file"

"""The prepare/unprepare engine: claim -> devices -> CDI specs + metadata files -> durable record.

Every operation on a claim runs whole in one worker thread, holding the claim's
locks (`agent.claims.locks`: this process, then every agent on the node) and then its
devices' locks. The thread also updates the engine's bookkeeping before it
lets go of the locks, so a kubelet call cancelled at its deadline cannot lose
track of a claim: the thread finishes, and the next call for that claim waits
for it and sees its result.

The durable record (`agent.claims.records`) is the truth. The engine keeps a copy of
each record with the identity of its file, and re-reads the file whenever it
changed: a second agent sharing the state directory during a rolling update
may have prepared or unprepared the claim meanwhile.

This module holds the engine's entry points (the kubelet's calls, metadata refreshes), its
bookkeeping and what it is put together from. The operations themselves, and the order of their
side effects that makes a crash at any point leave all or nothing, are in `agent.engine.claimops`
(prepare, unprepare) and `agent.engine.metarefresh` (metadata refresh: new record, fsync'd, then
the files).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol, TypeVar

from agent.claims.book import ClaimBook, ClaimSummary
from agent.claims.files import ClaimFiles
from agent.claims.leftovers import Leftovers, leftovers_dir
from agent.claims.locks import CLAIMS_LOCK_FILE, DEVICES_LOCK_FILE, ClaimFileLock, KeyFileLock, LockTable
from agent.claims.recordcheck import RecordCheck
from agent.claims.records import ClaimRecord, PreparedDevice, RecordError
from agent.claims.sources import ClaimSource, LocalClaimSource
from agent.claims.store import ClaimStore
from agent.claims.toolkit import ToolkitSpecs
from agent.claims.writers import WRITERS_LOCK_FILE, RecordWriters
from agent.config import Settings
from agent.engine.claimops import ClaimReader, Prepared, prepare_blocking, unprepare_blocking
from agent.engine.deferred import DeferredChecks
from agent.engine.metarefresh import refresh_blocking
from agent.engine.recheck import recheck
from agent.errors import ClaimFailure
from agent.fsutil import Root, UnsafePath
from agent.host.vfio.host import VfioHost
from agent.host.vfio.sriov import VfLinks
from agent.hostprep.effects import HostEffects
from agent.hostprep.mig import MigPartitioner, nvml_of
from agent.hostprep.migmode import MigModeMarks
from agent.hostprep.vfio import Passthrough
from agent.hostprep.vgpu import VgpuPartitioner
from agent.inventory import Inventory
from agent.metrics import Metrics
from agent.names import ClaimRef, InvalidName, check_claim_ref
from agent.ownchanges import OwnChanges
from agent.workslots import Slots

log = logging.getLogger(__name__)

# Claim operations running Python at once, at most (`agent.workslots`); more wait their turn. A prepare
# is mostly Python (holding the GIL) between a few system calls and an fsync: with every call of a burst
# running in a thread of its own (16 in flight, 16 threads) the threads spend their time handing the GIL
# to each other (the kernel time per claim quadruples, docs/benchmarks.md), where a few threads already
# overlap one claim's fsync with another's planning. An operation that waits on the host (a driver
# letting go of a device) or for another claim's lock holds no slot meanwhile: a slow device never
# delays the other claims.
CLAIM_WORKERS = 4
# Threads of claim operations, at most. A thread is made only for an operation given a slot, and stays
# its thread while it waits (on the host, for a lock, for a slot back): so there are about as many as run
# and wait at once, and this bound, far above that, only keeps a flood of calls from making a thread each.
# Their own pool, so that claims waiting on slow devices never take the threads the rest of the agent
# runs its blocking work in (the loop's default executor), nor the other way round.
CLAIM_THREADS = 256

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _log_later(message: str, ref: ClaimRef, extra: dict[str, object]) -> None:
    """The line of a claim operation, logged once the loop is back from answering the kubelet (its
    formatting and write are no part of the answer's way out)."""
    asyncio.get_running_loop().call_soon(functools.partial(log.info, message, ref, extra=extra))


@dataclass(slots=True)
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A claim record set aside (`set_aside`): unreadable, refused (it says what this agent never writes), or
    its check failed."""

    uid: str
    path: str  # where it lies now (`<uid>.rec.corrupt`)
    reason: str  # why it could not be used


class ClaimListener(Protocol):
    """Told, on the event loop, after a claim operation has succeeded (the record is durable).
    Listeners must not block or raise: they queue their own work (the claim status writer)."""

    def claim_prepared(self, record: ClaimRecord) -> None: ...

    def claim_unprepared(self, record: ClaimRecord) -> None: ...

    def claim_refreshed(self, record: ClaimRecord) -> None: ...


class PrepareEngine:
    def __init__(self, settings: Settings, inventory: Inventory, claims: ClaimSource, store: ClaimStore,
                 toolkit: ToolkitSpecs | None = None, claim_lock: ClaimFileLock | None = None,
                 metrics: Metrics | None = None, *, vf_links: VfLinks) -> None:
        """`vf_links`: the VF settings of passthrough NIC functions, on the host or the simulated machine
        (`agent.app.assembly.vf_links`)."""
        self.settings = settings
        self.metrics = metrics or Metrics(process=False)
        self.inventory = inventory
        self.claims = claims
        self.store = store
        self.toolkit = toolkit or ToolkitSpecs([settings.static_cdi_dir, settings.cdi_dir],
                                               skip_prefixes=(settings.cdi_vendor,))
        self.own_changes = OwnChanges()  # noted by the roots, skipped by self-healing (`agent.ownchanges`)
        self.cdi_root = Root(settings.cdi_dir, own=self.own_changes)
        self.metadata_root = Root(settings.metadata_dir, own=self.own_changes)
        self.files = ClaimFiles(settings, self.cdi_root, self.metadata_root)
        self.locks = LockTable()
        self.claim_lock = claim_lock or ClaimFileLock(settings.state_dir / CLAIMS_LOCK_FILE)
        self.claim_lock.open()  # now, so a prepare that fails leaves no trace of the first use
        self.device_lock = KeyFileLock(settings.state_dir / DEVICES_LOCK_FILE)  # devices, across agents
        self.device_lock.open()
        # This engine writes claim records here: registered, for the book's syncs (`agent.claims.writers`).
        self.writers = RecordWriters(settings.state_dir / WRITERS_LOCK_FILE)
        self.writers.open()
        # Every record read from disk is checked to say only what this agent derives (`agent.claims.recordcheck`).
        self.book = ClaimBook(store, writers=self.writers, check=RecordCheck.of(settings))
        self.passthrough = Passthrough(VfioHost.of(settings), inventory, self.book, links=vf_links,
                                       node_ips=tuple(settings.node_ips))
        # Partitions created at prepare, one partitioner per `Kind.partition_kind` (`agent.hostprep.partitions`).
        # Host changes an unprepare could not undo (`agent.claims.leftovers`): the daemon sets `on_change`.
        self.leftovers = Leftovers(leftovers_dir(settings.state_dir))
        self.effects = HostEffects(self.book, self.passthrough, inventory, [
            MigPartitioner(nvml_of(inventory), self.passthrough.host.boot_id,
                           MigModeMarks(settings.state_dir / "mig-mode")),
            VgpuPartitioner(self.passthrough.host),
        ], self.leftovers)
        self.quarantines: list[Quarantined] = []  # records set aside (`*.corrupt`), for reports
        # Told of each, from the worker thread that set it aside (the daemon: an Event on the Node).
        self.on_quarantine: Callable[[Quarantined], None] | None = None
        self.listeners: list[ClaimListener] = []
        # `isinstance` against a runtime-checkable Protocol costs tens of microseconds: it is
        # answered once per claim source (tests and tools may swap the source).
        self._checked_source: ClaimSource | None = None
        self._local_read: ClaimReader | None = None
        # Records listed at start-up but not yet checked (`agent.engine.recovery`): any operation on one of
        # these claims runs the check first, under the claim's lock, and never serves the record unchecked.
        self.deferred = DeferredChecks()
        self.slots = Slots(CLAIM_WORKERS)
        # Made at the first operation: an engine that never runs one (a CLI's) starts no thread.
        self._threads: ThreadPoolExecutor | None = None

    @property
    def quarantined(self) -> list[str]:
        """Where the records set aside since the start lie."""
        return [q.path for q in self.quarantines]

    @property
    def records(self) -> dict[str, ClaimSummary]:
        """The prepared claims this agent knows of (a copy; the whole records are in their files)."""
        return self.book.records()

    def whole_record(self, uid: str) -> ClaimRecord | None:
        """The claim's whole record (its files' contents, its bindings), read from its file: for tools,
        reports and tests. An operation reads it under the claim's lock (`book.current`)."""
        found = self.store.read(uid)
        return found[0] if found is not None else None

    # -- kubelet entry points -------------------------------------------------------------------

    async def _in_worker(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`fn` (a blocking claim operation) in a thread of the claims' pool once it has one of the
        CLAIM_WORKERS slots, which it lets go while it waits (`agent.workslots`). A call cancelled before its
        thread began drops it; one cancelled later leaves the thread to finish, holding its slot until then."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(CLAIM_THREADS, thread_name_prefix="dra-claim")
        slots = self.slots
        await slots.acquire()
        try:
            work = self._threads.submit(slots.holding, functools.partial(fn, *args, **kwargs))
        except BaseException:
            slots.release()
            raise
        try:
            return await asyncio.wrap_future(work)
        finally:
            if work.done():  # (also when cancelled before it began)
                slots.release()
            else:  # the call was cancelled: the slot is given back once the thread is done
                work.add_done_callback(lambda _: slots.release())

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
                done = await self._in_worker(prepare_blocking, self, ref, read)
                assert done is not None  # with a reader, prepare_blocking prepares or raises
            else:
                done = await self._prepare_remote(ref, self.claims)
        except (ClaimFailure, InvalidName, UnsafePath) as exc:
            return self._failed("prepare", ref, str(exc), started)
        except Exception as exc:
            log.exception("prepare of %s failed unexpectedly", ref)
            return self._failed("prepare", ref, f"internal error: {exc!r}", started)
        record = done.record
        if done.fresh:  # an answer from the record of an earlier call says nothing new
            _log_later("prepared %s", ref, {
                "claim": f"{ref.namespace}/{ref.name}", "uid": ref.uid,
                "devices": [d.device for d in record.devices],
                "ms": round((time.monotonic() - started) * 1000, 2)})
        self._tell(lambda listener: listener.claim_prepared(record), record)
        return PrepareResult(devices=record.devices)

    async def prepare_ahead(self, ref: ClaimRef, claim: Mapping[str, Any]) -> PrepareResult:
        """Prepare the claim as it was read (`claim`), before the kubelet asks: its devices carry binding
        conditions and their pod is bound once it is done (`agent.engine.prebind`). The same prepare as the
        kubelet's, its record marked `ahead`; a claim already prepared is answered from its record."""
        started = time.monotonic()
        with self.metrics.claim_operation("prepare") as op:
            try:
                check_claim_ref(ref)
                done = await self._in_worker(prepare_blocking, self, ref, lambda _ns, _n: claim, ahead=True)
                assert done is not None
            except (ClaimFailure, InvalidName, UnsafePath) as exc:
                op.failed = True
                return self._failed("prepare ahead of binding", ref, str(exc), started)
            except Exception as exc:
                op.failed = True
                log.exception("prepare ahead of binding of %s failed unexpectedly", ref)
                return self._failed("prepare ahead of binding", ref, f"internal error: {exc!r}", started)
        record = done.record
        log.log(logging.INFO if done.fresh else logging.DEBUG, "prepared %s ahead of its pod's binding", ref, extra={
            "claim": f"{ref.namespace}/{ref.name}", "uid": ref.uid,
            "devices": [d.device for d in record.devices],
            "ms": round((time.monotonic() - started) * 1000, 2)})
        self._tell(lambda listener: listener.claim_prepared(record), record)
        return PrepareResult(devices=record.devices)

    async def _prepare_remote(self, ref: ClaimRef, source: ClaimSource) -> Prepared:
        # A prepared claim (by this agent or another one on the node) is answered from its record,
        # without asking the API server, which may no longer have it.
        done = await self._in_worker(prepare_blocking, self, ref, None)
        if done is not None:
            return done
        claim = await source.get(ref.namespace, ref.name)
        done = await self._in_worker(prepare_blocking, self, ref, lambda _ns, _n: claim)
        assert done is not None
        return done

    async def unprepare_claim(self, ref: ClaimRef) -> str:
        with self.metrics.claim_operation("unprepare") as op:
            error = await self._unprepare_claim(ref)
            op.failed = bool(error)
        return error

    async def _unprepare_claim(self, ref: ClaimRef) -> str:
        started = time.monotonic()
        try:
            check_claim_ref(ref)
            record = await self._in_worker(unprepare_blocking, self, ref)
        except (ClaimFailure, InvalidName, UnsafePath) as exc:
            return self._failed("unprepare", ref, str(exc), started).error
        except Exception as exc:
            log.exception("unprepare of %s failed", ref)
            return self._failed("unprepare", ref, f"internal error: {exc!r}", started).error
        if record is None:
            log.debug("%s is not prepared: nothing to undo", ref)
            return ""
        _log_later("unprepared %s", ref, {
            "claim": f"{ref.namespace}/{ref.name}", "uid": ref.uid,
            "devices": [d.device for d in record.devices],
            "ms": round((time.monotonic() - started) * 1000, 2)})
        self._tell(lambda listener: listener.claim_unprepared(record), record)
        return ""

    async def refresh_devices(self, names: Iterable[str]) -> int:
        """Rewrite the metadata files of prepared claims whose devices changed (a NIC got its IP
        after prepare): record first, then the files, with generation + 1 (`agent.engine.metarefresh`).
        Returns how many claims were updated."""
        return await self.refresh_claims(self.book.claims_holding(set(names)))

    async def refresh_claims(self, uids: Iterable[str]) -> int:
        updated = 0
        for uid in uids:
            try:
                new = await self._in_worker(refresh_blocking, self, uid)
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

    @contextlib.contextmanager
    def devices_locked(self, keys: Iterable[str], shared: Collection[str] = ()) -> Iterator[None]:
        """Hold the device locks (`pci/<bus>`, `device/<name>`) in this process and across the agents of the
        node, in sorted order, those in `shared` shared (`agent.claims.locks`; call with the claim locked)."""
        ordered = sorted(set(keys))
        with self.locks.hold(ordered, shared=shared), self.device_lock.hold_all(ordered, shared=shared):
            yield

    def defer_checks(self, uids: Iterable[str], check: Callable[[str], None]) -> None:
        """Claims whose records must pass `check` (called with the claim locked) before any operation
        on them: start-up recovery lists the records at once and checks them in the background."""
        self.deferred.defer(uids, check)

    def unverified(self) -> list[str]:
        return self.deferred.unverified()

    def ensure_checked(self, uid: str) -> bool:
        """Run the deferred start-up check of the claim, if it is still due (call with the claim locked:
        the claim's lock makes the check run once); whether it ran now."""
        return self.deferred.ensure_checked(uid)

    def retry_leftovers(self) -> list[str]:
        """Undo again what unprepares left (`agent.claims.leftovers`), each under its devices' locks; the
        claims whose leftovers are undone now. Blocking: at start-up and garbage collection's sweeps."""
        done = []
        for lo in self.leftovers.all():
            with self.devices_locked(lo.locks):
                if self.leftovers.get(lo.uid) == lo and self.effects.retry(lo):
                    done.append(lo.uid)
        return done

    def recheck(self, record: ClaimRecord) -> tuple[ClaimRecord, list[str]] | None:
        """A prepared record checked against the host as it is now, and made true again
        (`agent.engine.recheck`); None when the claim had to be rolled back. Call with the claim locked."""
        return recheck(self, record)

    def close(self) -> None:
        """Let go of the engine's lock files and its registration as a writer of records (a process that
        ends lets go of them all the same)."""
        self.writers.close()
        self.device_lock.close()
        self.claim_lock.close()
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=False)  # each thread ends once its operation has

    def root_of(self, path: str) -> Root:
        return self.files.root_of(path)

    def settle(self, record: ClaimRecord) -> None:
        """Finish a prepare or unprepare with host side effects that stopped halfway (`HostEffects.settle`)."""
        self.effects.settle(record, self.files)

    def current_or_purge(self, uid: str) -> ClaimRecord | None:
        """The current record; one that is unreadable or refused (`agent.claims.recordcheck`) is set aside
        (`set_aside`), so the claim is cleanly not prepared."""
        try:
            return self.book.current(uid)
        except RecordError as exc:
            self.set_aside(uid, str(exc))
            return None

    def set_aside(self, uid: str, reason: str) -> None:
        """The one way a record is set aside (call with the claim locked): renamed `<uid>.rec.corrupt`, kept
        for a person to look at and never read again, the claim's files removed (by its UID, below the
        agent's directories: nothing the record names is trusted), counted, told (`on_quarantine`). Its
        host effects, if it held any, stay as they are: the record that named them is not trusted either."""
        log.error("claim record of %s cannot be used (%s): setting it aside, removing its files", uid, reason)
        self.book.forget(uid)
        try:
            path = str(self.store.quarantine(self.store.path(uid).name))
        except FileNotFoundError:
            return  # removed meanwhile by another agent's operation on the claim: nothing to set aside
        found = Quarantined(uid, path, reason)
        self.quarantines.append(found)
        self.metrics.records_quarantined.inc()
        self.files.remove_claim_files(uid)
        if (tell := self.on_quarantine) is not None:
            try:
                tell(found)
            except Exception:
                log.exception("reporting the record set aside of claim %s failed", uid)

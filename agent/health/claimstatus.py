"""ResourceClaim `status.devices`: what this driver says about each device it prepared for a claim.

`ClaimStatusWriter` is a claim listener of the prepare engine (`PrepareEngine.listeners`).
For each prepared claim it keeps this driver's entries current, one per prepared device
(`driver`, `pool`, `device`, `shareID` when shared):

- a `Ready` condition: True (reason `Prepared`) unless the `DeviceReadiness` given by
  the integrator says otherwise (False with its reason, e.g. `LinkDown`); a device gone
  from the inventory is `Ready` False, `DeviceMissing`. `lastTransitionTime` moves only
  when the status does, also across restarts (`agent.health.readytimes`: the conditions of
  a claim prepared before the start are read back before its first write, and that write is
  left out when the stored entries are what it would send);
- GPUs: `data` {uuid, productName}; a partition made for the claim adds its own identity as its
  metadata file gives it: a MIG device's `uuid` is its own (MIG-...), not its GPU's, a mediated
  device's `mdevUUID` is added;
- NICs: `networkData` {interfaceName, ips (CIDR), hardwareAddress}, and a passthrough VF its
  hardwareAddress (the MAC its claim set, else its own): what its metadata file says
  (`agent.claims.metadata.device_network_data`).

Entries are built from the prepared claim's record, whose devices prepare took from
this very claim's `status.allocation.devices.results` (this driver, this node's pool).
An allocation cannot change once set and every write names the claim's UID, so the
record is the allocation check: nothing else is written. The API rules
(`agent.apirules.clip_device_status`) are applied before each write too: an offending
part is dropped and logged, never sent.

Writes are queued and coalesced per claim (the latest desired state wins) and carried
out in the background, a few at a time, with backoff on failures that heal (5xx,
throttling, no connection: retried until they succeed or a newer state replaces them).
A claim that is gone or was re-created with another UID stops being written, as does
one whose write the API server refuses. Prepare and unprepare never wait for any of it:
the kubelet must not wait on status. Where the writes go is the sink's business
(`agent.health.statussinks`: server-side apply, or a file offline).

Events: `claim_prepared` and `claim_refreshed` (addresses changed: the metadata file got
generation + 1) write the claim's entries; `claim_unprepared` removes ours;
`devices_changed(names)` re-writes every prepared claim holding those devices (the
integrator calls it when readiness changes: a link down or up); `resync(records)` at
start writes every prepared claim (the API may have missed writes while the agent was down).
A resync is fed to the queue a window at a time in the background: with 10,000 prepared
claims, neither the start nor the API server takes them all at once, and a prepare's
write is never stuck behind thousands of old ones.

What a restart asks of the API server does not grow with the claims. The writer knows, for each claim,
what it last wrote (a digest of the entries, `WrittenStatus`) and the Ready transitions those entries
date; an agent that stops in order leaves that for the next start (`written`, kept by
`agent.health.statuswritten` while no other agent could write after it), which hands it back
(`restore_written`) before its resync. A claim whose entries now are the ones written then costs no
request at all; one whose entries changed is written without reading (what the API server holds is
known). Only a claim the last run did not leave (it was killed, it was another agent's, its last write
was in flight when it stopped) is read back first (`StatusSink.read`, a GET of that claim): the agent
never lists claims, since it may read only those it prepared (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from agent import apirules
from agent.claims.book import ClaimBook, ClaimSummary, DeviceSummary
from agent.claims.records import ClaimRecord
from agent.health.bindingstatus import BindingFailure, binding_condition, failure_entries
from agent.health.conditions import Readiness
from agent.health.readytimes import ReadyTransitions, Transition
from agent.health.statusentry import AlwaysReady, DeviceLookup, DeviceReadiness, device_data
from agent.health.statussinks import ClaimGone, StatusSink, StatusWriteFailed, same_entries
from agent.kinds import Kind
from agent.kube import Backoff
from agent.metrics import Metrics
from agent.model import Device
from agent.names import ClaimRef

log = logging.getLogger(__name__)


# What a claim's status is built from: a whole record (from an operation) or the book's summary of one
# (what the writer keeps: `_summary`).
ClaimView = ClaimRecord | ClaimSummary

DEFAULT_CONCURRENCY = 4
RESYNC_WINDOW = 16  # claims a resync keeps queued at most; it feeds more as writes finish


@dataclass(slots=True)
class _Pending:
    target: ClaimRef
    # What to write: the claim's entries, built from this record when the write is started (so the
    # prepare that queued it never waits for them); None removes this driver's entries (or, with
    # `failure`, writes the binding failure instead).
    record: ClaimSummary | None
    failures: int = 0
    due: float = 0.0  # monotonic time before which it is not sent
    failure: BindingFailure | None = None


@dataclass(frozen=True, slots=True)
class WrittenStatus:
    """What this driver's entries of one claim are in the API server, as this agent last wrote (or read) them:
    their digest, and the Ready transitions they date that differ from the prepare's time."""

    digest: str
    kept: tuple[tuple[str, str, Transition], ...]  # (device, share ID, transition)


def digest_of(entries: Sequence[Mapping[str, Any]]) -> str:
    """The same for the same entries, whatever order their keys were built in."""
    return hashlib.sha256(orjson.dumps(list(entries), option=orjson.OPT_SORT_KEYS)).hexdigest()


def _target(record: ClaimView) -> ClaimRef:
    return ClaimRef(record.namespace, record.name, record.uid)


def _summary(record: ClaimView) -> ClaimSummary:
    # A whole record holds its files' contents: a queue of thousands (a resync, a burst of prepares)
    # keeps only the book's summary of each.
    return ClaimSummary.of(record) if isinstance(record, ClaimRecord) else record


@dataclass
class ClaimStatusWriter:
    driver: str
    sink: StatusSink
    inventory: DeviceLookup
    book: ClaimBook  # the engine's, for which claims hold a device
    readiness: DeviceReadiness = field(default_factory=AlwaysReady)
    metrics: Metrics = field(default_factory=lambda: Metrics(process=False))
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.5, maximum=30.0))
    concurrency: int = DEFAULT_CONCURRENCY
    clock: Callable[[], float] = time.monotonic
    transitions: ReadyTransitions = field(default_factory=ReadyTransitions)
    # Devices of these kinds are published with binding conditions (`agent.bindingconditions`): a prepared
    # one's entry says the binding condition is True, so the scheduler binds its pod.
    binding_kinds: frozenset[Kind] = frozenset()

    def __post_init__(self) -> None:
        # Claims whose latest record was told since the start (prepared, refreshed, or re-written for a
        # device change): a start-up resync skips them. The records themselves are the book's.
        self._told: set[str] = set()
        self._pending: dict[str, _Pending] = {}  # waiting to be written (the latest state per claim)
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        # Prepared claims found gone or re-created: a UID never comes back, so they are not written again
        # until their unprepare forgets them. Only prepared ones: nothing would forget the others.
        self._gone: set[str] = set()
        # NICs moved into pods, as last seen on the host (device name -> device): their status entries
        # once they have left the host's namespace. A few per node; replaced, never grown, per device.
        self._moved: dict[str, Device] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._worker: asyncio.Task[None] | None = None
        self._resync: asyncio.Task[None] | None = None
        # Per claim UID: the digest of the entries the API server holds, as last written (or read) by this agent
        # or the run before it (`restore_written`); a claim whose state a write in flight leaves unknown has none.
        self._written: dict[str, str] = {}
        self._drained = asyncio.Event()  # the queue is shorter than a resync window
        self._closed = False

    # -- ClaimListener (called on the event loop; never blocks, never raises) ----------------------

    def claim_prepared(self, record: ClaimView) -> None:
        self._told.add(record.uid)
        self._enqueue(record)

    def claim_refreshed(self, record: ClaimView) -> None:
        self.claim_prepared(record)

    def claim_unprepared(self, record: ClaimView) -> None:
        self._told.discard(record.uid)
        self._gone.discard(record.uid)
        self.transitions.forget(_summary(record))
        self._submit(_target(record), None)

    def binding_failed(self, target: ClaimRef, failure: BindingFailure) -> None:
        """The claim could not be prepared for its pod's binding: its entries say the binding failure
        condition is True (the scheduler then gives the allocation up and tries again)."""
        self._told.discard(target.uid)
        self._submit(target, None, failure)

    # -- the integrator's calls ---------------------------------------------------------------------

    def devices_changed(self, names: Iterable[str]) -> int:
        """Re-write the claims holding these devices (their readiness or addresses changed).
        Returns how many claims were queued."""
        queued = 0
        for uid in self.book.claims_holding(set(names)):
            record = self.book.record_of(uid)
            if record is not None:
                self._told.add(uid)
                self._enqueue(record)
                queued += 1
        return queued

    def resync(self, records: Iterable[ClaimView]) -> int:
        """Write the status of every prepared claim (at start), in the background a window at a
        time; how many claims it will write."""
        todo = list(records)
        if todo and not self._closed:
            self._idle.clear()
            self._resync = asyncio.get_running_loop().create_task(self._feed(todo), name="claim-status-resync")
        return len(todo)

    async def _feed(self, records: list[ClaimView]) -> None:
        told = set(self._told)  # prepared or refreshed since: already written fresh
        try:
            for record in records:
                while self.queued >= RESYNC_WINDOW:
                    self._drained.clear()
                    await self._drained.wait()
                if record.uid in told or record.uid in self._told or self.book.record_of(record.uid) is None:
                    continue  # written fresh since, or unprepared meanwhile
                if self._holds_already(_summary(record)):
                    self._count("unchanged")
                else:
                    self.claim_prepared(record)
                await asyncio.sleep(0)  # a long loop on the event loop: let the kubelet in
        finally:
            self._resync = None
            self._update_queue()

    def _holds_already(self, record: ClaimSummary) -> bool:
        """Whether the API server holds the claim's entries as they are now, by what was written (no request)."""
        digest = self._written.get(record.uid)
        if digest is None:
            return False
        try:
            return digest_of(self.entries(record)) == digest
        except Exception:  # built again by the write, which logs it
            return False

    # -- across restarts ------------------------------------------------------------------------------

    def written(self) -> dict[str, WrittenStatus]:
        """Each prepared claim whose entries in the API server this agent knows (after `stop`: none in flight),
        for the next start (`restore_written`)."""
        out = {}
        for uid, digest in self._written.items():
            record = self.book.record_of(uid)
            if record is not None and uid not in self._gone:
                out[uid] = WrittenStatus(digest, self.transitions.kept_of(record))
        return out

    def restore_written(self, known: Mapping[str, WrittenStatus]) -> None:
        """What the run before this one left (`written`): the resync writes those claims only where their
        entries changed, and reads none of them."""
        for uid, status in known.items():
            if uid not in self._written:
                self._written[uid] = status.digest
                self.transitions.restore(uid, status.kept)

    def start(self) -> None:
        if self._worker is None and not self._closed:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="claim-status-writer")

    async def stop(self) -> None:
        """Stop writing; what is queued is dropped (the next start's resync writes it)."""
        self._closed = True
        for uid in self._in_flight:  # sent or not: what the API server holds of these is not known
            self._written.pop(uid, None)
        tasks = [t for t in (self._resync, self._worker, *self._in_flight.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._worker = None
        self._pending.clear()
        self._in_flight.clear()
        self._update_queue()

    async def idle(self) -> None:
        """Until nothing is queued or in flight (for tests and orderly shutdowns)."""
        await self._idle.wait()

    @property
    def queued(self) -> int:
        return len(self._pending.keys() | self._in_flight.keys())

    # -- entries ------------------------------------------------------------------------------------

    def entries(self, claim: ClaimView) -> list[dict[str, Any]]:
        """This driver's entries for the claim, as the API accepts them."""
        record = _summary(claim)
        allocated = {(self.driver, d.pool, d.device, d.share_id) for d in record.devices}
        out = []
        for d in record.devices:
            entry, dropped = apirules.clip_device_status(self._entry(record, d), allocated)
            for why in dropped:
                log.warning("claim %s/%s, device %s: not reporting %s", record.namespace, record.name,
                            d.device, why)
            if entry is not None:
                out.append(entry)
        return out

    def _entry(self, record: ClaimSummary, d: DeviceSummary) -> dict[str, Any]:
        entry: dict[str, Any] = {"driver": self.driver, "pool": d.pool, "device": d.device}
        if d.share_id:
            entry["shareID"] = d.share_id
        device = self.inventory.get(d.device)
        if d.pod_interface and device is not None:
            self._moved[d.device] = device
        if device is None and d.pod_interface:
            # A NIC moved into the pod has left the host's namespace, as it should: reported as last seen.
            device = self._moved.get(d.device)
            ready = Readiness(True, "MovedIntoPod", f"interface {d.pod_interface} in the pod's network namespace")
            if device is None:  # not seen since this agent started: its name in the pod is still known
                entry["networkData"] = {"interfaceName": d.pod_interface}
        elif device is None:
            ready = Readiness(False, "DeviceMissing", f"device {d.device} is no longer found on the node")
        else:
            try:
                ready = self.readiness.readiness(device)
            except Exception as exc:  # a readiness source's bug must not cost the whole status
                log.exception("readiness of %s could not be read", d.device)
                ready = Readiness(False, "ReadinessUnknown", f"readiness could not be read: {exc!r}")
        entry["conditions"] = [self.transitions.condition(record, d, ready)]
        if device is not None and device.kind in self.binding_kinds:
            entry["conditions"].append(binding_condition(record.prepared_at))
        if device is not None:
            # The inventory's device is the published one: a partition made for the claim has its own
            # identity, and a passthrough VF the MAC its claim set.
            entry |= device_data(device, dict(d.made), d.mac, d.pod_interface)
        return entry

    # -- the queue ----------------------------------------------------------------------------------

    def _enqueue(self, record: ClaimView) -> None:
        self._submit(_target(record), _summary(record))

    def _submit(self, target: ClaimRef, record: ClaimSummary | None, failure: BindingFailure | None = None) -> None:
        if self._closed or ((record is not None or failure is not None) and target.uid in self._gone):
            return
        old = self._pending.get(target.uid)
        # A claim in backoff keeps its wait: a newer state does not make the API server answer sooner.
        self._pending[target.uid] = _Pending(target, record, failures=old.failures if old else 0,
                                             due=old.due if old else 0.0, failure=failure)
        self._update_queue()
        self.start()
        self._wake.set()

    def _update_queue(self) -> None:
        n = self.queued
        self.metrics.claim_status_queue.set(n)
        if n < RESYNC_WINDOW:
            self._drained.set()
        if n or self._resync is not None:
            self._idle.clear()
        else:
            self._idle.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            now = self.clock()
            next_due: float | None = None
            for uid, item in list(self._pending.items()):
                if uid in self._in_flight:
                    continue  # one write per claim at a time; this one follows it
                if item.due > now:
                    next_due = item.due if next_due is None else min(next_due, item.due)
                    continue
                if len(self._in_flight) >= self.concurrency:
                    break
                del self._pending[uid]
                # The entries are built here, at once, like an unprepare's clean-up of the claim's
                # transitions: both run on the event loop, so neither sees the other half done. Those of a
                # claim whose stored conditions are to be read first are built by its write, after the read.
                unread = item.record is not None and self.transitions.unread(item.record)
                try:
                    entries = None if unread else self.entries(item.record) if item.record is not None \
                        else failure_entries(self.driver, item.failure) if item.failure is not None else []
                except Exception as exc:
                    log.exception("building the status of %s failed", item.target)
                    self._gave_up(item, repr(exc))
                    self._update_queue()
                    continue
                self._in_flight[uid] = asyncio.create_task(self._write(item, entries), name=f"claim-status-{uid}")
            timeout = None if next_due is None else max(0.0, next_due - self.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    async def _write(self, item: _Pending, entries: list[dict[str, Any]] | None) -> None:
        uid = item.target.uid
        try:
            if entries is None:
                entries = await self._after_reading(item)
                if entries is None:
                    self._count("unchanged")
                    return
            self._written.pop(uid, None)  # until the answer says what the API server holds
            await self.sink.write(item.target, entries)
            if item.record is not None and item.failure is None:
                self._written[uid] = digest_of(entries)
        except ClaimGone as exc:
            if entries is None or entries:
                # Unprepared while this write was in flight (its record is gone from the book), or never
                # prepared (a binding failure): not remembered, as no unprepare is left to forget it.
                if self.book.record_of(uid) is not None:
                    self._gone.add(uid)
                self._gave_up(item, str(exc))
            else:
                self._count("ok")  # nothing of ours can be left on a claim that is gone
        except StatusWriteFailed as exc:
            if exc.retryable:
                self._retry(item, str(exc))
            else:
                self._gave_up(item, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("writing the status of %s failed unexpectedly", item.target)
            self._gave_up(item, repr(exc))
        else:
            self._count("ok")
            log.debug("status of %s written (%d entries)", item.target, len(entries))
        finally:
            self._in_flight.pop(uid, None)
            self._update_queue()
            self._wake.set()

    async def _after_reading(self, item: _Pending) -> list[dict[str, Any]] | None:
        """The entries of a claim prepared before the start, built once the stored ones are read
        (`ReadyTransitions.learn`); None when there is nothing to write: the API server holds them
        already, or the claim was unprepared meanwhile (its removal follows)."""
        record = item.record
        assert record is not None
        try:
            stored = [e for e in await self.sink.read(item.target) if e.get("driver") == self.driver]
        except StatusWriteFailed as exc:
            if exc.retryable or isinstance(exc, ClaimGone):
                raise
            log.warning("status of %s not read back (%s): its conditions are dated anew", item.target, exc)
            stored = []
        if self.book.record_of(record.uid) is None:
            return None
        self.transitions.learn(record, stored)
        entries = self.entries(record)
        if same_entries(entries, stored):
            self._written[record.uid] = digest_of(entries)
            return None
        return entries

    def _retry(self, item: _Pending, why: str) -> None:
        self._count("retry")
        failures = item.failures + 1
        delay = self.backoff.delay(failures)
        log.warning("status of %s not written (%s); retrying in %.1fs", item.target, why, delay)
        newer = self._pending.get(item.target.uid)
        again = newer if newer is not None else item
        again.failures, again.due = failures, self.clock() + delay
        self._pending[item.target.uid] = again

    def _gave_up(self, item: _Pending, why: str) -> None:
        self._count("gave_up")
        log.warning("status of %s not written, not retrying: %s", item.target, why)

    def _count(self, result: str) -> None:
        self.metrics.claim_status_writes.labels(result).inc()

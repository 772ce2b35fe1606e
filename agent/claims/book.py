"""The engine's book of prepared claims: the durable records as they are on disk, read cheaply.

The record files (`agent.claims.records`) are the truth, shared with any other agent on the
node. The book keeps, per claim, a summary of its record (`ClaimSummary`: identity,
devices, directories, generation; not the files' contents) with the identity of its
file (inode, mtime, size), and indexes which claims hold each device, for metadata
refreshes and claim status. A whole record is read from its file when an operation
needs it (`current`); the last records written or read are kept whole, so a prepare
followed by its unprepare, or a kubelet retry, costs one `stat`. Never a stale answer
after another agent prepared, refreshed or unprepared the claim: the file's identity
is compared first. Call it with the claim's locks held (`agent.claims.locks`).

Memory: a summary is a few hundred bytes, where a whole record holds every file's
content (4-5 KiB for a GPU claim): 10,000 prepared claims cost megabytes, not tens. A summary
keeps of each device only what is read from it (pool, device, share ID; not its CDI device IDs),
the strings that repeat across claims (namespace, pool, device names) are interned. The identity of
the file each summary was read from is kept too (three integers), so that the summaries can be kept on
disk for the next start and each taken again only while its record is still that file
(`agent.claims.summaries`).
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from agent.claims.records import ClaimRecord, PreparedDevice, RecordError, RecordState, partition_attributes
from agent.claims.store import ClaimStore, RecordStamp
from agent.claims.writers import RecordWriters
from agent.names import InvalidName

RECENT = 64  # whole records kept (the claims operated on last)
_STATES = {str(state): state for state in RecordState}  # (faster than RecordState(text), 10,000 times at a start)


@dataclass(frozen=True, slots=True)
class DeviceSummary:
    """What the book keeps of a prepared device: which device of which pool, and its share; and what
    the claim made of it that the inventory does not know: the attributes of a partition made for the
    claim (a MIG device's own `uuid`, a mediated device's `mdevUUID`), and the MAC the claim set on a
    passthrough VF."""

    pool: str
    device: str
    share_id: str = ""
    made: tuple[tuple[str, str], ...] = ()
    mac: str = ""
    admin_access: bool = False  # held with admin access: it excludes no other claim
    pod_interface: str = ""  # a NIC moved into the pod: its name there

    @classmethod
    def of(cls, d: PreparedDevice, record: ClaimRecord) -> DeviceSummary:
        # Only a claim with side effects on the host has either (partitions, bindings): empty for the rest.
        made = tuple((k, str(v)) for p in record.partitions if p.device == d.device
                     for k, v in sorted(partition_attributes(p).items()))
        mac = next((b.mac for b in record.bindings if b.device == d.device and b.mac), "")
        # A node has a few pools and devices, held by thousands of claims: one string each.
        return cls(sys.intern(d.pool), sys.intern(d.device), sys.intern(d.share_id) if d.share_id else "", made, mac,
                   d.admin_access, d.pod_interface)

    def wire(self) -> list[Any]:
        """As `agent.claims.summaries` keeps it (a change here is a new version there)."""
        return [self.pool, self.device, self.share_id, [list(m) for m in self.made], self.mac, self.admin_access,
                self.pod_interface]

    @classmethod
    def from_wire(cls, raw: Any) -> DeviceSummary:
        pool, device, share_id, made, mac, admin_access, pod_interface = raw
        return cls(sys.intern(pool), sys.intern(device), sys.intern(share_id) if share_id else "",
                   tuple((k, v) for k, v in made), mac, admin_access is True, pod_interface)


@dataclass(frozen=True, slots=True)
class ClaimSummary:
    """What the book keeps of a record: what claim status, garbage collection, orphan cleanup and
    the device index read. The files (and their contents) are in the record file only."""

    uid: str
    namespace: str
    name: str
    pod_claim_name: str
    devices: tuple[DeviceSummary, ...]
    dirs: tuple[str, ...]
    prepared_at: float
    generation: int
    state: RecordState
    ahead: bool = False  # prepared for binding conditions, before the kubelet asked (`ClaimRecord.ahead`)

    @classmethod
    def of(cls, record: ClaimRecord) -> ClaimSummary:
        return cls(record.uid, sys.intern(record.namespace), record.name, sys.intern(record.pod_claim_name),
                   tuple(DeviceSummary.of(d, record) for d in record.devices), tuple(record.dirs), record.prepared_at,
                   record.generation, record.state, record.ahead)

    @property
    def prepared(self) -> bool:
        return self.state is RecordState.PREPARED

    def wire(self) -> list[Any]:
        """As `agent.claims.summaries` keeps it, without the UID (a change here is a new version there)."""
        return [self.namespace, self.name, self.pod_claim_name, [d.wire() for d in self.devices], list(self.dirs),
                self.prepared_at, self.generation, str(self.state), self.ahead]

    @classmethod
    def from_wire(cls, uid: str, raw: Any, devices: dict[tuple[Any, ...], DeviceSummary] | None = None) -> ClaimSummary:
        """`devices`: the device summaries made so far, by their wire form; claims holding a device alike
        share one (they are frozen). A partition made for a claim is the claim's own: not shared."""
        namespace, name, pod_claim_name, held, dirs, prepared_at, generation, state, ahead = raw
        shared = devices if devices is not None else {}
        summaries = []
        for d in held:
            if d[3]:  # what was made for the claim (a MIG device's UUID)
                summaries.append(DeviceSummary.from_wire(d))
                continue
            key = tuple(d[:3] + d[4:])
            if (summary := shared.get(key)) is None:
                summary = shared[key] = DeviceSummary.from_wire(d)
            summaries.append(summary)
        return cls(uid, sys.intern(namespace), name, sys.intern(pod_claim_name), tuple(summaries), tuple(dirs),
                   float(prepared_at), int(generation), _STATES[state], ahead is True)


class ClaimBook:
    def __init__(self, store: ClaimStore, recent: int = RECENT, writers: RecordWriters | None = None,
                 check: Callable[[ClaimRecord], None] | None = None) -> None:
        """`check`: run on every record read from its file (never on one this book wrote), raising a
        RecordError for one that must not be used (`agent.claims.recordcheck`)."""
        self.store = store
        self.check = check
        # The other writers of the records (`agent.claims.writers`): without, `sync` always lists.
        self.writers = writers
        self._sync_guard = threading.Lock()  # one listing at a time; a check waits for one in progress
        self._listed_alone: int | None = None  # the arrivals count before the last listing made alone
        self._guard = threading.Lock()  # over the indexes below
        self._summaries: dict[str, ClaimSummary] = {}
        self._stamps: dict[str, RecordStamp] = {}  # the identity of the file each summary was read from
        self.changes = 0  # counts every summary remembered, taken or forgotten (the summaries kept on disk follow)
        self._recent: collections.OrderedDict[str, tuple[ClaimRecord, RecordStamp]] = collections.OrderedDict()
        self._recent_max = recent
        self._device_claims: dict[str, set[str]] = {}  # device name -> UIDs of claims holding it
        self._devices = 0  # the devices of every claim known, one per allocation result

    def records(self) -> dict[str, ClaimSummary]:
        """The prepared claims this agent has seen (a copy)."""
        with self._guard:
            return dict(self._summaries)

    def __len__(self) -> int:
        return len(self._summaries)

    def device_count(self) -> int:
        """The devices of the claims known, one per allocation result (for the metrics)."""
        return self._devices

    def record_of(self, uid: str) -> ClaimSummary | None:
        """The summary held for `uid` (no disk access)."""
        with self._guard:
            return self._summaries.get(uid)

    def stamped(self) -> list[tuple[str, RecordStamp, ClaimSummary]]:
        """Every summary with the identity of the record file it was read from (`agent.claims.summaries`)."""
        with self._guard:
            return [(uid, self._stamps[uid], summary) for uid, summary in self._summaries.items()]

    def take(self, found: Iterable[tuple[str, RecordStamp, ClaimSummary]]) -> int:
        """Summaries of records read by an earlier run, each of a record file that is still the one
        summarized (`agent.claims.summaries`), as a listing would have read them; a claim the book knows
        already keeps what it knows. How many were taken."""
        taken = 0
        with self._guard:
            for uid, stamp, summary in found:
                if uid in self._summaries:
                    continue
                self._summaries[uid] = summary
                self._stamps[uid] = stamp
                self._index(summary)
                taken += 1
            self.changes += taken
        return taken

    def claims_holding(self, devices: set[str], *, exclusive: bool = False) -> list[str]:
        """The claims holding any of these devices; with `exclusive`, only those holding one of them other
        than with admin access (those a prepare of another form of the device must not run beside)."""
        with self._guard:
            uids = {uid for n in devices for uid in self._device_claims.get(n, ())}
            if exclusive:
                uids = {uid for uid in uids if any(d.device in devices and not d.admin_access
                                                   for d in self._summaries[uid].devices)}
            return sorted(uids)

    def current(self, uid: str) -> ClaimRecord | None:
        """The claim's whole record as it is on disk now; RecordError when it is unreadable, or refused by
        the book's `check`."""
        stamp = self.store.stamp(uid)
        with self._guard:
            cached = self._recent.get(uid)
            if cached is not None:
                self._recent.move_to_end(uid)
        if stamp is None:
            if cached is not None or uid in self._summaries:
                self.forget(uid)
            return None
        if cached is not None and cached[1] == stamp:
            return cached[0]
        found = self._read(uid)
        if found is None:
            self.forget(uid)
            return None
        self._remember(*found)
        return found[0]

    def _read(self, uid: str) -> tuple[ClaimRecord, RecordStamp] | None:
        found = self.store.read(uid)
        if found is not None and self.check is not None:
            self.check(found[0])
        return found

    def sync(self) -> None:
        """Make the book say what the records directory says: records this book has not read (another
        agent's, or ones listed at start-up and not yet checked) are read, and records gone from disk
        forgotten. The forms checks call it holding the devices' locks, so which claim holds a form of a
        GPU is read from the durable records, not from this process's memory. Costs a directory listing;
        reads only the records new to this book. An unreadable record is left to its own claim's check.
        Skipped while no other writer has been there since the last listing (`agent.claims.writers`):
        then the book already knows every record."""
        with self._sync_guard:
            if self.writers is None:
                self._list()
                return
            others, arrivals = self.writers.others()  # (read before the listing: an arrival after it counts)
            if not others and arrivals == self._listed_alone:
                return
            self._listed_alone = None
            self._list()
            if not others:
                self._listed_alone = arrivals

    def _list(self) -> None:
        on_disk = set(self.store.uids())
        with self._guard:
            known = set(self._summaries)
        for uid in known - on_disk:
            if self.store.stamp(uid) is None:  # (listed before a write of this process renamed it into place)
                self.forget(uid)
        for uid in sorted(on_disk - known):
            try:
                found = self._read(uid)
            except (RecordError, InvalidName, OSError):
                continue
            if found is None:
                continue
            self._remember(*found)
            if self.store.stamp(uid) is None:  # removed meanwhile by an operation on the claim
                self.forget(uid)

    def write(self, record: ClaimRecord) -> None:
        """Write the record durably, and keep it as the current one."""
        self.store.write(record)
        stamp = self.store.stamp(record.uid)
        assert stamp is not None
        self._remember(record, stamp)

    def delete(self, uid: str, *, best_effort: bool = False) -> bool:
        """Remove the claim's record durably (`ClaimStore.delete`), then forget it; True if there was one.
        An OSError of the removal is raised with the claim still known, unless `best_effort` (a failed
        prepare, which no record may call prepared: it is forgotten all the same, and a record left
        on disk is read again by the next operation)."""
        try:
            removed = self.store.delete(uid)
        except OSError:
            if not best_effort:
                raise
            removed = False
        self.forget(uid)
        return removed

    def forget(self, uid: str) -> None:
        with self._guard:
            self._recent.pop(uid, None)
            self._stamps.pop(uid, None)
            old = self._summaries.pop(uid, None)
            if old is not None:
                self._unindex(old)
                self.changes += 1

    def _remember(self, record: ClaimRecord, stamp: RecordStamp) -> None:
        summary = ClaimSummary.of(record)
        with self._guard:
            old = self._summaries.get(record.uid)
            if old is not None:
                self._unindex(old)
            self._summaries[record.uid] = summary
            self._stamps[record.uid] = stamp
            self._recent[record.uid] = (record, stamp)
            self._recent.move_to_end(record.uid)
            while len(self._recent) > self._recent_max:
                self._recent.popitem(last=False)
            self._index(summary)
            self.changes += 1

    def _index(self, summary: ClaimSummary) -> None:
        for d in summary.devices:
            self._device_claims.setdefault(d.device, set()).add(summary.uid)
        self._devices += len(summary.devices)

    def _unindex(self, summary: ClaimSummary) -> None:
        self._devices -= len(summary.devices)
        for d in summary.devices:
            owners = self._device_claims.get(d.device)
            if owners is not None:
                owners.discard(summary.uid)
                if not owners:
                    del self._device_claims[d.device]

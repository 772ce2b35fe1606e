"""Start-up recovery: listed before the DRA socket accepts calls, checked in the background.

A crash can leave two things behind: prepared claims whose files went missing or
are stale (re-derived from the record), and files of a claim that has no record
(a prepare that never reached its record, an unprepare that removed the record
but not yet the files: removed). Every agent-owned file carries the claim UID in
its name or lives in a directory named by it, so what is ours and what is
orphaned is never a guess. An unreadable record is set aside as `*.corrupt` and
its claim's files are removed; so is a readable one that says what this agent never
writes (`agent.claims.recordcheck`: a file outside the claim's own paths, an edit or a
mode prepare never writes), and one whose check fails in any other way: the others are
checked all the same. A record with host side effects (PCI functions bound to vfio-pci,
GPU partitions such as MIG instances) is settled first (`agent.hostprep.effects`): a prepare that
stopped halfway is rolled back (no orphan GPU instance left), an unprepare finished, a prepared
claim's bindings made true again (a reboot forgets them), and a prepared claim whose partition is
gone (a reboot forgets MIG instances too, and a new one would have another UUID) dropped cleanly.

With 10,000 records a full check takes seconds, so only what is O(1) per record runs before the
DRA socket opens (`begin_recovery`: temp files removed, records listed, and the book given the
summaries the last run kept of those whose file is unchanged, `agent.claims.summaries`: the forms
checks then need not read every record at the first prepare). Each record's full check
runs in the background (`check_records`), or first in any operation on its claim, under the
claim's lock: a prepare or unprepare is never served from an unchecked record. Orphans are
removed once every record is checked (`finish_recovery`).

Another agent may be running beside this one (a rolling update). Each step on a
claim therefore holds that claim's locks (`agent.claims.locks`) and looks at its record
as it is at that moment: files of a prepare in flight in the other agent are
never taken for orphans, because that prepare holds the claim's lock until its
record is written.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field

from agent.claims import filenames, summaries
from agent.claims.book import ClaimSummary
from agent.claims.records import SUFFIX, ClaimRecord
from agent.engine.prepare import PrepareEngine
from agent.errors import ClaimFailure
from agent.fsutil import is_temp_name
from agent.names import InvalidName, check_uid

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    records: dict[str, ClaimSummary] = field(default_factory=dict)  # the claims prepared after recovery
    repaired: list[str] = field(default_factory=list)  # file paths rewritten from their records
    removed: list[str] = field(default_factory=list)  # orphaned files and directories
    quarantined: list[str] = field(default_factory=list)  # records set aside: unreadable, refused, check failed
    settled: list[str] = field(default_factory=list)  # passthrough/partition operations finished or rolled back
    dropped: list[str] = field(default_factory=list)  # prepared claims rolled back: a device is another one now
    undone: list[str] = field(default_factory=list)  # claims whose leftover host changes are undone now

    def summary(self) -> str:
        return (f"{len(self.records)} prepared claims, {len(self.repaired)} files repaired, "
                f"{len(self.removed)} orphans removed, {len(self.quarantined)} records set aside, "
                f"{len(self.settled)} interrupted host side effects settled, "
                f"{len(self.dropped)} claims rolled back, {len(self.undone)} leftover host changes undone")


def _uid_or_none(text: str) -> str | None:
    try:
        check_uid(text)
    except InvalidName:
        return None
    return text


def recover(engine: PrepareEngine) -> RecoveryReport:
    """The whole recovery at once (blocking: run in a worker thread)."""
    report = begin_recovery(engine)
    check_records(engine, engine.unverified())
    return finish_recovery(engine, report)


def begin_recovery(engine: PrepareEngine) -> RecoveryReport:
    """What must happen before the DRA socket opens, and costs O(1) per record: temp files of record
    writes that never reached their rename are removed, and the records are listed; the book takes the
    summary the last run kept of each record whose file is the one summarized (a `stat` each). Each listed
    claim is checked later (`check_records`, in the background) or first thing in the next operation
    on it, whichever comes first: no operation is ever served from an unchecked record. Blocking."""
    report = RecoveryReport()
    store = engine.store
    store.ensure()
    for name in store.temp_files():
        uid = _uid_or_none(name[1:].split(SUFFIX, 1)[0])
        if uid is None:
            continue
        with engine.claim_locked(uid):
            if engine.store.root.unlink(store.directory / name):
                report.removed.append(str(store.directory / name))
    for uid, path in engine.leftovers.temp_files():  # a left-undone entry's write cut short (its claim's lock)
        with engine.claim_locked(uid):
            if engine.leftovers.root.unlink(path):
                report.removed.append(str(path))
    uids = [uid for uid in store.uids() if _uid_or_none(uid) is not None]
    if uids:
        taken = summaries.restore(summaries.path_of(engine.settings.state_dir), engine.book, store, uids)
        log.info("%d of %d claim records known from the summaries the last run kept", taken, len(uids))
    engine.defer_checks(uids, lambda uid: _check_claim(engine, uid, report))
    return report


def check_records(engine: PrepareEngine, uids: list[str]) -> None:
    """The deferred checks of these claims, each under its lock (a claim an operation checked
    meanwhile is skipped). Blocking."""
    for uid in uids:
        with engine.claim_locked(uid):
            engine.ensure_checked(uid)


def finish_recovery(engine: PrepareEngine, report: RecoveryReport) -> RecoveryReport:
    """Once every record is checked: files no record owns are removed, and the report logged. Blocking."""
    report.quarantined = list(engine.quarantined)
    report.undone = engine.retry_leftovers()  # a reboot or a reset mostly left nothing to undo
    report.removed += _remove_orphan_specs(engine)
    report.removed += _remove_orphan_metadata(engine)
    for path in report.repaired:
        log.warning("repaired %s from its claim record", path)
    for path in report.removed:
        log.info("removed %s: no claim record owns it", path)
    return report


def _check_claim(engine: PrepareEngine, uid: str, report: RecoveryReport) -> None:
    """The full check of one record (with the claim locked): decoded (or set aside when unreadable, or
    refused: `agent.claims.recordcheck`), interrupted work on its host side effects settled, and a prepared
    claim checked against the host as it is in this boot (`agent.engine.recheck`: its devices, its host
    effects, its files). A record whose check fails in any other way is set aside too: one record never
    stops the checks of the others, nor leaves its claim served unchecked."""
    try:
        _check_record(engine, uid, report)
    except Exception as exc:
        log.exception("the check of claim record %s failed", uid)
        try:
            engine.set_aside(uid, f"its check failed: {exc!r}"[:300])
        except OSError:
            log.exception("claim record %s could not be set aside either", uid)


def _check_record(engine: PrepareEngine, uid: str, report: RecoveryReport) -> None:
    record = engine.current_or_purge(uid)
    if record is not None and not record.prepared:
        _settle(engine, record, report)
        return
    if record is None:
        return
    checked = engine.recheck(record)
    if checked is None:
        report.dropped.append(uid)
        return
    record, repaired = checked
    report.records[uid] = engine.book.record_of(uid) or ClaimSummary.of(record)  # (the book's: not a copy)
    report.repaired += repaired


def _settle(engine: PrepareEngine, record: ClaimRecord, report: RecoveryReport) -> None:
    """A prepare or unprepare with host side effects that stopped halfway (call with the claim locked):
    mid-bind rolled back (the kubelet retries the prepare), mid-restore finished."""
    with engine.devices_locked(engine.effects.record_lock_keys(record)):
        try:
            engine.settle(record)
        except (ClaimFailure, OSError) as exc:
            log.error("claim %s/%s (%s): could not undo its host changes (%s); its record stays, for the next "
                      "operation on it or the next start", record.namespace, record.name, record.uid, exc)
            return
    report.settled.append(record.uid)


def _remove_orphan_specs(engine: PrepareEngine) -> list[str]:
    root = engine.cdi_root
    by_uid: dict[str, list[str]] = defaultdict(list)
    for name in root.listdir():
        uid = filenames.claim_uid_of_spec(name, engine.settings.cdi_vendor)
        if uid is not None:
            by_uid[uid].append(name)
    removed: list[str] = []
    for uid, names in sorted(by_uid.items()):
        with engine.claim_locked(uid):
            record = engine.current_or_purge(uid)
            keep = {f.path for f in record.files} if record is not None else set()
            for name in names:
                path = root.path / name
                if str(path) not in keep and root.unlink(path):
                    removed.append(str(path))
    return removed


def _remove_orphan_metadata(engine: PrepareEngine) -> list[str]:
    root = engine.metadata_root
    removed: list[str] = []
    records = engine.records
    owned = {d for r in records.values() for d in r.dirs}
    for name in root.listdir():
        path = root.path / name
        uid = _uid_or_none(name)
        if uid is None:
            # Not a claim directory of this agent's layout: kept only while a record names it.
            if str(path) not in owned and root.remove_tree(path):
                removed.append(str(path))
            continue
        with engine.claim_locked(uid):
            record = engine.current_or_purge(uid)
            if record is None:
                if root.remove_tree(path):
                    removed.append(str(path))
                continue
            if os.path.islink(path):
                continue  # planted: its files could not be repaired either (logged above)
            owned = {f.path for f in record.files}
            for parent, _dirs, files in os.walk(path):
                for file in files:
                    full = os.path.join(parent, file)
                    if full not in owned and (is_temp_name(file) or file.endswith(".json")) and root.unlink(full):
                        removed.append(full)
    return removed

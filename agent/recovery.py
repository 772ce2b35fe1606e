"""Start-up recovery, run before the DRA socket accepts calls.

A crash can leave three things behind: records that are not `prepared` (to roll
back), prepared claims whose files went missing (to re-derive from the record),
and files written by a prepare that never reached its record (to remove). All
agent-owned files carry the claim UID in their name, or live in the agent's own
metadata directory, so what is ours and what is orphaned is never a guess.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from agent import cdispecs
from agent.config import Settings
from agent.fsutil import atomic_write, is_temp_name, makedirs, unlink_quiet
from agent.state import PREPARED, ClaimRecord, ClaimStore

log = logging.getLogger(__name__)

_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


@dataclass
class RecoveryReport:
    records: dict[str, ClaimRecord] = field(default_factory=dict)
    rolled_back: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)  # file paths rewritten from their records
    removed: list[str] = field(default_factory=list)  # orphaned files and directories
    quarantined: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{len(self.records)} prepared claims, {len(self.repaired)} files repaired, "
                f"{len(self.rolled_back)} half-prepared rolled back, {len(self.removed)} orphans removed, "
                f"{len(self.quarantined)} unreadable records set aside")


def owned_spec_pattern(vendor: str) -> re.Pattern[str]:
    v = re.escape(vendor)
    return re.compile(rf"^(?:{v}-{cdispecs.CLAIM_CLASS}_(?P<a>{_UID})\.json"
                      rf"|{v}_{cdispecs.METADATA_CLASS}_(?P<b>{_UID})_[a-z0-9-]+\.json)$")


def recover(settings: Settings, store: ClaimStore) -> RecoveryReport:
    """Blocking: run in a worker thread."""
    report = RecoveryReport()
    store.ensure()
    records, problems = store.load_all(clean=True)
    for name, why in problems:
        log.error("claim record %s is unreadable (%s): setting it aside; its files will be removed", name, why)
        try:
            report.quarantined.append(str(store.quarantine(name)))
        except OSError as exc:
            log.error("could not set %s aside: %s", name, exc)
    for uid, record in records.items():
        if record.state != PREPARED:
            _roll_back(store, record)
            report.rolled_back.append(uid)
            continue
        report.records[uid] = record
        for f in record.files:
            if _needs_repair(Path(f.path), f.content):
                makedirs(Path(f.path).parent)
                atomic_write(Path(f.path), f.content, f.mode)
                report.repaired.append(f.path)
    report.removed += _remove_orphan_specs(settings, report.records)
    report.removed += _remove_orphan_metadata(settings, report.records)
    for path in report.repaired:
        log.warning("repaired %s from its claim record", path)
    for path in report.removed:
        log.info("removed %s: no claim record owns it", path)
    return report


def _roll_back(store: ClaimStore, record: ClaimRecord) -> None:
    log.warning("rolling back half-prepared claim %s/%s (%s)", record.namespace, record.name, record.uid)
    for f in reversed(record.files):
        unlink_quiet(Path(f.path))
    for d in record.dirs:
        shutil.rmtree(d, ignore_errors=True)
    store.delete(record.uid)


def _needs_repair(path: Path, content: bytes) -> bool:
    try:
        return path.read_bytes() != content
    except OSError:
        return True


def _remove_orphan_specs(settings: Settings, records: dict[str, ClaimRecord]) -> list[str]:
    pattern = owned_spec_pattern(settings.cdi_vendor)
    removed: list[str] = []
    try:
        names = os.listdir(settings.cdi_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        path = settings.cdi_dir / name
        if is_temp_name(name) and name[1:].startswith(settings.cdi_vendor):
            if unlink_quiet(path):
                removed.append(str(path))
            continue
        m = pattern.match(name)
        if m and (m.group("a") or m.group("b")) not in records and unlink_quiet(path):
            removed.append(str(path))
    return removed


def _remove_orphan_metadata(settings: Settings, records: dict[str, ClaimRecord]) -> list[str]:
    owned = {d for r in records.values() for d in r.dirs}
    removed: list[str] = []
    try:
        entries = os.listdir(settings.metadata_dir)
    except FileNotFoundError:
        return removed
    for name in entries:
        path = settings.metadata_dir / name
        if str(path) in owned:
            removed += _remove_temp_files(path)
        else:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                unlink_quiet(path)
            removed.append(str(path))
    return removed


def _remove_temp_files(claim_dir: Path) -> list[str]:
    removed = []
    for parent, _dirs, files in os.walk(claim_dir):
        for name in files:
            if is_temp_name(name) and unlink_quiet(Path(parent) / name):
                removed.append(os.path.join(parent, name))
    return removed

"""The metadata refresh of one prepared claim, in a worker thread: when the facts of its devices
changed after prepare (a NIC got its IP), the new record (generation + 1) is written first, then the
metadata files that changed; a crash between the two is repaired at start-up, which rewrites the
files from the record (`agent.engine.recovery`). `PrepareEngine.refresh_devices` and `refresh_claims`
run it for each claim and tell the listeners."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from agent import failpoints
from agent.claims.book import ClaimBook
from agent.claims.plan import refreshed
from agent.claims.records import ClaimRecord
from agent.config import Settings
from agent.fsutil import Root
from agent.inventory import Inventory


class RefreshEngine(Protocol):
    """What a refresh uses of the engine (`agent.engine.prepare.PrepareEngine`)."""

    settings: Settings
    inventory: Inventory
    book: ClaimBook
    metadata_root: Root

    def claim_locked(self, uid: str) -> AbstractContextManager[None]: ...

    def ensure_checked(self, uid: str) -> None: ...

    def current_or_purge(self, uid: str) -> ClaimRecord | None: ...


def refresh_blocking(engine: RefreshEngine, uid: str) -> ClaimRecord | None:
    """The claim's new record when its metadata changed; None when it did not or it is not prepared."""
    with engine.claim_locked(uid):
        engine.ensure_checked(uid)
        record = engine.current_or_purge(uid)
        if record is None or not record.prepared:
            return None
        return _refresh(engine, record)


def _refresh(engine: RefreshEngine, record: ClaimRecord) -> ClaimRecord | None:
    change = refreshed(engine.settings, engine.inventory.get, record)
    if change is None:
        return None
    new, paths = change
    engine.book.write(new)
    failpoints.hit("refresh-after-record")
    for f in new.files:
        if f.path in paths:
            engine.metadata_root.write(f.path, f.content, f.mode)
            failpoints.hit("refresh-after-metadata-file")
    return new

"""The metadata refresh of one prepared claim, in a worker thread: when the facts of its devices
changed after prepare (a NIC got its IP), the new record (generation + 1) is written first, then the
metadata files that changed; a crash between the two is repaired at start-up, which rewrites the
files from the record (`agent.engine.recovery`). `PrepareEngine.refresh_devices` and `refresh_claims`
run it for each claim and tell the listeners.

The files are those the record holds as metadata files, rewritten where the record says they are
(`agent.claims.plan.refreshed`): the claim's metadata CDI specs mount them from there. An agent started
with another metadata directory (another --kubelet-dir) than a claim was prepared under therefore
still refreshes that claim's files in the directory they were prepared in, as long as it exists;
start-up repair and unprepare reach only files below today's directories. The paths are the claim's own
(`agent.claims.recordcheck` refuses a record naming any other: `<a metadata directory>/<uid>/<request>`),
the content is rendered from the devices, the mode is the agent's."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from agent import failpoints
from agent.claims.book import ClaimBook
from agent.claims.files import ClaimFiles
from agent.claims.plan import refreshed
from agent.claims.records import FILE_MODE, ClaimRecord
from agent.config import Settings
from agent.inventory import Inventory


class RefreshEngine(Protocol):
    """What a refresh uses of the engine (`agent.engine.prepare.PrepareEngine`)."""

    settings: Settings
    inventory: Inventory
    book: ClaimBook
    files: ClaimFiles

    def claim_locked(self, uid: str) -> AbstractContextManager[None]: ...

    def ensure_checked(self, uid: str) -> bool: ...

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
    # Where each file is written, worked out first: a file the agent cannot reach (the metadata
    # directory it was prepared in is gone) leaves the record as it was.
    writes = [(engine.files.root_of_recorded(new, f.path), f) for f in new.files if f.path in paths]
    engine.book.write(new)
    failpoints.hit("refresh-after-record")
    for root, f in writes:
        root.write(f.path, f.content, FILE_MODE)
        failpoints.hit("refresh-after-metadata-file")
    return new

"""A claim's files below the agent's CDI and metadata directories: which root a path lies in, and
their removal (by the record's list, or every file the claim's UID names). Blocking: worker threads,
with the claim locked."""

from __future__ import annotations

import contextlib
import logging

from agent import failpoints
from agent.claims import cdispecs, metadata
from agent.claims.book import ClaimBook
from agent.claims.records import ClaimRecord
from agent.config import Settings
from agent.fsutil import Root, UnsafePath

log = logging.getLogger(__name__)


class ClaimFiles:
    def __init__(self, settings: Settings, cdi_root: Root, metadata_root: Root) -> None:
        self.settings = settings
        self.cdi_root = cdi_root
        self.metadata_root = metadata_root

    def root_of(self, path: str) -> Root:
        for root in (self.cdi_root, self.metadata_root):
            if root.contains(path):
                return root
        raise UnsafePath(0, f"{path} lies outside the agent's CDI and metadata directories")

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

    def roll_back(self, record: ClaimRecord, book: ClaimBook) -> None:
        """A prepare without bindings failed: its record and files go."""
        # The record may be in place already (renamed, then its directory's fsync failed): the
        # prepare is reported as failed, so no record may say otherwise.
        book.delete(record.uid, best_effort=True)
        for f in reversed(record.files):
            with contextlib.suppress(OSError):
                self.root_of(f.path).unlink(f.path)
        for d in record.dirs:
            with contextlib.suppress(OSError):
                self.metadata_root.remove_tree(d)

"""A claim's files below the agent's CDI and metadata directories: which root a path lies in, and
their removal (by the record's list, or every file the claim's UID names). Blocking: worker threads,
with the claim locked."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path

from agent import failpoints
from agent.claims import filenames, metadata
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

    def root_of_recorded(self, record: ClaimRecord, path: str) -> Root:
        """The root through which a file of the record is written where the record says it is: the CDI or
        metadata directory it lies in, or, for a claim prepared under another metadata directory (the
        agent restarted with another --kubelet-dir), that directory: the one holding the claim's own
        directory (`record.dirs`) the file lies in, which must still exist. The claim's CDI specs, and so
        its containers, find its files there. Nothing there is watched by self-healing, so nothing is
        noted for it."""
        for root in (self.cdi_root, self.metadata_root):
            if root.contains(path):
                return root
        for d in record.dirs:
            if path.startswith(d + os.sep):
                parent = os.path.dirname(d)
                if not os.path.isdir(parent):
                    raise UnsafePath(errno.ENOENT, f"{path}: the metadata directory {parent} it was prepared "
                                                   "in is gone")
                return Root(Path(parent), dir_mode=self.metadata_root.dir_mode)
        raise UnsafePath(errno.EINVAL, f"{path} lies outside the agent's CDI and metadata directories and the "
                                       "claim's own")

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
            if filenames.claim_uid_of_spec(name, self.settings.cdi_vendor) == uid and self.cdi_root.unlink(
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

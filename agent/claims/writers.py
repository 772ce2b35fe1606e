"""Who else writes claim records in this state directory: what lets the book skip reading the records
directory before a forms check while no other writer has been there (`ClaimBook.sync`).

The forms checks read which claim holds a form of a GPU from the records on disk, because another
agent may share the state directory (a rolling update) and its records are not in this process's
memory. Listing the directory costs milliseconds per prepare with thousands of claims prepared, to learn
of writers that are there only for minutes of a node's life. So every claim engine registers, for its
life, in `<state>/writers.lock`:

- it holds a read lock on byte 0 (an open file description lock, as `agent.claims.locks`: the kernel
  drops it when the process dies, however it dies), and
- once, at its start, it adds one to the arrivals count (8 bytes at offset 8, changed under a write lock
  on byte 1).

`others()` tells whether another writer holds byte 0 now, and the arrivals count. The book lists the
directory again unless no other writer is there now and the count is the one it read before its last
listing made while none was: then no other writer has been alive since that listing, and every record on
disk is one the book listed then or this process wrote since. A writer that came and went in between
changed the count; one that is still there holds byte 0.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import weakref
from pathlib import Path

from agent.claims.locks import FLOCK_FORMAT, closed_with, set_byte_lock

WRITERS_LOCK_FILE = "writers.lock"
_PRESENT = 0  # the byte every writer holds shared for its life
_COUNTING = 1  # the byte held alone while the arrivals count changes
_COUNT_AT = 8


class RecordWriters:
    """This process's registration as a writer of the claim records in a state directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._guard = threading.Lock()
        self._closer: weakref.finalize[[int], object] | None = None

    def open(self) -> None:
        """Register (idempotent): hold byte 0 shared, then count this arrival."""
        with self._guard:
            if self._fd is not None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                set_byte_lock(fd, fcntl.F_RDLCK, _PRESENT, wait=True)
                set_byte_lock(fd, fcntl.F_WRLCK, _COUNTING, wait=True)
                try:
                    os.pwrite(fd, struct.pack("<Q", _count(fd) + 1), _COUNT_AT)
                finally:
                    set_byte_lock(fd, fcntl.F_UNLCK, _COUNTING, wait=False)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self._closer = fd, closed_with(self, fd)

    def others(self) -> tuple[bool, int]:
        """(whether another writer is registered now, the arrivals count so far)."""
        with self._guard:
            fd = self._fd
            if fd is None:
                raise RuntimeError("not registered as a writer of claim records")
            asked = struct.pack(FLOCK_FORMAT, fcntl.F_WRLCK, os.SEEK_SET, _PRESENT, 1, 0)
            probe = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, asked)
            present = struct.unpack(FLOCK_FORMAT, probe)[0] != fcntl.F_UNLCK
            return present, _count(fd)

    def close(self) -> None:
        with self._guard:
            if self._closer is not None:
                self._closer()  # closes the descriptor (its locks go with it)
            self._fd = self._closer = None


def _count(fd: int) -> int:
    raw = os.pread(fd, 8, _COUNT_AT)
    return struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0

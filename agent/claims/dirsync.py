"""Group commit of one directory's fsync (the claim records' directory).

Kept apart from agent/claims/records.py so the record format stays one module of a readable size.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


class DirectorySync:
    """fsync of one directory, shared by the threads that ask for it at the same time.

    `sync()` returns once an fsync that began after the call completed. While one thread's
    fsync runs, the threads that arrive meanwhile wait for it to end and then one of them
    runs the next fsync for all of them: n concurrent writers cost about two fsyncs, not n.
    A failed fsync raises in the thread that ran it; the others then run their own.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cond = threading.Condition()
        self._asked = 0  # tickets handed out
        self._covered = 0  # every ticket up to this one has had its fsync
        self._running = False
        self.fsyncs = 0  # for tests

    def sync(self) -> None:
        with self._cond:
            self._asked += 1
            ticket = self._asked
            while self._covered < ticket:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                covers = self._asked  # every rename before this point is covered by the fsync below
                ok = False
                self._cond.release()
                try:
                    fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    ok = True
                finally:
                    self._cond.acquire()
                    self._running = False
                    if ok:
                        self.fsyncs += 1
                        self._covered = max(self._covered, covers)
                    self._cond.notify_all()

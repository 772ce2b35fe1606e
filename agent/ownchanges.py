"""The agent's own changes to its claim files, so self-healing can tell them from anyone else's.

Every prepare writes a claim's files (an atomic write: a temp file renamed onto the name) and every
unprepare removes them, and inotify reports each of those to self-healing, which would check the
claim under its lock and find nothing to do: work on every prepare and unprepare for no outcome.
The roots the engine writes through (`agent.fsutil.Root`) note here what they did: the inode a
rename put in place, or that a path was removed. An event is the agent's own only when the file
system still shows exactly that: the same inode at the path after a rename, or nothing at a path
(or below a directory) the agent removed. Anything else (another inode, a change in place, a file
back where the agent removed one) is someone else's, and is checked as before.

Bounded: entries are consumed by their event; when self-healing does not run (the CLI, tests) the
oldest are dropped, which can only cost a check, never skip one.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from agent.inotify import IN_DELETE, IN_DELETE_SELF, IN_MOVED_FROM, IN_MOVED_TO

LIMIT = 4096
_REMOVED = -1


class OwnChanges:
    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        self._lock = threading.Lock()  # noted from worker threads, asked on the event loop
        self._changes: OrderedDict[str, int] = OrderedDict()

    def _note(self, path: str, what: int) -> None:
        with self._lock:
            self._changes[path] = what
            self._changes.move_to_end(path)
            while len(self._changes) > self._limit:
                self._changes.popitem(last=False)

    def wrote(self, path: str, inode: int) -> None:
        # A write below a directory the agent removed before (the same claim prepared again) makes
        # later removals there someone else's again.
        with self._lock:
            probe = os.path.dirname(path)
            while probe and probe != os.sep:
                if self._changes.get(probe) == _REMOVED:
                    del self._changes[probe]
                probe = os.path.dirname(probe)
        self._note(path, inode)

    def removed(self, path: str) -> None:
        self._note(path, _REMOVED)

    def is_own(self, path: str, mask: int) -> bool:
        """Whether the event (`mask` at `path`) is the agent's own change, as the file system shows now."""
        if mask & IN_MOVED_TO:
            with self._lock:
                inode = self._changes.pop(path, None)
            if inode is None or inode == _REMOVED:
                return False
            try:
                return os.lstat(path).st_ino == inode
            except OSError:
                return False  # gone again: someone removed it (its own event says so)
        if mask & (IN_DELETE | IN_DELETE_SELF | IN_MOVED_FROM):
            if os.path.lexists(path):
                return False  # back already: judged by what put it there
            with self._lock:
                probe = path
                while probe and probe != os.sep:
                    if self._changes.get(probe) == _REMOVED:
                        return True
                    probe = os.path.dirname(probe)
            return False
        return False

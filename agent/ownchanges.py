"""The agent's own changes to its claim files, so self-healing can tell them from anyone else's.

Every prepare writes a claim's files (an atomic write: a temp file renamed onto the name) and every
unprepare removes them, and inotify reports each of those to self-healing, which would check the
claim under its lock and find nothing to do: work on every prepare and unprepare for no outcome.
The roots the engine writes through (`agent.fsutil.Root`) note here what they did: the inode a
rename put in place (and how many renames onto the name are yet to be seen), or that a path was
removed. Self-healing reads its events in batches, so by the time an event is judged the agent
may have changed the path again: an event is the agent's own when the file system shows exactly
the agent's latest change to the path: its inode there after its rename, nothing at a path (or
below a directory) it removed or below a directory it made again and has not written the path in
since, or, for a removal whose path is back, the agent's own file (or a directory the agent
created again) in its place. Then nothing can be missing or changed: the last
change was the agent's. Anything else (another inode, a change in place, a file back where the
agent removed one) is someone else's, and is checked as before.

Workers make changes and the event loop judges events, at once: a change and its note are made
holding the `SharedLock` shared (changes of different claims never wait for each other: a claim's
removal is many system calls), a judgment and the look at the file system it needs hold it alone.
So a judgment sees both a change and its note or neither, and waits only for the changes in progress.

Bounded: the oldest entries are dropped past LIMIT, which can only cost a check, never skip one
(an entry's sequence number follows its place in the table, so a directory's "made again" goes
before the entries of the files written in it since).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from agent.inotify import IN_DELETE, IN_DELETE_SELF, IN_MOVED_FROM, IN_MOVED_TO
from agent.sharedlock import SharedLock

LIMIT = 4096
_REMOVED = -1  # the agent removed the path (a file, or a directory with all below it)
_REMADE = -2  # a directory the agent created (again)


@dataclass(slots=True)
class _Change:
    state: int  # the inode the agent's last rename put at the path, _REMOVED or _REMADE
    renames: int  # the agent's renames onto the path whose events are yet to be judged
    seq: int  # when: the latest change of a path and the directories above it is the one that counts


class OwnChanges:
    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        # Noted from worker threads, asked on the event loop: changes hold it shared, judgments alone.
        self._lock = SharedLock()
        self._table = threading.Lock()  # over the entries, between the changes of several workers
        self._changes: OrderedDict[str, _Change] = OrderedDict()
        self._seq = 0

    def _note(self, path: str, state: int, renames: int) -> None:
        """Holding the lock shared."""
        with self._table:
            self._seq += 1
            entry = self._changes.get(path)
            if entry is None:
                self._changes[path] = _Change(state, renames, self._seq)
            else:
                entry.state, entry.renames, entry.seq = state, entry.renames + renames, self._seq
                self._changes.move_to_end(path)
            while len(self._changes) > self._limit:
                self._changes.popitem(last=False)

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """Held around a change the caller then notes (a directory made: `made`)."""
        return self._lock.held(shared=True)

    @contextlib.contextmanager
    def renaming(self, path: str, inode: int) -> Iterator[None]:
        """Around the rename that puts `inode` at `path`."""
        with self._lock.held(shared=True):
            self._note(path, inode, 1)
            yield

    @contextlib.contextmanager
    def removing(self, path: str) -> Iterator[None]:
        """Around the removal of `path` (a file, or a directory with all below it)."""
        with self._lock.held(shared=True):
            self._note(path, _REMOVED, 0)
            yield

    def made(self, path: str) -> None:
        """The agent created the directory (inside `hold`): removals there before are not explained by
        the agent's removal any more, and one whose path is back is."""
        self._note(path, _REMADE, 0)

    def is_own(self, path: str, mask: int) -> bool:
        """Whether the event (`mask` at `path`) is the agent's own change, as the file system shows now."""
        with self._lock.held(shared=False):
            if mask & IN_MOVED_TO:
                entry = self._changes.get(path)
                if entry is None or entry.renames == 0:
                    return False  # a rename the agent did not make (or one more than it made)
                entry.renames -= 1
                if entry.state >= 0 and (inode := _inode(path)) is not None:
                    return inode == entry.state
                # Renamed, then removed (the file, or a directory above it): own if the removal was.
                return entry.state != _REMADE and self._removed(path)
            if mask & (IN_DELETE | IN_DELETE_SELF | IN_MOVED_FROM):
                st = _lstat(path)
                if st is None:
                    return self._removed(path)
                entry = self._changes.get(path)  # back already: own only if what is there is the agent's
                return entry is not None and (entry.state == st.st_ino
                                              or (entry.state == _REMADE and stat.S_ISDIR(st.st_mode)))
            return False

    def _removed(self, path: str) -> bool:
        """(Holding the lock alone.) Nothing at `path`, explained by the agent's latest change to it or to a
        directory above it: a removal, or a directory made again (it was empty then) with nothing
        written at `path` since."""
        if os.path.lexists(path):
            return False
        own = self._changes.get(path)
        latest: _Change | None = None
        probe = path
        while probe and probe != os.sep:
            entry = self._changes.get(probe)
            if entry is not None and entry.state < 0 and (latest is None or entry.seq > latest.seq):
                latest = entry
            probe = os.path.dirname(probe)
        if latest is None:
            return False
        if latest.state == _REMOVED:
            return True
        # Made again: the path was not there then; gone again since the agent wrote it is not ours.
        return latest is not own and (own is None or own.seq < latest.seq)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _inode(path: str) -> int | None:
    st = _lstat(path)
    return None if st is None else st.st_ino

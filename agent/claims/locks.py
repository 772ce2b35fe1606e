"""The agent's one lock table, and the lock that extends a claim's lock to other agents on the node.

Every operation on a claim (prepare, unprepare, metadata refresh, start-up
repair or cleanup) runs in one worker thread and holds, in this order:
1. the claim's lock in this process (`LockTable`, key `claim/<uid>`);
2. the claim's lock across processes (`ClaimFileLock`): during a rolling update
   two agents share the state directory, and the kubelet may send a claim's
   unprepare to the newer one while the older one is still preparing it;
3. for prepare and unprepare, which change what a device is bound to, the locks
   of the claim's devices (`device/<name>`), in sorted order. A device handed out in
   shares (`Kind.shared`) is held shared by its claims: they exclude nothing among
   themselves (each claim's files are its own), only whoever takes the device alone.
A claim lock is never requested while a device lock is held, and device locks
are always taken in one global order, so there is no deadlock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
import threading
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from agent.sharedlock import SharedLock


class LockTable:
    """Locks by key, created on first use and dropped when nobody holds or waits for them."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[SharedLock, int]] = {}  # key -> (lock, holders and waiters)

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.contextmanager
    def hold(self, keys: Iterable[str], shared: Collection[str] = ()) -> Iterator[None]:
        """Hold every key, those in `shared` in shared mode, the others alone."""
        ordered = sorted(set(keys))  # one global order: no deadlock between holders of several keys
        with self._guard:
            locks = []
            for key in ordered:
                lock, users = self._locks.get(key) or (SharedLock(), 0)
                self._locks[key] = (lock, users + 1)
                locks.append((lock, key in shared))
        acquired: list[tuple[SharedLock, bool]] = []
        try:
            for lock, mode in locks:
                lock.acquire(mode)
                acquired.append((lock, mode))
            yield
        finally:
            for lock, mode in reversed(acquired):
                lock.release(mode)
            with self._guard:
                for key in ordered:
                    lock, users = self._locks[key]
                    if users == 1:
                        del self._locks[key]
                    else:
                        self._locks[key] = (lock, users - 1)


# struct flock on Linux (x86-64 and arm64): short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid, padded to 32 bytes. Open file description locks need l_pid = 0.
_FLOCK = "@hhqqi4x"
_OFFSET_BITS = 62


class ClaimFileLock:
    """A byte-range lock per claim UID on one file in the state directory, shared by every agent
    on the node. Open file description locks (`F_OFD_SETLKW`) belong to the descriptor, not the
    process, so closing some other descriptor of the file never drops them, and the kernel
    releases them when the process dies: a killed agent never leaves a claim locked.

    Within a process the `LockTable` already serializes a claim, so one descriptor serves all
    threads. Two UIDs share a byte only if 62 bits of their digests collide.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._open_guard = threading.Lock()

    def open(self) -> None:
        self._descriptor()

    def _descriptor(self) -> int:
        with self._open_guard:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            return self._fd

    @staticmethod
    def offset(uid: str) -> int:
        digest = hashlib.blake2b(uid.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> (64 - _OFFSET_BITS)

    @contextlib.contextmanager
    def hold(self, uid: str) -> Iterator[None]:
        fd = self._descriptor()
        start = self.offset(uid)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0))
        try:
            yield
        finally:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, start, 1, 0))

    def close(self) -> None:
        with self._open_guard:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

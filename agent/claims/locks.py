"""The agent's one lock table, and the byte locks that extend its locks to other agents on the node.

Every operation on a claim (prepare, unprepare, metadata refresh, start-up
repair or cleanup) runs in one worker thread and holds, in this order:
1. the claim's lock in this process (`LockTable`, key `claim/<uid>`);
2. the claim's lock across processes (`ClaimFileLock` on `<state>/claims.lock`): during a
   rolling update two agents share the state directory, and the kubelet may send a claim's
   unprepare to the newer one while the older one is still preparing it;
3. for prepare, unprepare and the settling of host side effects, which change what a device is
   bound to or made into, the locks of the claim's devices (`pci/<bus>` for a PCI function and
   every form of a GPU, `device/<name>` for others), in sorted order, each in this process and
   then across processes (`KeyFileLock` on `<state>/devices.lock`): two agents never prepare two
   forms of one GPU at once, and each judges the other forms against the records on disk while
   it holds the GPU's lock. A device handed out in shares (`Kind.shared`) is held shared by its
   claims, in this process and across processes (a read lock on its byte): they exclude nothing
   among themselves (each claim's files are its own), only whoever takes the device alone.
A claim lock is never requested while a device lock is held, and device locks
are always taken in one global order, so there is no deadlock, within an agent or between two.
A thread that has to wait for a lock lets its slot go meanwhile (`agent.workslots`): the claims
behind a slow one's device, or the kubelet's second call for a claim still being prepared, hold no
slot the other claims need.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import struct
import threading
import weakref
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from agent.sharedlock import SharedLock
from agent.workslots import PATIENCE, take, waiting


class LockTable:
    """Locks by key, created on first use and dropped when nobody holds or waits for them."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[SharedLock, int]] = {}  # key -> (lock, holders and waiters)

    def __len__(self) -> int:
        return len(self._locks)

    def users(self, key: str) -> int:
        """How many threads hold or wait for `key` now (a test's handshake: one holds, others wait)."""
        with self._guard:
            found = self._locks.get(key)
        return found[1] if found else 0

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
                # Another claim's operation on the same claim or device is usually over within
                # milliseconds: waited for holding the slot. One that takes longer (a slow device's) is
                # waited for without it.
                if not lock.acquire(mode, timeout=PATIENCE):
                    with waiting():
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
FLOCK_FORMAT = "@hhqqi4x"  # struct flock (l_type, l_whence, l_start, l_len, l_pid)
_OFFSET_BITS = 62


class KeyFileLock:
    """A byte-range lock per key (a claim UID, a device lock key) on one file in the state directory,
    shared by every agent on the node. Open file description locks (`F_OFD_SETLKW`) belong to the
    descriptor, not the process, so closing some other descriptor of the file never drops them, and
    the kernel releases them when the process dies: a killed agent never leaves a key locked.

    Within a process the `LockTable` already serializes each key, so one descriptor serves all
    threads (locks of one descriptor never wait for each other). Two keys share a byte only if 62
    bits of their digests collide.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._open_guard = threading.Lock()
        # key -> (its gate, how many threads of this process hold it shared); kept once made (one per device)
        self._shared: dict[str, tuple[threading.Lock, list[int]]] = {}
        self._closer: weakref.finalize[[int], object] | None = None

    def open(self) -> None:
        self._descriptor()

    def _descriptor(self) -> int:
        with self._open_guard:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
                self._closer = closed_with(self, self._fd)
            return self._fd

    @staticmethod
    def offset(key: str) -> int:
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> (64 - _OFFSET_BITS)

    @contextlib.contextmanager
    def hold(self, key: str, shared: bool = False) -> Iterator[None]:
        """The key's byte, alone (a write lock) or `shared` (a read lock). Threads of this process holding
        one key shared (the `LockTable` lets them in together) share its one lock, as a descriptor has one
        lock per byte however often it is set: the first takes it, the last releases it."""
        fd = self._descriptor()
        start = self.offset(key)
        if not shared:
            self._take(fd, fcntl.F_WRLCK, start)
            try:
                yield
            finally:
                self._set(fd, fcntl.F_UNLCK, start, wait=False)
            return
        with self._open_guard:
            gate, _ = self._shared.setdefault(key, (threading.Lock(), [0]))
        take(gate)  # the count and the lock move together
        try:
            count = self._shared[key][1]
            if count[0] == 0:
                self._take(fd, fcntl.F_RDLCK, start)
            count[0] += 1
        finally:
            gate.release()
        try:
            yield
        finally:
            take(gate)  # (its holder may be taking a slot back: `agent.workslots`)
            try:
                count[0] -= 1
                if count[0] == 0:
                    self._set(fd, fcntl.F_UNLCK, start, wait=False)
            finally:
                gate.release()

    @staticmethod
    def _set(fd: int, kind: int, start: int, *, wait: bool) -> None:
        set_byte_lock(fd, kind, start, wait=wait)

    def _take(self, fd: int, kind: int, start: int) -> None:
        """The byte's lock; a wait for another agent's holder lets this thread's slot go."""
        try:
            self._set(fd, kind, start, wait=False)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        with waiting():
            self._set(fd, kind, start, wait=True)

    @contextlib.contextmanager
    def hold_all(self, keys: Iterable[str], shared: Collection[str] = ()) -> Iterator[None]:
        """Every key, taken in sorted order (the one order every agent takes them in), those in `shared`
        shared."""
        with contextlib.ExitStack() as stack:
            for key in sorted(set(keys)):
                stack.enter_context(self.hold(key, key in shared))
            yield

    def close(self) -> None:
        with self._open_guard:
            if self._closer is not None:
                self._closer()
            self._fd = self._closer = None


def closed_with(owner: object, fd: int) -> weakref.finalize[[int], object]:
    """Close `fd` (and so drop its open file description locks) when `owner` is garbage, as a process's exit
    does for the engine that lived as long as the process: an engine dropped without `close` (one of a test
    process's many) would otherwise keep its descriptors and its locks for the rest of the process. Calling
    the returned finalizer closes it now, once."""
    return weakref.finalize(owner, os.close, fd)


ClaimFileLock = KeyFileLock  # `<state>/claims.lock`, keyed by claim UID
CLAIMS_LOCK_FILE = "claims.lock"
DEVICES_LOCK_FILE = "devices.lock"  # keyed by device lock key (`pci/<bus>`, `device/<name>`)


def set_byte_lock(fd: int, kind: int, start: int, *, wait: bool) -> None:
    """An open file description lock (`kind`: F_RDLCK, F_WRLCK or F_UNLCK) on the byte at `start`."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK,
                struct.pack(FLOCK_FORMAT, kind, os.SEEK_SET, start, 1, 0))

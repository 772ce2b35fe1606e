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
   it holds the GPU's lock.
A claim lock is never requested while a device lock is held, and device locks
are always taken in one global order, so there is no deadlock, within an agent or between two.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path


class LockTable:
    """Thread locks by key, created on first use and dropped when nobody holds or waits for them."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    def users(self, key: str) -> int:
        """How many threads hold or wait for `key` now (a test's handshake: one holds, others wait)."""
        with self._guard:
            found = self._locks.get(key)
        return found[1] if found else 0

    @contextlib.contextmanager
    def hold(self, keys: Iterable[str]) -> Iterator[None]:
        ordered = sorted(set(keys))  # one global order: no deadlock between holders of several keys
        with self._guard:
            locks = []
            for key in ordered:
                lock, users = self._locks.get(key) or (threading.Lock(), 0)
                self._locks[key] = (lock, users + 1)
                locks.append(lock)
        acquired: list[threading.Lock] = []
        try:
            for lock in locks:
                lock.acquire()
                acquired.append(lock)
            yield
        finally:
            for lock in reversed(acquired):
                lock.release()
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

    def open(self) -> None:
        self._descriptor()

    def _descriptor(self) -> int:
        with self._open_guard:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            return self._fd

    @staticmethod
    def offset(key: str) -> int:
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> (64 - _OFFSET_BITS)

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        fd = self._descriptor()
        start = self.offset(key)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0))
        try:
            yield
        finally:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, start, 1, 0))

    @contextlib.contextmanager
    def hold_all(self, keys: Iterable[str]) -> Iterator[None]:
        """Every key, taken in sorted order (the one order every agent takes them in)."""
        with contextlib.ExitStack() as stack:
            for key in sorted(set(keys)):
                stack.enter_context(self.hold(key))
            yield

    def close(self) -> None:
        with self._open_guard:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


ClaimFileLock = KeyFileLock  # `<state>/claims.lock`, keyed by claim UID
CLAIMS_LOCK_FILE = "claims.lock"
DEVICES_LOCK_FILE = "devices.lock"  # keyed by device lock key (`pci/<bus>`, `device/<name>`)

"""A lock held by one holder alone, or by any number of holders at once in shared mode: the device
locks of claims that share a device (`agent.claims.locks`), and the agent's own file changes against
self-healing's judgment of them (`agent.ownchanges`).

A holder waiting to hold it alone goes before holders asking to share after it, so a stream of
sharers never starves it. Not reentrant: a thread that holds it must not ask for it again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class SharedLock:
    __slots__ = ("_alone", "_cond", "_shared", "_waiting_alone")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0  # holders sharing it
        self._alone = False  # held by one holder alone
        self._waiting_alone = 0

    def acquire(self, shared: bool, timeout: float | None = None) -> bool:
        """Wait for it, at most `timeout` seconds (None: as long as it takes); whether it was taken."""
        with self._cond:
            if shared:
                if not self._cond.wait_for(lambda: not (self._alone or self._waiting_alone), timeout):
                    return False
                self._shared += 1
                return True
            self._waiting_alone += 1
            taken = False
            try:
                taken = self._cond.wait_for(lambda: not (self._alone or self._shared), timeout)
            finally:
                self._waiting_alone -= 1
                if not taken:
                    self._cond.notify_all()  # the sharers it held back may go now
            self._alone = taken
            return taken

    def try_acquire(self, shared: bool) -> bool:
        """Take it if that needs no wait; whether it was taken."""
        with self._cond:
            if self._alone or (self._waiting_alone if shared else self._shared):
                return False
            if shared:
                self._shared += 1
            else:
                self._alone = True
            return True

    def release(self, shared: bool) -> None:
        with self._cond:
            if shared:
                self._shared -= 1
            else:
                self._alone = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self, shared: bool) -> Iterator[None]:
        self.acquire(shared)
        try:
            yield
        finally:
            self.release(shared)

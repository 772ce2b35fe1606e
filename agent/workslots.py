"""Slots: how many claim operations run Python at once, and the rule that a waiting one holds none.

A claim operation runs whole in one thread (`agent.engine.prepare`), and a few threads at once are
enough: more only hand the GIL to each other (docs/benchmarks.md, "Where the agent spends its time").
But some operations wait, for seconds, on something that is not this process's work: a driver letting
go of a PCI function, a write the kernel holds, another claim's lock (the kubelet asking again for a
claim still being prepared, or a device another claim is changing). A thread that waits so lets its
slot go for the time of the wait (`waiting`), and takes one again before it goes on: the other claims
never wait behind a slow device's.

No deadlock: a thread waits for a slot only holding nothing (`Slots.run`) or on leaving a wait, when
it may hold locks: a claim's or a device's (`agent.claims.locks`, the gate of a shared one's byte
among them), the binding writes' (`agent.host.vfio.bind`, `agent.host.mdev.sysfs`). Every way of
taking such a lock, on the way in and on the way out alike, lets the taker's slot go while it waits
(`take`, `waiting`), so the threads that hold slots never wait for it holding theirs.

A thread not run by `Slots.run` (start-up recovery, garbage collection, the tests' own calls) holds no
slot; `waiting` is then nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, Protocol, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")

_local = threading.local()  # .slots: the Slots whose slot this thread holds, or None


class Slots:
    def __init__(self, size: int) -> None:
        self.size = size
        self._free = threading.Semaphore(size)
        self._guard = threading.Lock()
        self.running = 0  # slots held now (for tests and reports)
        self.most = 0  # the most held at once

    def run(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`fn` in this thread, holding a slot (blocking until one is free) except while it waits."""
        if getattr(_local, "slots", None) is not None:
            raise RuntimeError("this thread holds a slot already")
        self._take()
        _local.slots = self
        try:
            return fn(*args, **kwargs)
        finally:
            _local.slots = None
            self._give()

    def _take(self) -> None:
        self._free.acquire()
        with self._guard:
            self.running += 1
            self.most = max(self.most, self.running)

    def _give(self) -> None:
        with self._guard:
            self.running -= 1
        self._free.release()


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a wait for something other than this thread's own work: its slot (if it holds one) is
    another thread's meanwhile, and taken again (waiting for one if need be) when the wait is over."""
    slots: Slots | None = getattr(_local, "slots", None)
    if slots is None:
        yield
        return
    _local.slots = None  # a wait within the wait lets nothing go twice
    slots._give()
    try:
        yield
    finally:
        slots._take()
        _local.slots = slots


class _Lock(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...


def take(lock: _Lock, timeout: float = -1) -> bool:
    """`lock.acquire(timeout=timeout)`, letting this thread's slot go if it has to wait."""
    if lock.acquire(blocking=False):
        return True
    with waiting():
        return lock.acquire(timeout=timeout)

"""Slots: how many claim operations run Python at once, and the rule that a waiting one holds none.

A claim operation runs whole in one thread (`agent.engine.prepare`), and a few threads at once are
enough: more only hand the GIL to each other (docs/benchmarks.md, "Where the agent spends its time").
But some operations wait, for seconds, on something that is not this process's work: a driver letting
go of a PCI function, a write the kernel holds, another claim's lock (the kubelet asking again for a
claim still being prepared, or a device another claim is changing). A thread that waits so lets its
slot go for the time of the wait (`waiting`), and takes one again before it goes on: the other claims
never wait behind a slow device's.

An operation waits for its first slot on the event loop (`Slots.acquire`), holding no thread: a burst
of claims makes no more threads than run at once. A thread back from a wait waits for a slot in
itself, and goes before the operations not started yet (it may hold locks they need).

No deadlock: a thread waits for a slot only on leaving a wait, when it may hold locks: a claim's or a
device's (`agent.claims.locks`, the gate of a shared one's byte among them), the binding writes'
(`agent.host.vfio.bind`, `agent.host.mdev.sysfs`). Every way of taking such a lock, on the way in and
on the way out alike, lets the taker's slot go while it waits (`take`, `waiting`; most after a short
patience, `PATIENCE`), so the threads that hold slots never wait for ever holding theirs; and an
operation given a slot gets a thread to run in (the claims' pool makes one for each, up to
`agent.engine.prepare.CLAIM_THREADS`).

Most waits are over within milliseconds (another claim's operation on a device, a sysfs write, a
binding's effect): a thread waits `PATIENCE` holding its slot, and lets it go only if the wait goes on.

A thread not run by `Slots.holding` (start-up recovery, garbage collection, the tests' own calls) holds no
slot; `waiting` is then nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

_T = TypeVar("_T")

_local = threading.local()  # .slots: the Slots whose slot this thread holds, or None
# Seconds a thread waits holding its slot before it lets it go: most waits (another claim's operation on a
# device, a sysfs write, a binding's effect) are over sooner, and a slot let go and taken back is two
# hand-overs more.
PATIENCE = 0.05


class Slots:
    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._free = size
        self._threads: collections.deque[threading.Lock] = collections.deque()  # back from a wait: first
        self._calls: collections.deque[asyncio.Future[None]] = collections.deque()  # not started yet
        self.most = 0  # the most slots held at once (for tests and reports)

    @property
    def running(self) -> int:
        """Slots held now."""
        return self.size - self._free

    @property
    def back(self) -> int:
        """Threads back from a wait, waiting for a slot."""
        with self._lock:
            return len(self._threads)

    async def acquire(self) -> None:
        """A slot for an operation about to start, on the event loop; its thread then holds it
        (`holding`), and whoever acquired it gives it back (`release`) once the operation is done."""
        with self._lock:
            if self._free > 0:
                self._held()
                return
            call = asyncio.get_running_loop().create_future()
            self._calls.append(call)
        try:
            await call
        except asyncio.CancelledError:
            with self._lock:
                if call in self._calls:
                    self._calls.remove(call)
                    raise
            if call.done() and not call.cancelled():  # given it, then cancelled: it goes to the next
                self.release()
            raise  # (given it as it was cancelled: `_give` passes it on)

    def holding(self, fn: Callable[[], _T]) -> _T:
        """`fn` in this thread, which holds the slot `acquire` took for it (and lets it go while it
        waits); the slot is not given back here."""
        _local.slots = self
        try:
            return fn()
        finally:
            _local.slots = None

    def release(self) -> None:
        """Give a slot back: to a thread back from a wait, else to the operation that asked first."""
        with self._lock:
            if self._threads:
                self._threads.popleft().release()  # the slot changes hands
                return
            if not self._calls:
                self._free += 1
                return
            call = self._calls.popleft()
        loop = call.get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is running:
            self._give(call)
            return
        try:
            loop.call_soon_threadsafe(self._give, call)
        except RuntimeError:  # its loop is closed: nobody waits there any more
            self.release()

    def _give(self, call: asyncio.Future[None]) -> None:  # on the call's loop
        if call.cancelled():
            self.release()
        else:
            call.set_result(None)

    def _take_back(self) -> None:
        """A slot for this thread, back from a wait (blocking until one is free)."""
        with self._lock:
            if self._free > 0:
                self._held()
                return
            turn = threading.Lock()
            turn.acquire()
            self._threads.append(turn)
        turn.acquire()  # released by the thread that hands its slot over

    def _held(self) -> None:  # the lock held
        self._free -= 1
        self.most = max(self.most, self.size - self._free)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a wait for something other than this thread's own work: its slot (if it holds one) is
    another operation's meanwhile, and taken again (waiting for one if need be) when the wait is over."""
    slots: Slots | None = getattr(_local, "slots", None)
    if slots is None:
        yield
        return
    _local.slots = None  # a wait within the wait lets nothing go twice
    slots.release()
    try:
        yield
    finally:
        slots._take_back()
        _local.slots = slots


class _Lock(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...


def take(lock: _Lock, timeout: float = -1) -> bool:
    """`lock.acquire(timeout=timeout)`, letting this thread's slot go if it waits longer than PATIENCE."""
    first = PATIENCE if timeout < 0 else min(PATIENCE, timeout)
    if lock.acquire(timeout=first):
        return True
    with waiting():
        return lock.acquire(timeout=-1 if timeout < 0 else max(0.0, timeout - first))


def wait_until(done: Callable[[], bool], deadline: float, poll: float) -> bool:
    """Ask `done` every `poll` seconds until it says so (True) or `deadline` (time.monotonic()) passes
    (False); after PATIENCE seconds, without this thread's slot."""
    patient_until = time.monotonic() + PATIENCE
    while not done():
        now = time.monotonic()
        if now >= deadline:
            return False
        if now >= patient_until:
            with waiting():
                return _until(done, deadline, poll)
        time.sleep(poll)
    return True


def _until(done: Callable[[], bool], deadline: float, poll: float) -> bool:
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True

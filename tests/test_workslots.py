"""The claims' slots (agent/workslots.py): at most N operations run at once, one that waits lets its
slot go, a thread back from a wait goes before the operations not started yet, and a cancelled call
never keeps a slot. Handshakes only: each operation says where it is and waits to be let go."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent.workslots import Slots, take, waiting

LIMIT = 60.0  # seconds any handshake may take before the test fails (never reached when it passes)


async def until(check: Callable[[], bool]) -> None:
    for _ in range(int(LIMIT / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never")


class Ops:
    """Operations run as the engine runs them (`PrepareEngine._in_worker`), in a pool of their own."""

    def __init__(self, size: int) -> None:
        self.slots = Slots(size)
        self.pool = ThreadPoolExecutor(16)
        self.order: list[str] = []
        self.arrived = threading.Condition()

    async def run(self, fn: Callable[[], object]) -> object:
        await self.slots.acquire()
        work = self.pool.submit(self.slots.holding, fn)
        try:
            return await asyncio.wrap_future(work)
        finally:
            if work.done():
                self.slots.release()
            else:
                work.add_done_callback(lambda _: self.slots.release())

    def note(self, what: str) -> None:
        with self.arrived:
            self.order.append(what)
            self.arrived.notify_all()

    async def reached(self, *what: str) -> None:
        def wait() -> bool:
            with self.arrived:
                return self.arrived.wait_for(lambda: all(w in self.order for w in what), LIMIT)
        assert await asyncio.to_thread(wait), f"{what} not reached; order: {self.order}"

    def blocked(self, name: str, gate: threading.Event, *, wait_without_slot: bool = False) -> Callable[[], str]:
        def fn() -> str:
            self.note(f"{name} started")
            if wait_without_slot:
                with waiting():
                    assert gate.wait(LIMIT)
            else:
                assert gate.wait(LIMIT)
            self.note(f"{name} done")
            return name
        return fn


async def test_at_most_the_slots_run_at_once() -> None:
    ops, gate = Ops(2), threading.Event()
    calls = [asyncio.create_task(ops.run(ops.blocked(f"op{i}", gate))) for i in range(5)]
    await ops.reached("op0 started", "op1 started")
    await asyncio.sleep(0)  # (the others stay queued on the loop: nothing more may start)
    assert ops.slots.running == 2 and [o for o in ops.order if o.endswith("started")] == ["op0 started", "op1 started"]
    gate.set()
    assert await asyncio.gather(*calls) == [f"op{i}" for i in range(5)]
    assert ops.slots.most == 2 and ops.slots.running == 0


async def test_an_operation_that_waits_lets_its_slot_go_and_goes_first_when_back() -> None:
    ops = Ops(1)
    slow_gate, second_gate, third_gate = threading.Event(), threading.Event(), threading.Event()
    slow = asyncio.create_task(ops.run(ops.blocked("slow", slow_gate, wait_without_slot=True)))
    await ops.reached("slow started")
    second = asyncio.create_task(ops.run(ops.blocked("second", second_gate)))
    await ops.reached("second started")  # the one slot is the second's while the slow one waits
    third = asyncio.create_task(ops.run(ops.blocked("third", third_gate)))
    slow_gate.set()  # back from its wait, the slow one waits for the slot, ahead of the third
    await until(lambda: ops.slots.back == 1)
    second_gate.set()
    third_gate.set()
    assert await asyncio.gather(slow, second, third) == ["slow", "second", "third"]
    assert ops.order.index("slow done") < ops.order.index("third started")
    assert ops.slots.most == 1 and ops.slots.running == 0


async def test_a_cancelled_call_keeps_no_slot() -> None:
    ops, gate = Ops(1), threading.Event()
    running = asyncio.create_task(ops.run(ops.blocked("running", gate)))
    await ops.reached("running started")
    queued = asyncio.create_task(ops.run(ops.blocked("queued", threading.Event())))
    await asyncio.sleep(0)
    queued.cancel()  # never started: it holds nothing
    running.cancel()  # its thread goes on, and gives the slot back when done
    for task in (queued, running):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert ops.slots.running == 1
    gate.set()
    assert await ops.run(lambda: "next") == "next"
    assert "queued started" not in ops.order and ops.slots.running == 0


async def test_a_lock_taken_by_a_thread_without_a_slot_is_no_deadlock() -> None:
    # One slot. The first operation holds a lock and waits without its slot; the second, holding the
    # slot, needs that lock: `take` lets the slot go while it waits, so the first can take the slot back
    # and finish, and then the second.
    ops, lock, let_go = Ops(1), threading.Lock(), threading.Event()

    def first() -> str:
        assert take(lock)
        try:
            ops.note("first holds the lock")
            with waiting():
                assert let_go.wait(LIMIT)
            return "first"
        finally:
            lock.release()

    def second() -> str:
        ops.note("second started")
        assert take(lock, timeout=LIMIT)
        lock.release()
        return "second"

    one = asyncio.create_task(ops.run(first))
    await ops.reached("first holds the lock")
    two = asyncio.create_task(ops.run(second))
    await ops.reached("second started")
    let_go.set()
    assert await asyncio.wait_for(asyncio.gather(one, two), LIMIT) == ["first", "second"]


def test_waiting_outside_an_operation_is_nothing() -> None:
    with waiting():
        pass
    lock = threading.Lock()
    assert take(lock) and not take(lock, timeout=0)

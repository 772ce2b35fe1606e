"""Ways for a test to know that something has happened, or that nothing more can happen, without
sleeping: a condition polled to a bound, the agent's worker threads drained, a thread seen waiting
for a claim's lock in the kernel's lock table, a metric read from the exposition text.

A sleep only guesses how long the agent needs; on a loaded machine the guess is wrong, and a test
that asserts "nothing happened" after a sleep passes whether or not the thing would have happened.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent import failpoints
from agent.claims.locks import ClaimFileLock

T = TypeVar("T")
BOUND = 30.0  # how long a condition may take to come true on a loaded machine: a bound, never an expectation


async def until(probe: Callable[[], T], what: str, limit: float = BOUND, every: float = 0.01) -> T:
    """Poll `probe` until it returns something truthy (and return that); fail naming `what` once
    `limit` seconds pass. The polling interval only bounds the latency of noticing."""
    deadline = time.monotonic() + limit
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit:g}s")
        await asyncio.sleep(every)
    return value


async def paused(step: str, count: int = 1) -> None:
    """Until `count` threads are held at the failpoint `step` (configured `step=pause`)."""
    await asyncio.to_thread(failpoints.wait_paused, step, count)


class Workers:
    """The event loop's worker threads, owned by the test (installed as the loop's default executor).

    An operation cut off at the kubelet's deadline goes on in its worker thread; `drained()` returns
    once every piece of work handed to the threads so far has ended, so a test can then assert what
    is left on disk knowing that nothing still running can change it."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="test-io")
        self.loop.set_default_executor(self.pool)

    async def drained(self) -> None:
        old, self.pool = self.pool, ThreadPoolExecutor(max_workers=32, thread_name_prefix="test-io")
        self.loop.set_default_executor(self.pool)  # new work goes to the new threads
        with ThreadPoolExecutor(max_workers=1) as side:
            await self.loop.run_in_executor(side, old.shutdown, True)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def claim_lock_waiters(state_dir: Path, uid: str) -> int:
    """How many lock requests wait now, in the kernel's lock table (/proc/locks), for the claim's
    lock across agents (`ClaimFileLock` on `<state>/claims.lock`): a second agent's thread that has
    reached the claim and waits for the agent in the middle of an operation on it."""
    inode = os.stat(state_dir / "claims.lock").st_ino
    offset = ClaimFileLock.offset(uid)
    waiting = 0
    with open("/proc/locks") as table:
        for line in table:
            fields = line.split()
            if len(fields) < 8 or fields[1] != "->":
                continue
            # "<id>: -> OFDLCK ADVISORY WRITE <pid> <major>:<minor>:<inode> <start> <end>"
            if fields[6].rsplit(":", 1)[-1] == str(inode) and fields[7] == str(offset):
                waiting += 1
    return waiting


def metric(registry: CollectorRegistry, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """A sample of the agent's metrics as its /metrics endpoint shows them (the exposition text of
    its registry); None when there is no such sample."""
    wanted = dict(labels or {})
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == wanted:
                return float(sample.value)
    return None

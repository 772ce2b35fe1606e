"""The measurements, each over one or more sides (a driver and the kubelet client that calls it),
taken in turn: one call to the agent, one to the peer, and the order swapped every sample, so
both see the same machine conditions."""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from drivers import Driver
from probes import Call, timed

from agent.kubelet import client as kc
from agent.names import ClaimRef


@dataclass
class Side:
    name: str  # "ours" or "peer": the prefix of its figures
    driver: Driver
    client: kc.DRAClient


async def prepare(side: Side, refs: Sequence[ClaimRef]) -> None:
    r = await side.client.prepare(refs)
    bad = [f"{uid}: {c.error}" for uid, c in r.claims.items() if c.error]
    if bad or len(r.claims) != len(refs):
        raise SystemExit(f"{side.name}: prepare failed: {bad[:1] or 'answers missing'}")


async def unprepare(side: Side, refs: Sequence[ClaimRef]) -> None:
    r = await side.client.unprepare(refs)
    bad = [f"{uid}: {c.error}" for uid, c in r.claims.items() if c.error]
    if bad:
        raise SystemExit(f"{side.name}: unprepare failed: {bad[0]}")


def _turns(items: Sequence[Side], i: int) -> Sequence[Side]:
    return items if i % 2 == 0 else list(reversed(items))


@dataclass
class RoundTrips:
    prepare: list[float]
    unprepare: list[float]

    @property
    def both(self) -> list[float]:
        return [p + u for p, u in zip(self.prepare, self.unprepare, strict=True)]


async def round_trips(sides: Sequence[Side], ref: ClaimRef, n: int,
                      probes: dict[str, Call] | None = None) -> tuple[dict[str, RoundTrips], dict[str, list[float]]]:
    """Prepare + unprepare of `ref` `n` times on each side in turn (milliseconds); each probe (a
    call to the floor server) is sampled once per turn, under the same conditions."""
    out = {s.name: RoundTrips([], []) for s in sides}
    probed: dict[str, list[float]] = {name: [] for name in probes or {}}
    for _ in range(10):
        for s in sides:
            await prepare(s, [ref])
            await unprepare(s, [ref])
    for i in range(n):
        for name, call in (probes or {}).items():
            probed[name].append(await timed(call))
        for s in _turns(sides, i):
            out[s.name].prepare.append(await timed(functools.partial(prepare, s, [ref])))
            out[s.name].unprepare.append(await timed(functools.partial(unprepare, s, [ref])))
    return out, probed


async def empty_calls(sides: Sequence[Side], n: int) -> dict[str, list[float]]:
    """NodePrepareResources without claims (milliseconds): the cost of a call to each server."""
    out: dict[str, list[float]] = {s.name: [] for s in sides}
    for _ in range(10):
        for s in sides:
            await s.client.prepare([])
    for i in range(n):
        for s in _turns(sides, i):
            out[s.name].append(await timed(functools.partial(s.client.prepare, [])))
    return out


async def fill(side: Side, refs: Sequence[ClaimRef]) -> float:
    """Prepare `refs` in calls of 64 claims; seconds taken."""
    started = time.perf_counter()
    for i in range(0, len(refs), 64):
        await prepare(side, refs[i:i + 64])
    return time.perf_counter() - started


async def serial_and_concurrent(sides: Sequence[Side], refs: Sequence[ClaimRef],
                                rounds: int) -> dict[str, tuple[float, float]]:
    """Seconds (median of `rounds`) to prepare `refs`, one claim per call: one call at a time, and
    every call at once. Each round unprepares them all again, untimed."""
    times: dict[str, tuple[list[float], list[float]]] = {s.name: ([], []) for s in sides}

    async def one_at_a_time(s: Side) -> None:
        for ref in refs:
            await prepare(s, [ref])

    async def all_at_once(s: Side) -> None:
        await asyncio.gather(*(prepare(s, [ref]) for ref in refs))

    async def undo(s: Side) -> None:
        await asyncio.gather(*(unprepare(s, [ref]) for ref in refs))

    for i in range(rounds):
        for s in _turns(sides, i):
            for way, samples in ((one_at_a_time, times[s.name][0]), (all_at_once, times[s.name][1])):
                started = time.perf_counter()
                await way(s)
                samples.append(time.perf_counter() - started)
                await undo(s)
    return {name: (statistics.median(a), statistics.median(b)) for name, (a, b) in times.items()}

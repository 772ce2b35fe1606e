"""The health stream as the kubelet keeps it: the agent's handler feeding a model of the kubelet's
health cache (docs/contract.md §3), on an event loop whose clock jumps to its next timer instead
of sleeping, so hours of the stream take milliseconds and every moment is checked."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest
from agentkit import NODE, nic

from agent.health.conditions import DeviceConditions
from agent.health.policy import TaintPolicy
from agent.inventory import Snapshot
from agent.kubelet.health import GONE, HEALTH_TIMEOUT, HEALTHY, UNHEALTHY, HealthTracker
from agent.kubelet.server import _Health
from agent.metrics import Metrics
from agent.model import Device
from agent.pb import health_v1_pb2 as pb

KUBELET_DEFAULT_TIMEOUT = 30


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0


class _JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Answers at once what is ready; where the loop would sleep until its next timer, moves the clock
    there instead. With nothing ready and no timer the test has nothing left to wait for: an error."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("the test waits for something no timer or I/O will bring")
        self.clock.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.clock = _Clock()
        super().__init__(_JumpingSelector(self.clock))

    def time(self) -> float:
        return self.clock.now


def run_virtual(main: Callable[[VirtualTimeLoop], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        loop = runner.get_loop()
        assert isinstance(loop, VirtualTimeLoop)
        runner.run(main(loop))


@dataclass
class _Entry:
    health: int
    message: str
    timeout: float
    updated: float


class KubeletHealthCache:
    """The kubelet's rules (docs/contract.md §3): a reported device is stamped with the time of
    arrival; it reads Unknown once that is older than its timeout (30 s when 0); a device left out
    of a report is kept until its timeout, then dropped (reading Unknown)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.devices: dict[str, _Entry] = {}

    def receive(self, response: Any) -> None:
        now = self.clock()
        reported = set()
        for d in response.devices:
            timeout = d.health_check_timeout_seconds if d.health_check_timeout_seconds > 0 else KUBELET_DEFAULT_TIMEOUT
            self.devices[d.device.device_name] = _Entry(d.health, d.message, timeout, now)
            reported.add(d.device.device_name)
        for name, entry in list(self.devices.items()):
            if name not in reported and now - entry.updated > entry.timeout:
                del self.devices[name]

    def health(self, name: str) -> int:
        entry = self.devices.get(name)
        if entry is None or self.clock() - entry.updated > entry.timeout:
            return int(pb.UNKNOWN)
        return entry.health


def snapshot(*devices: Device) -> Snapshot:
    return Snapshot(devices={d.name: d for d in devices}, failed_devices=[], problems=[], failing_sources=[],
                    unknown={}, taken_at=0.0)


NIC_A = nic("nic-a", "ens1f0", "02:00:00:00:00:01")
NIC_B = nic("nic-b", "ens1f1", "02:00:00:00:00:02")


class Feed:
    """The agent's gRPC handler read by the kubelet model, each response kept with its time."""

    def __init__(self, tracker: HealthTracker, loop: VirtualTimeLoop) -> None:
        self.cache = KubeletHealthCache(loop.time)
        self.responses: list[tuple[float, Any]] = []
        self.arrived = asyncio.Event()
        self._loop = loop
        self._task = asyncio.create_task(self._read(tracker))

    async def _read(self, tracker: HealthTracker) -> None:
        async for response in _Health(tracker, pb, Metrics(process=False)).NodeWatchResources(None, None):
            self.cache.receive(response)
            self.responses.append((self._loop.time(), response))
            self.arrived.set()

    async def next(self) -> Any:
        self.arrived.clear()
        await self.arrived.wait()
        return self.responses[-1][1]

    async def close(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


def test_a_reported_device_never_reads_unknown_in_the_kubelet() -> None:
    async def main(loop: VirtualTimeLoop) -> None:
        tracker = HealthTracker(pool=NODE)
        await tracker.update(snapshot(NIC_A, NIC_B))
        feed = Feed(tracker, loop)
        await feed.next()
        start = loop.time()
        # Busy for a while (a change every 7 s), then two hours without any change.
        flip = False
        while loop.time() - start < 2 * 3600:
            await asyncio.sleep(1)  # virtual: one sample of the kubelet's view per second
            assert feed.cache.health("nic-a") == pb.HEALTHY, f"nic-a decayed at +{loop.time() - start:.0f}s"
            if loop.time() - start < 600 and int(loop.time() - start) % 7 == 0:
                flip = not flip
                await tracker.update(snapshot(NIC_A, nic(NIC_B.name, "ens1f1", "02:00:00:00:00:02",
                                                          ips=("10.0.0.6/24",) if flip else ("10.0.0.5/24",))))
        await feed.close()
        assert all(len(r.devices) == 2 for _, r in feed.responses)  # the complete list, every time
        assert {d.health_check_timeout_seconds for _, r in feed.responses for d in r.devices} == {HEALTH_TIMEOUT}
        gaps = [b - a for (a, _), (b, _) in zip(feed.responses, feed.responses[1:], strict=False)]
        assert max(gaps) <= HEALTH_TIMEOUT / 3  # two sends may come late, and still nothing decays

    run_virtual(main)


@pytest.mark.parametrize(("timeout", "interval"), [(30, 30), (60, 90), (0, None), (20, 0)])
def test_a_resend_interval_not_within_the_timeout_is_refused(timeout: int, interval: float | None) -> None:
    with pytest.raises(ValueError, match="within its timeout"):
        HealthTracker(pool=NODE, timeout_seconds=timeout, interval=interval)


def test_a_device_gone_from_discovery_is_reported_until_the_published_pool_drops_it() -> None:
    async def main(loop: VirtualTimeLoop) -> None:
        tracker = HealthTracker(pool=NODE)
        await tracker.update(snapshot(NIC_A, NIC_B))
        feed = Feed(tracker, loop)
        await feed.next()

        assert await tracker.update(snapshot(NIC_A))  # nic-b unplugged
        report = {d.device.device_name: d for d in (await feed.next()).devices}
        assert report["nic-b"].health == pb.UNHEALTHY and report["nic-b"].message == GONE
        assert report["nic-b"].health_check_timeout_seconds == HEALTH_TIMEOUT
        assert await tracker.update(snapshot(NIC_A)) is False  # still gone: nothing new

        # A sync that began before it went still publishes it: it stays reported, for any time.
        tracker.pool_published(["nic-a", "nic-b"])
        for _ in range(10):
            report = {d.device.device_name: d for d in (await feed.next()).devices}
            assert report["nic-b"].health == pb.UNHEALTHY
            assert feed.cache.health("nic-b") == pb.UNHEALTHY

        # Published without it: left out from the next report on; the kubelet keeps its last word
        # for one timeout, then reads Unknown and forgets it.
        last_with = feed.responses[-1][0]
        tracker.pool_published(["nic-a"])
        assert [h.device for h in tracker.current()] == ["nic-a"]
        while loop.time() - last_with < 2 * HEALTH_TIMEOUT:
            await asyncio.sleep(1)
            expected = pb.UNHEALTHY if loop.time() - last_with <= HEALTH_TIMEOUT else pb.UNKNOWN
            assert feed.cache.health("nic-b") == expected
        assert all([d.device.device_name for d in r.devices] == ["nic-a"] for t, r in feed.responses if t > last_with)
        assert "nic-b" not in feed.cache.devices and feed.cache.health("nic-a") == pb.HEALTHY

        # Back again: HEALTHY, and not dropped by a later publish.
        assert await tracker.update(snapshot(NIC_A, NIC_B))
        tracker.pool_published(["nic-a"])
        assert {h.device: h.status for h in tracker.current()} == {"nic-a": HEALTHY, "nic-b": HEALTHY}
        await feed.close()

    run_virtual(main)


def test_a_gone_device_keeps_the_cause_it_was_unhealthy_for() -> None:
    async def main(loop: VirtualTimeLoop) -> None:
        tracker = HealthTracker(pool=NODE)
        conditions = DeviceConditions("dra.example.com", TaintPolicy())
        conditions.link("nic-b", False)
        await tracker.update(snapshot(NIC_A, NIC_B), conditions)
        await tracker.update(snapshot(NIC_A), conditions)
        status, message = {h.device: (h.status, h.message) for h in tracker.current()}["nic-b"]
        assert status == UNHEALTHY and message.startswith("link down since")

    run_virtual(main)

"""The inventory over sources that fail: last good results kept, failures typed and reported,
retries with backoff, and scans that finish out of order."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from agentkit import StaticSource, cpu, nic, roots
from conftest import need_command, need_root
from handshakes import until
from netns import NetNS, network_namespace

import agent.inventory as inventory_mod
from agent.app.daemon import Agent
from agent.config import NvmlMode, Settings
from agent.inventory import Inventory, ScanError, ScanResult
from agent.inventory import netlink as netlink_mod
from agent.inventory.gpus import GpuSource
from agent.inventory.netlink import DumpInterrupted
from agent.kubelet.health import HEALTHY, UNHEALTHY, UNKNOWN, HealthTracker
from agent.kubelet.server import Healthv1, Healthv1alpha1
from agent.metrics import Metrics
from agent.model import Device
from agent.pb import health_v1_pb2, health_v1alpha1_pb2
from agent.sim.nvmlopen import open_sim_nvml


class FlakySource:
    """A source that returns its devices, or raises `error` while one is set."""

    def __init__(self, kind: str, devices: Sequence[Device]) -> None:
        self.kind = kind
        self.devices = list(devices)
        self.error: Exception | None = None
        self.scans = 0

    def open(self) -> None:
        pass

    def scan(self) -> ScanResult:
        self.scans += 1
        if self.error is not None:
            raise self.error
        return ScanResult(devices=list(self.devices))

    def close(self) -> None:
        pass


class GatedSource:
    """Each scan call blocks until the test opens its gate, then returns (or raises) what the test
    queued for that call: the order in which concurrent scans finish is the test's to choose."""

    def __init__(self, kind: str, outcomes: Sequence[ScanResult | Exception]) -> None:
        self.kind = kind
        self.outcomes = list(outcomes)
        self.gates = [threading.Event() for _ in outcomes]
        self.entered = [threading.Event() for _ in outcomes]
        self.calls = 0
        self._lock = threading.Lock()

    def open(self) -> None:
        pass

    def scan(self) -> ScanResult:
        with self._lock:
            call = self.calls
            self.calls += 1
        self.entered[call].set()
        if not self.gates[call].wait(timeout=30):
            raise AssertionError(f"gate {call} was never opened")
        outcome = self.outcomes[call]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def wait_entered(self, call: int) -> None:
        """Until scan call number `call` (from 0) is running."""
        assert await asyncio.to_thread(self.entered[call].wait, 10), f"scan call {call} never started"

    def close(self) -> None:
        for gate in self.gates:
            gate.set()  # never leave a worker thread waiting


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


NIC_A = nic("nic-0000-3b-00-0", ifname="ens1f0")
NIC_B = nic("nic-0000-3b-00-1", ifname="ens1f1", mac="02:00:00:00:00:02")


# -- a failed scan keeps the last good result ---------------------------------------------------------


async def test_a_failing_source_keeps_its_last_good_devices(caplog: pytest.LogCaptureFixture) -> None:
    nics = FlakySource("nic", [NIC_A, NIC_B])
    inventory = Inventory([nics, StaticSource("cpu", [cpu()])])
    assert await inventory.scan()
    nics.error = OSError("sysfs went away")
    with caplog.at_level(logging.DEBUG, logger="agent.inventory"):
        for _ in range(5):
            assert await inventory.scan() is False  # nothing a consumer must act on
    assert [d.name for d in inventory.devices()] == ["cpu-numa0", "nic-0000-3b-00-0", "nic-0000-3b-00-1"]
    assert inventory.get("nic-0000-3b-00-1") == NIC_B
    [failure] = inventory.source_failures()
    assert (failure.kind, failure.failures, failure.stale) == ("nic", 5, False)
    assert "sysfs went away" in failure.reason
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per streak
    assert "keeping the 2 devices" in warnings[0].getMessage()
    snapshot = inventory.snapshot()
    assert snapshot.unknown == {} and snapshot.failed_devices == []
    assert any("nic discovery" in line and "5 failed scans" in line for line in snapshot.not_published())

    caplog.clear()
    nics.error = None
    nics.devices = [NIC_A]
    with caplog.at_level(logging.INFO, logger="agent.inventory"):
        assert await inventory.scan(["nic"])
    assert inventory.source_failures() == [] and inventory.get("nic-0000-3b-00-1") is None
    assert any("works again after 5 failed scans" in r.getMessage() for r in caplog.records)


async def test_a_source_failing_from_the_start_publishes_nothing_and_is_retried() -> None:
    nics = FlakySource("nic", [NIC_A])
    nics.error = ScanError("the netlink dump was interrupted 5 times in a row")
    inventory = Inventory([nics, StaticSource("cpu", [cpu()])])
    assert await inventory.scan()  # the CPUs are new
    assert [d.name for d in inventory.devices()] == ["cpu-numa0"]
    assert [f.kind for f in inventory.source_failures()] == ["nic"]
    nics.error = None
    assert await inventory.scan(["nic"])
    assert inventory.get("nic-0000-3b-00-0") == NIC_A


async def test_a_discovery_error_before_any_good_scan_still_propagates() -> None:
    nics = FlakySource("nic", [NIC_A])
    nics.error = inventory_mod.DiscoveryError("--nic-include is not a pattern")
    inventory = Inventory([nics])
    with pytest.raises(inventory_mod.DiscoveryError):
        await inventory.scan()
    # Once the source has worked, the same error is one more failed scan.
    nics.error = None
    await inventory.scan()
    nics.error = inventory_mod.DiscoveryError("transient")
    assert await inventory.scan() is False
    assert inventory.get("nic-0000-3b-00-0") == NIC_A


async def test_retries_back_off_exponentially_up_to_a_bound() -> None:
    clock = Clock()
    nics = FlakySource("nic", [NIC_A])
    inventory = Inventory([nics], clock=clock)
    await inventory.scan()
    nics.error = OSError("no")
    delays = []
    for _ in range(9):
        await inventory.scan()
        [failure] = inventory.source_failures()
        delays.append(failure.retry_at - clock.now)
        clock.now += 1
    first, most = inventory_mod.RETRY_FIRST, inventory_mod.RETRY_MAX
    assert delays == [min(first * 2 ** i, most) for i in range(9)]
    assert delays[-1] == most


async def test_wait_retry_says_which_kinds_are_due(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory_mod, "RETRY_FIRST", 0.05)
    waiting = asyncio.Event()
    waiter: asyncio.Task[list[str]] | None = None

    def clock() -> float:  # the inventory's clock, telling the test when the waiter reads it
        if waiter is not None and asyncio.current_task() is waiter:
            waiting.set()
        return time.monotonic()

    nics = FlakySource("nic", [NIC_A])
    inventory = Inventory([nics, StaticSource("cpu", [cpu()])], clock=clock)
    await inventory.scan()
    waiter = asyncio.create_task(inventory.wait_retry(0.05))
    assert await waiter == []  # nothing is failing: the time just runs out
    nics.error = OSError("no")
    waiting.clear()
    waiter = asyncio.create_task(inventory.wait_retry(10))
    await waiting.wait()  # it has looked (nothing failing: it waits the whole 10 s), and waits now
    await inventory.scan(["nic"])  # a failure recorded while someone waits wakes them in time
    assert await asyncio.wait_for(waiter, 2) == ["nic"]


class QuietNetlink:
    """The daemon's netlink watcher, with no events ever: only a retry can rescan the NICs."""

    iterating: asyncio.Event  # set by the test before the agent starts

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    async def start(self) -> None:
        pass

    async def events(self):  # type: ignore[no-untyped-def]
        QuietNetlink.iterating.set()  # (after the daemon's own NIC scan at the watch's start)
        await asyncio.Event().wait()
        yield

    async def close(self) -> None:
        pass


async def test_the_daemon_retries_a_failing_source_before_the_next_rescan(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch, agents) -> None:
    monkeypatch.setattr(inventory_mod, "RETRY_FIRST", 0.05)
    monkeypatch.setattr(inventory_mod, "RETRY_MAX", 0.2)
    nics = FlakySource("nic", [NIC_A])
    cpus = FlakySource("cpu", [cpu()])
    nics.error = OSError("no")
    monkeypatch.setattr("agent.app.daemon.build_sources", lambda s: [nics, cpus])
    monkeypatch.setattr("agent.inventory.netwatch.NetlinkWatcher", QuietNetlink)
    QuietNetlink.iterating = asyncio.Event()
    agent = Agent(roots(short_tmp, rescan_interval=3600.0))  # no periodic rescan within the test
    agents.append(agent)
    await agent.start()
    await asyncio.wait_for(QuietNetlink.iterating.wait(), 30)
    assert [f.kind for f in agent.inventory.source_failures()] == ["nic"] and agent.inventory.get(NIC_A.name) is None
    cpu_scans = cpus.scans
    nics.error, nics.devices = None, [NIC_B]
    await until(lambda: agent.inventory.get(NIC_B.name) == NIC_B, "the NICs retried")
    assert agent.inventory.source_failures() == []
    assert cpus.scans == cpu_scans  # only the failing kind was retried, not the whole node


# -- the NIC source: an interrupted netlink dump ------------------------------------------------------


def test_dump_gives_up_with_a_scan_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The links under a flood of changes: every dump is interrupted."""
    attempts = 0

    async def interrupted(*args: object) -> object:
        nonlocal attempts
        attempts += 1
        raise DumpInterrupted()

    monkeypatch.setattr(netlink_mod, "_dump_once", interrupted)
    with pytest.raises(ScanError, match="interrupted 5 times in a row"):
        netlink_mod.dump()
    assert attempts == 5


INTERRUPTED_SCAN = """
import asyncio, json, sys
from agent.config import build_settings
from agent.inventory import Inventory
from agent.inventory import netlink
from agent.inventory.netlink import DumpInterrupted
from agent.inventory.nics import NicSource

async def interrupted(*args):  # as in the test module: every dump is interrupted
    raise DumpInterrupted()

async def main():
    inventory = Inventory([NicSource(build_settings(json.loads(sys.argv[1])))])
    await inventory.scan()
    before = {d.name: d.node.interface for d in inventory.devices()}
    netlink._dump_once = interrupted
    changed = await inventory.scan(["nic"])
    after = {d.name: d.node.interface for d in inventory.devices()}
    found = {name: inventory.get(name) is not None for name in before}
    print(json.dumps({"before": before, "after": after, "found": found, "changed": changed,
                      "failures": [f.reason for f in inventory.source_failures()]}))

asyncio.run(main())
"""


@pytest.fixture
def ns() -> Iterator[NetNS]:
    need_root()
    need_command("ip")
    with network_namespace("dra-inv") as made:
        yield made


def test_an_interrupted_netlink_dump_keeps_the_nics(ns: NetNS) -> None:
    ns.veth("va", "vb")
    out = json.loads(ns.python(INTERRUPTED_SCAN, json.dumps({"nic_include": "va,vb"})))
    assert sorted(out["before"].values()) == ["va", "vb"]
    assert out["after"] == out["before"] and all(out["found"].values())
    assert out["changed"] is False
    assert len(out["failures"]) == 1 and "interrupted 5 times" in out["failures"][0]


# -- scans that finish out of order -------------------------------------------------------------------


@pytest.mark.parametrize("newer_first", [True, False])
async def test_concurrent_scans_keep_the_newer_result(newer_first: bool) -> None:
    older, newer = ScanResult(devices=[NIC_A]), ScanResult(devices=[NIC_B])
    source = GatedSource("nic", [older, newer])
    inventory = Inventory([source])
    try:
        first = asyncio.create_task(inventory.scan(["nic"]))
        await source.wait_entered(0)
        second = asyncio.create_task(inventory.scan(["nic"]))
        await source.wait_entered(1)
        for call in ((1, 0) if newer_first else (0, 1)):
            source.gates[call].set()
            await (second if call == 1 else first)
    finally:
        source.close()
    assert [d.name for d in inventory.devices()] == [NIC_B.name]
    assert inventory.get(NIC_A.name) is None


async def test_an_older_failure_finishing_late_is_not_a_failure() -> None:
    source = GatedSource("nic", [ScanResult(devices=[NIC_A]), OSError("stale"), ScanResult(devices=[NIC_B])])
    inventory = Inventory([source])
    try:
        source.gates[0].set()
        await inventory.scan()
        failing = asyncio.create_task(inventory.scan(["nic"]))
        await source.wait_entered(1)
        succeeding = asyncio.create_task(inventory.scan(["nic"]))
        await source.wait_entered(2)
        source.gates[2].set()
        assert await succeeding
        source.gates[1].set()
        assert await failing is False
    finally:
        source.close()
    assert inventory.source_failures() == []
    assert [d.name for d in inventory.devices()] == [NIC_B.name]


# -- the health stream --------------------------------------------------------------------------------


def statuses(tracker: HealthTracker) -> dict[str, str]:
    """By device, the passthrough variants (`*-vfio`, tests/test_passthrough_slices.py) aside."""
    return {h.device: h.status for h in tracker.current() if not h.device.endswith("-vfio")}


async def test_devices_of_a_source_failing_too_long_are_unknown_then_healthy_again() -> None:
    clock = Clock()
    nics = FlakySource("nic", [NIC_A, NIC_B])
    inventory = Inventory([nics, StaticSource("cpu", [cpu()])], stale_after=30.0, clock=clock)
    tracker = HealthTracker(pool="node-a")
    await inventory.scan()
    await tracker.update(inventory.snapshot())
    assert set(statuses(tracker).values()) == {HEALTHY}

    nics.error = ScanError("the netlink dump was interrupted 5 times in a row")
    assert await inventory.scan() is False
    clock.now += 29
    assert await inventory.scan() is False  # within the bound: the kept devices are still healthy
    assert await tracker.update(inventory.snapshot()) is False

    clock.now += 2
    assert await inventory.scan(["nic"]) is True  # past it: a change the daemon must pass on
    assert await tracker.update(inventory.snapshot())
    assert statuses(tracker) == {"cpu-numa0": HEALTHY, NIC_A.name: UNKNOWN, NIC_B.name: UNKNOWN}
    message = next(h.message for h in tracker.current() if h.device == NIC_A.name)
    assert "nic discovery has failed" in message and "interrupted 5 times" in message
    assert [d.name for d in inventory.devices()] == ["cpu-numa0", NIC_A.name, NIC_B.name]
    assert [f.stale for f in inventory.source_failures()] == [True]

    clock.now += 60
    assert await inventory.scan() is False  # already reported: nothing new
    assert await tracker.update(inventory.snapshot()) is False  # not even the message
    nics.error = None
    assert await inventory.scan(["nic"]) is True
    assert await tracker.update(inventory.snapshot())
    assert set(statuses(tracker).values()) == {HEALTHY}
    assert all(h.message == "" for h in tracker.current())


@pytest.mark.parametrize(("servicer", "pb"), [(Healthv1, health_v1_pb2), (Healthv1alpha1, health_v1alpha1_pb2)],
                         ids=["v1", "v1alpha1"])
async def test_the_grpc_health_handler_sends_unknown_as_unknown(servicer: type, pb: object) -> None:
    clock = Clock()
    nics = FlakySource("nic", [NIC_A])
    inventory = Inventory([nics], stale_after=1.0, clock=clock)
    tracker = HealthTracker(pool="node-a")
    await inventory.scan()
    nics.error = OSError("no")
    await inventory.scan()
    clock.now += 5
    await inventory.scan()
    await tracker.update(inventory.snapshot())
    stream = servicer(tracker, Metrics(process=False)).NodeWatchResources(None, None)
    response = await anext(stream)
    await stream.aclose()
    [device] = response.devices
    assert device.device.device_name == NIC_A.name
    assert device.health == pb.UNKNOWN != pb.HEALTHY  # type: ignore[attr-defined]
    assert "nic discovery has failed" in device.message


async def test_nvml_failing_to_count_keeps_the_gpus(tmp_path: Path) -> None:
    settings = Settings(node_name="node-a", nvml=NvmlMode("sim", "dgx-h100"), state_dir=tmp_path / "state")
    gpus = GpuSource(settings, opener=open_sim_nvml)
    inventory = Inventory([gpus])
    inventory.open()
    try:
        await inventory.scan()
        gpus.nvml.inject_error(None, "nvmlDeviceGetCount", "UNKNOWN")
        assert await inventory.scan() is False
    finally:
        inventory.close()
    assert len([d for d in inventory.devices() if d.kind == "gpu"]) == 8 and inventory.get("gpu-7") is not None
    [failure] = inventory.source_failures()
    assert failure.kind == "gpu" and "nvmlDeviceGetCount failed" in failure.reason


PROFILE = {"gpus": [
    {"name": "NVIDIA A100-SXM4-80GB", "busId": "0000:07:00.0", "memoryTotal": 85899345920},
    # Falls off the bus before NVML ever says its minor number: named only through the driver's list.
    {"name": "NVIDIA A100-SXM4-80GB", "busId": "0000:0f:00.0", "memoryTotal": 85899345920, "lost": True},
    # Says its minor number, then fails: a device known by name.
    {"name": "NVIDIA A100-SXM4-80GB", "busId": "0000:47:00.0", "memoryTotal": 85899345920,
     "errors": {"nvmlDeviceGetUUID": "NVML_ERROR_CORRUPTED_INFOROM"}},
]}


async def test_the_health_stream_names_only_devices(tmp_path: Path) -> None:
    profile = tmp_path / "faulty.json"
    profile.write_text(json.dumps(PROFILE))
    settings = Settings(node_name="node-a", nvml=NvmlMode("sim", str(profile)), state_dir=tmp_path / "state")
    inventory = Inventory([GpuSource(settings, opener=open_sim_nvml), StaticSource("nic", [NIC_A])])
    inventory.open()
    try:
        # Without the driver's GPU list (/proc/driver/nvidia/gpus) the lost GPU has no name.
        shutil.rmtree(tmp_path / "state" / "nvml-sim" / "proc")
        await inventory.scan()
    finally:
        inventory.close()
    snapshot = inventory.snapshot()
    assert [f.device for f in snapshot.failed_devices] == ["gpu-2"]
    assert [p.what for p in snapshot.problems] == ["GPU at NVML index 1"]
    tracker = HealthTracker(pool="node-a")
    await tracker.update(snapshot)
    assert statuses(tracker) == {"gpu-0": HEALTHY, "gpu-2": UNHEALTHY, NIC_A.name: HEALTHY}
    gpu2 = next(h for h in tracker.current() if h.device == "gpu-2")
    assert "Corrupted infoROM" in gpu2.message
    assert any(line.startswith("GPU at NVML index 1: ") for line in snapshot.not_published())

    # With the list, it is the GPU whose minor no answering GPU has: named, and UNHEALTHY.
    inventory = Inventory([GpuSource(settings, opener=open_sim_nvml), StaticSource("nic", [NIC_A])])
    inventory.open()
    try:
        await inventory.scan()
    finally:
        inventory.close()
    snapshot = inventory.snapshot()
    assert snapshot.problems == []
    await tracker.update(snapshot)
    assert statuses(tracker) == {"gpu-0": HEALTHY, "gpu-1": UNHEALTHY, "gpu-2": UNHEALTHY, NIC_A.name: HEALTHY}
    gpu1 = next(h for h in tracker.current() if h.device == "gpu-1")
    assert "GPU is lost" in gpu1.message and "0000:0f:00.0" in gpu1.message

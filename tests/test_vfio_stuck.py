"""A GPU unbind the NVIDIA driver holds never holds the node, through the engine on the simulated machine
(its kernel emulator holds an NVIDIA unbind while any process has the GPU's node open,
agent/sim/kernel/opengpus.py). The holder is a real process the agent's /proc view does not show (as
from a pod without hostPID), so the agent's own in-use check lets the unbind go: another claim's
passthrough goes on meanwhile, the stuck claim gets a clear error within its bound, and once the holder
is gone a retry puts things right. A driver whose remove is slow (the emulator's `unbind_hold`) holds its
claims only: more of them than the claims' slots (agent/workslots.py) leave the other claims to go on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from test_vfio_prepare import GPU_BUS, GPU_VARIANT, UID, UID2, VmNode, vm  # noqa: F401 (the fixture)

from agent.engine.prepare import CLAIM_WORKERS

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")

OTHER_BUS, OTHER_VARIANT = "0000:2a:00.0", "gpu-0000-2a-00-0-vfio"  # gpu-1 of dgx-h100


@pytest.fixture
def holder(vm: VmNode) -> Iterator[subprocess.Popen[str]]:  # noqa: F811
    """A process holding gpu-0's node open until its stdin is closed."""
    proc = subprocess.Popen([sys.executable, "-c", "import os, sys; fd = os.open(sys.argv[1], os.O_PATH); "
                             "print('holding', flush=True); sys.stdin.read()", str(vm.tree.dev / "nvidia0")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
    yield proc
    release(proc)


async def waiting_unbind(vm: VmNode, within: float = 60.0) -> None:  # noqa: F811
    """Until the simulated kernel says gpu-0's unbind waits for the GPU to be closed. The thread that
    looks gives up by itself: a thread left looking would hold the event loop's close for ever."""
    def look() -> bool:
        log, deadline = vm.tree.kernel_log, time.monotonic() + within
        while not (log.is_file() and f"unbind nvidia {GPU_BUS}: waits" in log.read_text()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True
    assert await asyncio.to_thread(look), f"the simulated kernel never said the unbind of {GPU_BUS} waits"


def release(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    proc.wait(30)


async def test_other_claims_go_on_while_an_unbind_waits_in_the_driver(
        vm: VmNode, holder: subprocess.Popen[str]) -> None:  # noqa: F811
    vm.node.engine.passthrough.timeout = 120.0  # far longer than the test: the holder is released first
    stuck = asyncio.create_task(vm.prepare("vm-stuck", UID, GPU_VARIANT))
    await waiting_unbind(vm)
    # Another GPU's passthrough, while gpu-0's unbind waits in the driver: it must not wait with it.
    other = await asyncio.wait_for(vm.prepare("vm-other", UID2, OTHER_VARIANT), 60)
    assert other.error == "" and vm.driver(OTHER_BUS) == "vfio-pci"
    assert not stuck.done() and vm.driver(GPU_BUS) == "nvidia"
    release(holder)  # the last holder closes the GPU: the driver finishes the unbind, the prepare goes on
    assert (await asyncio.wait_for(stuck, 60)).error == ""
    assert vm.driver(GPU_BUS) == "vfio-pci"
    assert await vm.unprepare("vm-stuck", UID) == "" and await vm.unprepare("vm-other", UID2) == ""
    assert vm.driver(GPU_BUS) == "nvidia" and vm.driver(OTHER_BUS) == "nvidia"


async def test_a_stuck_unbind_is_a_clear_error_and_a_retry_puts_it_right(
        vm: VmNode, holder: subprocess.Popen[str]) -> None:  # noqa: F811
    vm.node.engine.passthrough.timeout = 1.0
    res = await vm.prepare("vm-stuck", UID, GPU_VARIANT)
    assert f"unbind {GPU_BUS} from nvidia: not done after 1s" in res.error, res.error
    assert ("so one this agent cannot see does (is its /proc the host's? docs/deployment.md: The host's processes)"
            in res.error)
    assert vm.driver(GPU_BUS) == "nvidia"
    # The driver still holds the unbind: the rollback leaves the function alone and says so on the retry.
    again = await vm.prepare("vm-stuck", UID, GPU_VARIANT)
    assert "has not taken effect" in again.error and vm.driver(GPU_BUS) == "nvidia"
    release(holder)
    # The unbind is carried out late; the retry settles the interrupted prepare (back on nvidia, nothing
    # left unbound) and then prepares the claim.
    vm.node.engine.passthrough.timeout = 30.0
    assert (await vm.prepare("vm-stuck", UID, GPU_VARIANT)).error == ""
    assert vm.driver(GPU_BUS) == "vfio-pci"
    assert await vm.unprepare("vm-stuck", UID) == ""
    assert vm.driver(GPU_BUS) == "nvidia"


async def test_slow_driver_removes_hold_their_own_claims_only(vm: VmNode) -> None:  # noqa: F811
    # GPUs 0 to 4 of dgx-h100 passed through, their driver's remove held until the test lets it go: more
    # claims waiting on the host than there are slots to run claims in. The kubelet asks for one of them
    # again meanwhile (its call waits for the claim's lock). The other claims, several of each of GPUs 5
    # to 7 (each GPU's claims taking its lock in turn), must all be prepared while those wait.
    slow_buses = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0"]
    assert len(slow_buses) > CLAIM_WORKERS
    holding, let_go = threading.Semaphore(0), threading.Event()

    def hold(bdf: str) -> None:
        if bdf in slow_buses:
            holding.release()
            assert let_go.wait(120), "never let go"

    def variant(bus: str) -> str:
        return f"gpu-{bus.replace(':', '-').replace('.', '-')}-vfio"

    vm.kernel.unbind_hold = hold
    vm.node.engine.passthrough.timeout = 120.0  # far longer than the test: the holds are let go first
    slow_uids = [f"5e000000-0000-4000-8000-{i:012d}" for i in range(len(slow_buses))]
    slow = [asyncio.create_task(vm.prepare(f"vm-{i}", uid, variant(bus)))
            for i, (uid, bus) in enumerate(zip(slow_uids, slow_buses, strict=True))]
    try:
        assert await asyncio.to_thread(lambda: all(holding.acquire(timeout=60) for _ in slow_buses)), \
            "the unbinds were not all held"
        again = asyncio.create_task(vm.prepare("vm-0", slow_uids[0], variant(slow_buses[0])))
        others = await asyncio.wait_for(asyncio.gather(*(
            vm.prepare(f"pod-{i}", f"0d000000-0000-4000-8000-{i:012d}", f"gpu-{5 + i % 3}", request="gpu")
            for i in range(12))), 60)
        assert [r.error for r in others] == [""] * 12
        assert not any(t.done() for t in [*slow, again])
        assert all(vm.driver(bus) == "nvidia" for bus in slow_buses)
        assert vm.node.engine.slots.most <= CLAIM_WORKERS
    finally:
        let_go.set()
    assert [r.error for r in await asyncio.wait_for(asyncio.gather(*slow, again), 60)] == [""] * 6
    assert all(vm.driver(bus) == "vfio-pci" for bus in slow_buses)
    for i, uid in enumerate(slow_uids):
        assert await vm.unprepare(f"vm-{i}", uid) == ""
    assert all(vm.driver(bus) == "nvidia" for bus in slow_buses)

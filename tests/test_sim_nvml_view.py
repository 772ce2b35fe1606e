"""The simulated NVML models two facts of the real library (agent/sim/nvmlview.py): a handle holds its GPU
open (a descriptor on the GPU's node in this process, as /proc shows it, until the last nvmlShutdown; an
event registration until its set is freed), and a GPU the NVIDIA driver no longer drives is not listed
by the next nvmlInit, the GPUs after it moving down an index."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pynvml
import pytest

from agent.sim.kernel.tree import SimTree
from agent.sim.nvml import SimulatedNvml


def held(node: Path) -> int:
    """How many descriptors of this process are on `node`."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in os.listdir(fds):
        try:
            count += os.readlink(fds / fd) == str(node)
        except OSError:
            continue
    return count


@pytest.fixture
def machine(tmp_path: Path) -> tuple[SimulatedNvml, SimTree]:
    sim = SimulatedNvml.from_profile("dgx-h100")
    sim.materialize(tmp_path)
    return sim, SimTree(tmp_path)


def test_a_handle_holds_its_gpu_open_until_the_last_shutdown(machine: tuple[SimulatedNvml, SimTree]) -> None:
    sim, tree = machine
    node = tree.dev / "nvidia0"
    sim.nvmlInit()
    sim.nvmlInit()
    assert held(node) == 0  # initialized, no handle yet
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlDeviceGetHandleByUUID(sim.nvmlDeviceGetUUID(handle))  # the same GPU: still one descriptor
    assert held(node) == 1 and held(tree.dev / "nvidia1") == 0
    event_set = sim.nvmlEventSetCreate()
    sim.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    assert held(node) == 2
    sim.nvmlEventSetFree(event_set)
    assert held(node) == 1
    sim.nvmlShutdown()
    assert held(node) == 1  # one initialization is left
    sim.nvmlShutdown()
    assert held(node) == 0


def test_a_gpu_off_the_nvidia_driver_is_not_listed_by_the_next_init(machine: tuple[SimulatedNvml, SimTree]) -> None:
    sim, tree = machine
    sim.nvmlInit()
    assert sim.nvmlDeviceGetCount() == 8
    gpu0 = tree.devices.joinpath("0000:18:00.0").resolve().name
    tree.unbind(gpu0)
    tree.bind(gpu0, "vfio-pci")
    assert sim.nvmlDeviceGetCount() == 8  # enumerated when initialized
    sim.nvmlShutdown()
    sim.nvmlInit()
    assert sim.nvmlDeviceGetCount() == 7
    first = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlDeviceGetMinorNumber(first) == 1 and sim.nvmlDeviceGetIndex(first) == 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetHandleByPciBusId("0000:18:00.0")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetHandleByIndex(7)
    assert held(tree.dev / "nvidia0") == 0
    tree.unbind(gpu0)
    tree.bind(gpu0, "nvidia")
    sim.nvmlShutdown()
    sim.nvmlInit()
    assert sim.nvmlDeviceGetCount() == 8 and sim.nvmlDeviceGetMinorNumber(sim.nvmlDeviceGetHandleByIndex(0)) == 0
    sim.nvmlShutdown()


def test_a_simulated_nvml_dropped_while_initialized_lets_go_of_its_gpus(tmp_path: Path) -> None:
    """The real library's descriptors close with its process. A SimulatedNvml is dropped while initialized
    (by a test that never shuts it down) within one long process: what it held stays open unless it closes
    it itself (a full test run reached descriptor 1973)."""
    sim = SimulatedNvml.from_profile("dgx-h100")
    sim.materialize(tmp_path)
    sim.nvmlInit()
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    sim.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, sim.nvmlEventSetCreate())
    sim.nvmlDeviceGetHandleByIndex(1)
    nodes = [SimTree(tmp_path).dev / f"nvidia{minor}" for minor in (0, 1)]
    assert [held(node) for node in nodes] == [2, 1]
    del sim, handle
    gc.collect()
    assert [held(node) for node in nodes] == [0, 0]

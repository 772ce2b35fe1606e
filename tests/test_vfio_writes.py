"""A binding write the kernel does not return from never holds the agent: an NVIDIA unbind blocks in the
driver while any process has the GPU open. Here the `unbind` file is a FIFO nobody reads, so the write
really blocks in the kernel (in open(2), until a reader comes) the way the driver's does; the test plays
the kernel when it lets the write through. Steps about other functions go on meanwhile, a step about the
same function waits for the outstanding write and says so, and once it returns and shows, all goes on."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.host.vfio import writes
from agent.host.vfio.bind import BindStep, StepKind, apply_step
from agent.host.vfio.errors import StepFailed, WritePending
from agent.host.vfio.pci import current_driver, current_override
from agent.sim.hardware import materialize
from agent.sim.kernel.tree import SimTree
from agent.sim.profiles import load_profile

GPU, OTHER = "0000:18:00.0", "0000:2a:00.0"


def bounded(fn: Callable[[], None], seconds: float = 30) -> BaseException | None:
    """Run `fn` in a thread; what it raised (None), failing the test if it is still blocked after `seconds`."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds}s: the write holds the caller"
    return raised[0] if raised else None


def test_a_write_the_kernel_does_not_return_from_fails_in_time_and_holds_nothing(tmp_path: Path) -> None:
    materialize(load_profile("dgx-h100"), tmp_path)
    tree = SimTree(tmp_path)
    unbind = tree.drivers / "nvidia" / "unbind"
    unbind.unlink()
    os.mkfifo(unbind)  # no reader: a write blocks in the kernel
    step = BindStep(StepKind.UNBIND, GPU, "nvidia")

    err = bounded(lambda: apply_step(tree.sys, step, timeout=0.5))
    assert isinstance(err, StepFailed) and err.retryable
    assert str(err).startswith(f"unbind {GPU} from nvidia: the write to {unbind} has not returned after 0.")
    assert "nothing more is done to 0000:18:00.0 until it has" in str(err)
    # Another function's steps go on while that write is still in the kernel.
    assert bounded(lambda: apply_step(tree.sys, BindStep(StepKind.SET_OVERRIDE, OTHER, "vfio-pci"), timeout=5)) is None
    assert current_override(tree.sys, OTHER) == "vfio-pci"
    # The same function's next step waits for the outstanding write, then says why it does not go on.
    again = bounded(lambda: apply_step(tree.sys, BindStep(StepKind.BIND, GPU, "nvidia"), timeout=0.3))
    assert isinstance(again, WritePending) and again.retryable
    assert f"an earlier unbind {GPU} from nvidia" in str(again) and "has not returned" in str(again)

    # The last process closes the GPU: the driver takes the write (the test reads it, as the kernel
    # would) and lets go of the function.
    fd = os.open(unbind, os.O_RDONLY)
    try:
        deadline = time.monotonic() + 30
        data = b""
        while not data.endswith(GPU.encode()) and time.monotonic() < deadline:
            data += os.read(fd, 64)
        assert data == GPU.encode()
    finally:
        os.close(fd)
    tree.unbind(GPU)
    assert bounded(lambda: apply_step(tree.sys, step, timeout=5)) is None  # settled: nothing left to do
    assert current_driver(tree.sys, GPU) is None and writes.outstanding(tree.sys, GPU) is None


def test_an_unbind_that_returned_but_has_not_shown_is_outstanding_until_it_shows(tmp_path: Path) -> None:
    # The simulated kernel applies a write after it, and holds an NVIDIA unbind while the GPU is open:
    # no emulator runs here, so the unbind never shows until the test makes it.
    materialize(load_profile("dgx-h100"), tmp_path)
    tree = SimTree(tmp_path)
    step = BindStep(StepKind.UNBIND, GPU, "nvidia")
    with pytest.raises(StepFailed, match=r"not done after 0\.3s: the function is bound to nvidia"):
        apply_step(tree.sys, step, timeout=0.3)
    with pytest.raises(WritePending, match="returned, but has not taken effect"):
        apply_step(tree.sys, BindStep(StepKind.CLEAR_OVERRIDE, GPU), timeout=0.2)
    tree.unbind(GPU)
    apply_step(tree.sys, BindStep(StepKind.CLEAR_OVERRIDE, GPU), timeout=5)
    assert writes.outstanding(tree.sys, GPU) is None

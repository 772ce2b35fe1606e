"""A GPU held open by a process in another PID namespace (another pod's container) is busy: the check
before a GPU leaves the NVIDIA driver reads the host's /proc, where every process of every namespace
is listed under its host PID. From inside a PID namespace of its own, /proc lists that namespace's
processes only, and the same GPU looks free: the DaemonSet therefore runs with hostPID
(tests/test_deploy.py checks it). Real processes, real PID namespaces (`unshare`), the real /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import need_command, need_root

from agent.host.vfio.errors import DeviceBusy
from agent.host.vfio.inuse import check_not_open

ROOT = Path(__file__).resolve().parent.parent
GPU = "0000:18:00.0"


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """`<tmp>/dev/nvidia0` held open by a shell that is PID 1 of a PID namespace of its own (as a
    container's process is); yields the dev root and the holder's PID on the host."""
    need_root()
    need_command("unshare")
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                             f'exec 7<"{dev / "nvidia0"}"; echo "ready $$"; read _'],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().split() == ["ready", "1"]  # PID 1 in its own namespace
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1
        yield dev, int(children[0])
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # `read` returns: the holder exits
        proc.wait(timeout=30)


def test_a_process_in_another_pid_namespace_holding_the_gpu_is_named(holder: tuple[Path, int]) -> None:
    dev, pid = holder
    with pytest.raises(DeviceBusy) as err:
        check_not_open(Path("/proc"), dev, GPU, 0)
    assert str(err.value) == (f"GPU {GPU} is in use on the host: pid {pid} (sh) fd 7 on {dev / 'nvidia0'}; it can "
                              "leave the NVIDIA driver once they close it")
    assert err.value.retryable


def test_from_inside_a_pid_namespace_of_its_own_the_holder_is_not_seen(holder: tuple[Path, int]) -> None:
    # The agent in a pod without hostPID: its /proc is its own namespace's, and the GPU looks free.
    dev, _ = holder
    script = ("import sys; from pathlib import Path; from agent.host.vfio.inuse import check_not_open\n"
              f"check_not_open(Path('/proc'), Path({str(dev)!r}), {GPU!r}, 0); print('free')")
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stdout) == (0, "free\n"), done.stderr

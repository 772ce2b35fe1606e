"""`dra-agent sim`: command files written by simctl, applied by a simulated NVML that watches its
control directory (real files, real inotify, real threads)."""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from agent import config
from agent.app import simctl
from agent.config import NvmlMode, Settings
from agent.inventory.gpu_events import GpuEventWatcher, GpuLost, XidError
from agent.sim.control import ControlWatcher, SimCommand
from agent.sim.nvml import SimulatedNvml
from agent.sim.nvmlopen import SimCommands


def sim_settings(tmp_path: Path, nvml: str = "sim:dgx-h100") -> Settings:
    return Settings(node_name="node-a", nvml=NvmlMode.parse(nvml), state_dir=tmp_path / "state")


@pytest.fixture
def sim() -> Iterator[SimulatedNvml]:
    nvml = SimulatedNvml.from_profile("dgx-h100")
    nvml.nvmlInit()
    yield nvml
    nvml.stop_watching()
    nvml.nvmlShutdown()


def until(check: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def is_lost(sim: SimulatedNvml, index: int) -> bool:
    try:
        sim.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError_GpuIsLost:
        return True
    return False


def action(sim: SimulatedNvml, index: int) -> int:
    values = sim.nvmlDeviceGetFieldValues(sim.nvmlDeviceGetHandleByIndex(index),
                                          [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    return int(values[0].value.uiVal)


def test_a_submitted_command_is_applied_and_removed(tmp_path: Path, sim: SimulatedNvml) -> None:
    settings = sim_settings(tmp_path)
    sim.watch_control(simctl.control_dir(settings))
    path = simctl.submit(settings, simctl.make_command(settings, "lose", "gpu-5"))
    assert path.parent == tmp_path / "state" / "nvml-sim" / "control"
    assert simctl.wait_applied(path) is True
    assert not path.exists() and is_lost(sim, 5)
    path = simctl.submit(settings, simctl.make_command(settings, "xid", "gpu-2", "79"))
    assert simctl.wait_applied(path) is True
    assert action(sim, 2) == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    path = simctl.submit(settings, simctl.make_command(settings, "recover", "gpu-5"))
    assert simctl.wait_applied(path) is True
    assert not is_lost(sim, 5)


def test_commands_written_before_the_watch_are_applied_at_start_in_order(tmp_path: Path,
                                                                          sim: SimulatedNvml) -> None:
    settings = sim_settings(tmp_path)
    for action_, device in (("lose", "gpu-1"), ("recover", "gpu-1"), ("lose", "gpu-1"), ("lose", "gpu-3")):
        simctl.submit(settings, simctl.make_command(settings, action_, device))
    # Nobody applies them yet: the CLI says so after its wait.
    waiting = sorted(simctl.control_dir(settings).iterdir())
    assert len(waiting) == 4 and simctl.wait_applied(waiting[-1], timeout=0.2) is None
    sim.watch_control(simctl.control_dir(settings))
    assert until(lambda: not any(simctl.control_dir(settings).iterdir()))
    assert is_lost(sim, 1) and is_lost(sim, 3)  # the last word on gpu-1 was `lose`


def test_control_watcher_applies_in_name_order(tmp_path: Path) -> None:
    directory = tmp_path / "control"
    directory.mkdir()
    applied: list[SimCommand] = []
    names = ["00000000000000000003-1-0000.json", "00000000000000000001-1-0000.json",
             "00000000000000000002-1-0000.json"]
    for n, name in enumerate(names):
        (directory / name).write_bytes(SimCommand("xid", "gpu-0", 10 + n).encode())
    watcher = ControlWatcher(directory, applied.append)
    watcher.start()
    try:
        assert until(lambda: len(applied) == 3)
        assert [c.xid for c in applied] == [11, 12, 10]
    finally:
        watcher.stop()


def test_a_bad_command_is_set_aside_and_the_rest_still_applied(tmp_path: Path, sim: SimulatedNvml,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    settings = sim_settings(tmp_path)
    directory = simctl.control_dir(settings)
    sim.watch_control(directory)
    with caplog.at_level(logging.WARNING):
        for name, body in (("00000000000000000001-1-0000.json", b"{not json"),
                           ("00000000000000000002-1-0000.json", b'{"command": "lose", "device": "gpu-99"}'),
                           ("00000000000000000003-1-0000.json", b'{"command": "xid", "device": "gpu-0", "xid": 0}'),
                           ("00000000000000000004-1-0000.json", b'{"command": "reboot", "device": "gpu-0"}')):
            # Whole files, as every writer of commands makes them (a half-written one is not a command).
            (directory / f".{name}.tmp-0").write_bytes(body)
            os.replace(directory / f".{name}.tmp-0", directory / name)
        good = simctl.submit(settings, simctl.make_command(settings, "lose", "gpu-4"))
        assert simctl.wait_applied(good) is True
        assert until(lambda: len(list(directory.glob("*.bad"))) == 4)
    assert is_lost(sim, 4) and not is_lost(sim, 0)
    assert sorted(p.name for p in directory.iterdir()) == [
        f"0000000000000000000{n}-1-0000.json.bad" for n in range(1, 5)]
    text = caplog.text
    assert "not JSON" in text and "gpu-99" in text and "1..999" in text and "reboot" in text


def test_the_gpu_event_watcher_sees_commands_from_outside(tmp_path: Path, sim: SimulatedNvml) -> None:
    settings = sim_settings(tmp_path)
    seen: list[object] = []
    watcher = GpuEventWatcher(sim, seen.append, probe_interval=0.1,
                              commands=SimCommands(sim, simctl.control_dir(settings)))
    watcher.start()
    try:
        assert until(lambda: len(watcher.stats.registered) == 8)
        simctl.submit(settings, simctl.make_command(settings, "xid", "gpu-6", 48))
        simctl.submit(settings, simctl.make_command(settings, "lose", "gpu-6"))
        assert until(lambda: len(seen) >= 2)
        assert [(type(e), e.device) for e in seen[:2]] == [(XidError, "gpu-6"), (GpuLost, "gpu-6")]  # type: ignore[attr-defined]
    finally:
        watcher.stop()
    # stop() also stopped the control watch: a command now waits for the next agent.
    path = simctl.submit(settings, simctl.make_command(settings, "recover", "gpu-6"))
    assert simctl.wait_applied(path, timeout=0.3) is None and is_lost(sim, 6)


@pytest.mark.parametrize(("nvml", "action_", "device", "xid", "complaint"), [
    ("auto", "lose", "gpu-0", None, "--nvml is auto"),
    ("real", "xid", "gpu-0", "79", "--nvml is real"),
    ("sim", "lose", "gpu-8", None, "gpu-0, gpu-1, gpu-2, gpu-3, gpu-4, gpu-5, gpu-6, gpu-7"),
    ("sim", "recover", "3", None, "no GPU '3'"),
    ("sim", "xid", "gpu-0", "0", "XID must be an integer 1..999"),
    ("sim", "xid", "gpu-0", "1000", "XID must be an integer 1..999"),
    ("sim", "xid", "gpu-0", "x13", "XID must be an integer 1..999"),
    ("sim:no-such-profile", "lose", "gpu-0", None, "neither a builtin profile"),
])
def test_errors_say_what_to_do(tmp_path: Path, nvml: str, action_: str, device: str, xid: str | None,
                               complaint: str) -> None:
    settings = sim_settings(tmp_path, nvml)
    with pytest.raises(simctl.SimctlError, match=complaint.replace("(", r"\(")):
        simctl.make_command(settings, action_, device, xid)
    assert not (tmp_path / "state").exists()  # nothing written


def parse(argv: list[str]) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(prog="dra-agent")
    sub = parser.add_subparsers(dest="command", required=True)
    simctl.add_sim_parser(sub, config.add_arguments)
    args = parser.parse_args(argv)
    return args, config.settings_from(args, env={})


def test_cli_applied_queued_and_refused(tmp_path: Path, sim: SimulatedNvml,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    state = str(tmp_path / "state")
    args, settings = parse(["sim", "lose", "gpu-2", "--nvml", "sim", "--state-dir", state, "--wait", "0.3"])
    assert args.fn(args, settings) == 0
    assert "lose gpu-2: queued: an agent running with --nvml sim will apply it when it starts" in \
        capsys.readouterr().out

    sim.watch_control(simctl.control_dir(settings))  # the agent starts: the queued command is applied
    assert until(lambda: is_lost(sim, 2))
    args, settings = parse(["sim", "xid", "gpu-2", "31", "--nvml", "sim", "--state-dir", state])
    assert args.fn(args, settings) == 0
    assert capsys.readouterr().out == "xid gpu-2 XID 31: applied\n"

    args, settings = parse(["sim", "xid", "gpu-2", "abc", "--nvml", "sim", "--state-dir", state])
    assert args.fn(args, settings) == 2
    assert "XID must be an integer 1..999" in capsys.readouterr().err
    args, settings = parse(["sim", "recover", "gpu-2", "--state-dir", state])
    assert args.fn(args, settings) == 2
    assert "--nvml is auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["sim", "xid", "gpu-2"])  # the XID is required


def test_command_files_sort_in_the_order_written(tmp_path: Path) -> None:
    settings = sim_settings(tmp_path)
    written = [simctl.submit(settings, simctl.make_command(settings, "xid", "gpu-0", n)) for n in range(1, 30)]
    assert sorted(written) == written
    assert all(p.suffix == ".json" and p.stat().st_mode & 0o777 == 0o644 for p in written)
    assert not [n for n in os.listdir(written[0].parent) if not n.endswith(".json")]  # no temp files left


def test_cli_unloads_and_loads_the_driver_under_a_running_nvml(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    state = str(tmp_path / "state")
    args, settings = parse(["sim", "driver", "unload", "--nvml", "sim", "--state-dir", state])
    root = settings.sim_root
    running = SimulatedNvml.from_profile("dgx-h100")
    running.materialize(root)
    running.nvmlInit()
    nodes = sorted(n for n in os.listdir(root / "dev") if n.startswith("nvidia"))
    assert "nvidia3" in nodes and "nvidiactl" in nodes
    assert running.nvmlDeviceGetCount() == 8

    assert args.fn(args, settings) == 0
    assert capsys.readouterr().out.startswith("NVIDIA driver unloaded")
    # The driver's nodes and GPU list are gone, and NVML answers nothing, in this process or a new one.
    assert not [n for n in os.listdir(root / "dev") if n.startswith("nvidia")]
    assert not (root / "proc" / "driver" / "nvidia").exists()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        running.nvmlDeviceGetCount()
    fresh = SimulatedNvml.from_profile("dgx-h100")
    fresh.materialize(root)  # (as an agent starting now writes the machine: the nodes stay away)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        fresh.nvmlInit()
    assert not [n for n in os.listdir(root / "dev") if n.startswith("nvidia")]
    assert args.fn(args, settings) == 0
    assert capsys.readouterr().out == "NVIDIA driver: already unloaded\n"

    args, settings = parse(["sim", "driver", "load", "--nvml", "sim", "--state-dir", state])
    assert args.fn(args, settings) == 0
    assert capsys.readouterr().out.startswith("NVIDIA driver loaded")
    assert sorted(n for n in os.listdir(root / "dev") if n.startswith("nvidia")) == nodes
    # A session of the load before is over; a new initialization answers.
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        running.nvmlDeviceGetCount()
    running.nvmlShutdown()
    running.nvmlInit()
    assert running.nvmlDeviceGetCount() == 8
    running.nvmlShutdown()

    args, settings = parse(["sim", "driver", "unload", "--nvml", "real", "--state-dir", state])
    assert args.fn(args, settings) == 2
    assert "--nvml is real" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["sim", "driver", "reload"])

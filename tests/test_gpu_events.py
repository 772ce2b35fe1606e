"""GPU event sources: the simulated NVML's event API and recovery action, and GpuEventWatcher on it
(real threads, real waits), and on the real pynvml path through the stand-in library."""

from __future__ import annotations

import inspect
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest
from conftest import need_command

from agent.inventory.gpu_events import (
    DoubleBitEcc,
    GpuAnswering,
    GpuBaseline,
    GpuEvent,
    GpuEventWatcher,
    GpuLost,
    RecoveryAction,
    XidError,
)
from agent.inventory.nvmlcodes import FI_DEV_GET_GPU_RECOVERY_ACTION, NvmlRecoveryCode
from agent.sim.hardware import materialize
from agent.sim.nvml import SimulatedNvml
from agent.sim.nvmlopen import SimCommands
from agent.sim.profiles import load_profile

ROOT = Path(__file__).resolve().parent.parent
EVENT_FUNCTIONS = ("nvmlEventSetCreate", "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents",
                   "nvmlEventSetWait_v2", "nvmlEventSetWait", "nvmlEventSetFree", "nvmlDeviceGetFieldValues")
ACTION = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


def sim_with_minors(tmp_path: Path, minors: list[int]) -> SimulatedNvml:
    """A machine whose GPUs' minors differ from their NVML indexes, so naming is really tested."""
    profile = tmp_path / "odd.json"
    profile.write_text(json.dumps({
        "defaults": {"name": "NVIDIA H100 80GB HBM3", "memoryTotal": 1 << 30},
        "gpus": [{"busId": f"0000:{0x18 + i:02x}:00.0", "minor": m} for i, m in enumerate(minors)],
    }))
    sim = SimulatedNvml.from_profile(str(profile))
    sim.nvmlInit()
    return sim


@pytest.fixture
def sim() -> Iterator[SimulatedNvml]:
    nvml = SimulatedNvml.from_profile("dgx-h100")
    nvml.nvmlInit()
    yield nvml
    nvml.nvmlShutdown()


class Events:
    """What a watcher emitted, received on its thread."""

    def __init__(self) -> None:
        self.queue: queue.Queue[GpuEvent] = queue.Queue()

    def __call__(self, event: GpuEvent) -> None:
        self.queue.put(event)

    def next(self, match: Callable[[GpuEvent], bool], timeout: float = 2.0) -> GpuEvent:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching event within {timeout} s")
            try:
                event = self.queue.get(timeout=left)
            except queue.Empty:
                continue
            if match(event):
                return event

    def none_after(self, watcher: GpuEventWatcher) -> list[GpuEvent]:
        """What the watcher reported from now until two whole probes later (`GpuEventWatcher.probed`):
        anything it would report about a change made before the call has been reported by then."""
        watcher.probed()
        found = []
        while not self.queue.empty():
            found.append(self.queue.get_nowait())
        return found


@pytest.fixture
def watch() -> Iterator[Callable[..., tuple[GpuEventWatcher, Events]]]:
    started: list[GpuEventWatcher] = []

    def start(nvml: SimulatedNvml, probe_interval: float = 0.1, registered: int = 1,
              baseline: bool = False) -> tuple[GpuEventWatcher, Events]:
        events = Events()
        watcher = GpuEventWatcher(nvml, events, probe_interval=probe_interval, baseline=baseline,
                                  commands=SimCommands(nvml))
        watcher.start()
        started.append(watcher)
        # GPUs are registered by the first probe: from then on an XID is delivered.
        deadline = time.monotonic() + 30
        while watcher.stats.probes < 1:
            assert time.monotonic() < deadline, "no probe within 30 s"
            time.sleep(0.01)
        assert len(watcher.stats.registered) >= registered
        return watcher, events

    yield start
    for watcher in started:
        watcher.stop()


# -- the simulated NVML's event API -----------------------------------------------------------------

def test_event_functions_have_pynvml_signatures() -> None:
    for name in EVENT_FUNCTIONS:
        ours = inspect.signature(getattr(SimulatedNvml, name))
        theirs = inspect.signature(getattr(pynvml, name))
        assert list(ours.parameters)[1:] == list(theirs.parameters), name


def test_wait_returns_the_real_struct_and_times_out(sim: SimulatedNvml) -> None:
    event_set = sim.nvmlEventSetCreate()
    assert isinstance(event_set, pynvml.c_nvmlEventSet_t)
    handle = sim.nvmlDeviceGetHandleByIndex(5)
    supported = sim.nvmlDeviceGetSupportedEventTypes(handle)
    assert supported & pynvml.nvmlEventTypeXidCriticalError and supported & pynvml.nvmlEventTypeDoubleBitEccError
    sim.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)

    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        sim.nvmlEventSetWait_v2(event_set, 100)
    assert time.monotonic() - started >= 0.09  # it really waited

    assert sim.raise_xid(5, 48) == 1
    assert sim.raise_double_bit_ecc(5) == 0  # not registered for ECC on this set: not delivered
    assert sim.raise_xid(4, 48) == 0  # another GPU, not registered
    data = sim.nvmlEventSetWait(event_set, 0)
    assert type(data) is pynvml.c_nvmlEventData_t
    assert sim.nvmlDeviceGetIndex(data.device) == 5
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 48)
    with pytest.raises(pynvml.NVMLError_Timeout):
        sim.nvmlEventSetWait_v2(event_set, 0)

    sim.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlEventSetWait_v2(event_set, 0)


def test_a_waiting_thread_wakes_when_an_event_is_raised(sim: SimulatedNvml) -> None:
    event_set = sim.nvmlEventSetCreate()
    sim.nvmlDeviceRegisterEvents(sim.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError
                                 | pynvml.nvmlEventTypeDoubleBitEccError, event_set)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(sim.nvmlEventSetWait_v2(event_set, 20_000)))
    waiter.start()
    sim.wait_for_waiters(1)  # it waits now, for nothing yet
    sim.raise_double_bit_ecc(0)
    waiter.join(10)
    assert not waiter.is_alive(), "the waiter slept through the event"
    assert got[0].eventType == pynvml.nvmlEventTypeDoubleBitEccError  # type: ignore[attr-defined]

    # Shutting the library down wakes a waiter too.
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            sim.nvmlEventSetWait_v2(event_set, 20_000)
        except pynvml.NVMLError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    sim.wait_for_waiters(1)
    sim.nvmlShutdown()
    waiter.join(10)
    sim.nvmlInit()  # for the fixture's shutdown
    assert not waiter.is_alive() and isinstance(errors[0], pynvml.NVMLError_Uninitialized)


def test_register_refuses_types_the_gpu_does_not_report(sim: SimulatedNvml) -> None:
    event_set = sim.nvmlEventSetCreate()
    handle = sim.nvmlDeviceGetHandleByIndex(1)
    sim.set_supported_events(1, pynvml.nvmlEventTypeDoubleBitEccError)
    assert sim.nvmlDeviceGetSupportedEventTypes(handle) == pynvml.nvmlEventTypeDoubleBitEccError
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    sim.lose(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        sim.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeDoubleBitEccError, event_set)


def test_recovery_action_field(sim: SimulatedNvml) -> None:
    handle = sim.nvmlDeviceGetHandleByIndex(2)

    def action() -> int:
        values = sim.nvmlDeviceGetFieldValues(handle, [ACTION, (pynvml.NVML_FI_DEV_ECC_CURRENT, 0)])
        assert values[0].fieldId == ACTION and values[0].nvmlReturn == pynvml.NVML_SUCCESS
        assert values[0].valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        assert values[1].fieldId == pynvml.NVML_FI_DEV_ECC_CURRENT
        assert values[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
        return int(values[0].value.uiVal)

    assert action() == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    sim.raise_xid(2, 13)  # an application error: the GPU needs nothing
    assert action() == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    sim.raise_xid(2, 79)
    assert action() == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    sim.lose(2)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        sim.nvmlDeviceGetFieldValues(handle, [ACTION])
    sim.recover(2)
    assert action() == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    with pytest.raises(ValueError):
        sim.raise_xid(2, 0)


def recovery_action(sim: SimulatedNvml, index: int) -> int:
    [value] = sim.nvmlDeviceGetFieldValues(sim.nvmlDeviceGetHandleByIndex(index), [ACTION])
    return int(value.value.uiVal)


def test_a_gpus_recovery_action_outlives_the_agent_but_not_a_reboot(tmp_path: Path) -> None:
    """As the driver keeps it: a later process on the same simulated machine sees what the GPU needs."""

    def process() -> SimulatedNvml:
        nvml = SimulatedNvml.from_profile("dgx-h100")
        nvml.materialize(tmp_path)
        nvml.nvmlInit()
        return nvml

    process().raise_xid(3, 48)
    later = process()
    assert recovery_action(later, 3) == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert recovery_action(later, 2) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    later.recover(3)  # reset by whoever: the next process sees it reset
    assert recovery_action(process(), 3) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    process().raise_xid(3, 48)
    materialize(load_profile("dgx-h100"), tmp_path, boot=True)  # a reboot resets every GPU
    assert recovery_action(process(), 3) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE


# -- the watcher ------------------------------------------------------------------------------------

def test_a_watcher_asked_for_it_reports_each_gpus_first_answer(tmp_path: Path, watch) -> None:  # type: ignore[no-untyped-def]
    nvml = sim_with_minors(tmp_path, [4, 7, 2])
    nvml.raise_xid(1, 79)  # before any watcher: gpu-7 needs a reset already
    watcher, events = watch(nvml, registered=3, baseline=True)
    seen = [events.next(lambda e: True) for _ in range(4)]
    uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(3)]
    assert {(e.device, e.uuid, e.recovery_action) for e in seen if isinstance(e, GpuBaseline)} == {
        ("gpu-4", uuids[0], RecoveryAction.NONE), ("gpu-7", uuids[1], RecoveryAction.GPU_RESET),
        ("gpu-2", uuids[2], RecoveryAction.NONE)}
    assert [type(e) for e in seen if e.device == "gpu-7"] == [GpuBaseline, GpuAnswering]  # the baseline first
    assert events.none_after(watcher) == []  # once per GPU, not at every probe


def test_xid_is_named_as_published_with_its_recovery_action(tmp_path: Path, watch) -> None:  # type: ignore[no-untyped-def]
    nvml = sim_with_minors(tmp_path, [4, 7, 2])
    watcher, events = watch(nvml)
    assert sorted(watcher.stats.registered) == ["gpu-2", "gpu-4", "gpu-7"]
    nvml.raise_xid(1, 79)
    event = events.next(lambda e: isinstance(e, XidError))
    assert isinstance(event, XidError)
    assert (event.device, event.xid, event.recovery_action) == ("gpu-7", 79, RecoveryAction.GPU_RESET)
    assert event.at.tzinfo is not None

    nvml.raise_xid(2, 13)
    event = events.next(lambda e: isinstance(e, XidError))
    assert (event.device, event.recovery_action) == ("gpu-2", RecoveryAction.NONE)  # type: ignore[union-attr]

    nvml.raise_double_bit_ecc(0)
    event = events.next(lambda e: isinstance(e, DoubleBitEcc))
    assert event == DoubleBitEcc("gpu-4", RecoveryAction.GPU_RESET, event.at)
    # The actions were reported with the events: the probe does not report them again.
    assert events.none_after(watcher) == []


def test_lost_and_recovered(sim: SimulatedNvml, watch) -> None:  # type: ignore[no-untyped-def]
    watcher, events = watch(sim)
    sim.lose(6)
    lost = events.next(lambda e: True)
    assert isinstance(lost, GpuLost) and lost.device == "gpu-6" and "GPU_IS_LOST" in lost.reason
    assert events.none_after(watcher) == []  # said once, not at every probe
    sim.recover(6)
    back = events.next(lambda e: True)
    assert back == GpuAnswering("gpu-6", RecoveryAction.NONE, back.at)


def test_a_gpu_back_after_being_lost_is_heard_again(sim: SimulatedNvml, watch) -> None:  # type: ignore[no-untyped-def]
    watcher, events = watch(sim)
    sim.lose(6)  # off the bus: its event registrations are gone with it
    assert isinstance(events.next(lambda e: True), GpuLost)
    sim.recover(6)
    assert isinstance(events.next(lambda e: True), GpuAnswering)
    assert watcher.stats.registered.count("gpu-6") == 2
    sim.raise_xid(6, 48)
    event = events.next(lambda e: isinstance(e, XidError))
    assert (event.device, event.xid) == ("gpu-6", 48)


def test_a_reset_after_an_application_xid_is_reported(sim: SimulatedNvml, watch) -> None:  # type: ignore[no-untyped-def]
    _, events = watch(sim)
    sim.raise_xid(3, 13)
    events.next(lambda e: isinstance(e, XidError))
    sim.recover(3)  # NVML shows no change (action NONE before and after), the reset is still seen
    back = events.next(lambda e: True)
    assert back == GpuAnswering("gpu-3", RecoveryAction.NONE, back.at)


def test_recovery_action_change_is_reported(sim: SimulatedNvml, watch) -> None:  # type: ignore[no-untyped-def]
    sim.set_supported_events(0, 0)  # no events: only the probe sees the XID's effect
    _, events = watch(sim)
    sim.raise_xid(0, 79)
    event = events.next(lambda e: True)
    assert event == GpuAnswering("gpu-0", RecoveryAction.GPU_RESET, event.at)


def watcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpu-events"]


def test_stop_is_prompt(sim: SimulatedNvml, watch) -> None:  # type: ignore[no-untyped-def]
    watcher, _ = watch(sim, probe_interval=30)
    assert len(watcher_threads()) == 1
    watcher.stop(timeout=5)  # the thread waits for events at most 500 ms at a time, not the probe's 30 s
    assert watcher_threads() == []


def test_gpu_without_events_is_probed_only(sim: SimulatedNvml, watch) -> None:  # type: ignore[no-untyped-def]
    sim.set_supported_events(4, pynvml.nvmlEventTypePState)  # neither XIDs nor ECC
    watcher, events = watch(sim)
    assert "gpu-4" not in watcher.stats.registered and "gpu-5" in watcher.stats.registered
    sim.lose(4)
    event = events.next(lambda e: True)
    assert event == GpuLost("gpu-4", "GPU is lost (NVML_ERROR_GPU_IS_LOST)", event.at)


def test_library_without_events_or_fields_degrades_to_probing(sim: SimulatedNvml, watch,  # type: ignore[no-untyped-def]
                                                              caplog: pytest.LogCaptureFixture) -> None:
    sim.inject_error(None, "nvmlEventSetCreate", "FUNCTION_NOT_FOUND")
    sim.inject_error(None, "nvmlDeviceGetFieldValues", "NOT_SUPPORTED")
    watcher, events = watch(sim, registered=0)
    watcher.probed()  # several probes since the start
    assert watcher.stats.registered == [] and watcher.stats.errors == 0 and watcher.stats.probes >= 3
    assert sum("NVML events are not available" in r.message for r in caplog.records) == 1
    sim.raise_xid(1, 79)  # nobody listens for it
    sim.lose(1)
    assert isinstance(events.next(lambda e: True), GpuLost)
    sim.recover(1)
    back = events.next(lambda e: True)
    assert back == GpuAnswering("gpu-1", RecoveryAction.UNKNOWN, back.at)


def test_one_gpu_failing_and_a_failing_callback_stop_nothing(sim: SimulatedNvml) -> None:
    sim.inject_error(2, "nvmlDeviceGetMinorNumber", "UNKNOWN")
    seen: list[GpuEvent] = []

    def on_event(event: GpuEvent) -> None:
        seen.append(event)
        if len(seen) == 1:
            raise RuntimeError("consumer bug")

    watcher = GpuEventWatcher(sim, on_event, probe_interval=0.1)
    watcher.start()
    try:
        watcher.probed()
        assert "gpu-2" not in watcher.stats.registered and len(watcher.stats.registered) == 7
        sim.raise_xid(3, 79)
        watcher.probed()
        sim.raise_xid(5, 79)
        watcher.probed()
        assert [(e.device, type(e)) for e in seen] == [("gpu-3", XidError), ("gpu-5", XidError)]
        assert watcher.stats.errors >= 2  # gpu-2's probe and the callback, counted
    finally:
        watcher.stop()


def test_gpu_appearing_later_is_registered(sim: SimulatedNvml, watch) -> None:  # type: ignore[no-untyped-def]
    sim.inject_error(None, "nvmlDeviceGetCount", "UNKNOWN")
    watcher, events = watch(sim, registered=0)
    assert watcher.stats.registered == [] and watcher.stats.errors > 0  # probed, and failed
    sim.clear_errors()
    watcher.probed()
    assert len(watcher.stats.registered) == 8
    sim.raise_xid(7, 94)
    event = events.next(lambda e: isinstance(e, XidError))
    assert (event.device, event.xid) == ("gpu-7", 94)  # type: ignore[union-attr]


# -- the real pynvml path, through the stand-in library ---------------------------------------------

# What both scripts start with: a watcher on the real pynvml over the stand-in library, and `say`, which
# writes the library's control file and waits for the watcher to have seen it.
STANDIN_PRELUDE = textwrap.dedent("""
    import json, os, sys, pathlib, pynvml
    from agent.inventory.gpu_events import GpuEventWatcher
    control = pathlib.Path(sys.argv[1])

    def say(*lines):  # the control file, replaced at once: the library reads it on every call
        control.with_suffix(".tmp").write_text("".join(line + "\\n" for line in lines))
        os.replace(control.with_suffix(".tmp"), control)
        watcher.probed()  # seen and reported by now

    pynvml.nvmlInit()
    seen = []
    watcher = GpuEventWatcher(pynvml, seen.append, probe_interval=0.1)
    watcher.start()
    watcher.probed()
""")
STANDIN_SCRIPT = STANDIN_PRELUDE + textwrap.dedent("""
    say("action 2 1", "xid 2 79")
    say("action 2 1", "xid 2 79", "lost 0")
    say("action 2 0", "xid 2 79")
    watcher.stop(timeout=5)
    import threading
    print(json.dumps({"events": [[type(e).__name__, e.device, getattr(e, "xid", None),
                                  getattr(e, "recovery_action", None) and e.recovery_action.value] for e in seen],
                      "registered": watcher.stats.registered, "errors": watcher.stats.errors,
                      "stopped": not any(t.name == "gpu-events" for t in threading.enumerate())}))
""")


@pytest.mark.parametrize("build", ["current", "legacy"])
def test_real_pynvml_through_the_standin_library(short_tmp: Path, build: str) -> None:
    need_command("make", "gcc")
    built = subprocess.run(["make", "-s", "nvml-standin"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    library = ROOT / "tests" / "nvml_standin" / "build"
    env = {**os.environ, "LD_LIBRARY_PATH": str(library / "legacy" if build == "legacy" else library),
           "NVML_STANDIN_CONTROL": str(short_tmp / "control")}
    proc = subprocess.run([sys.executable, "-c", STANDIN_SCRIPT, str(short_tmp / "control")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # gpu-0 is registered again once it answers after being lost.
    assert out["registered"] == ["gpu-0", "gpu-1", "gpu-3", "gpu-0"] and out["errors"] == 0, proc.stderr
    if build == "current":
        assert out["events"] == [["XidError", "gpu-3", 79, "gpu-reset"], ["GpuLost", "gpu-0", None, None],
                                 ["GpuAnswering", "gpu-0", None, "none"], ["GpuAnswering", "gpu-3", None, "none"]]
    else:  # a driver older than the recovery action field: unknown, said once per GPU
        assert out["events"] == [["XidError", "gpu-3", 79, "unknown"], ["GpuLost", "gpu-0", None, None],
                                 ["GpuAnswering", "gpu-0", None, "unknown"]]
    assert out["stopped"]


DRIVER_RELOAD_SCRIPT = STANDIN_PRELUDE + textwrap.dedent("""
    up = [watcher.nvml_up]
    say("unloaded")  # the driver goes: the session is over
    up.append(watcher.nvml_up)
    try:
        pynvml.nvmlInit()
        init = "initialized"
    except pynvml.NVMLError as exc:
        init = str(exc)
    say()  # back: a new initialization answers
    up.append(watcher.nvml_up)
    say("action 2 1", "xid 2 79")  # and its events reach the watcher
    watcher.stop(timeout=5)
    print(json.dumps({"events": [[type(e).__name__, getattr(e, "device", None), getattr(e, "reason", None)]
                                 for e in seen], "up": up, "init": init, "registered": watcher.stats.registered}))
""")


def test_the_driver_unloaded_under_the_watcher_through_the_standin_library(short_tmp: Path) -> None:
    # The real pynvml path: NVML lost once (the session let go of, nvmlShutdown), initialized again once the
    # driver is back, every GPU registered afresh, events delivered again.
    need_command("make", "gcc")
    built = subprocess.run(["make", "-s", "nvml-standin"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    env = {**os.environ, "LD_LIBRARY_PATH": str(ROOT / "tests" / "nvml_standin" / "build"),
           "NVML_STANDIN_CONTROL": str(short_tmp / "control")}
    proc = subprocess.run([sys.executable, "-c", DRIVER_RELOAD_SCRIPT, str(short_tmp / "control")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["up"] == [True, False, True]
    assert out["init"] == "Driver Not Loaded"
    assert [e[0] for e in out["events"]] == ["NvmlLost", "NvmlBack", "XidError"], out
    assert out["events"][0][2].startswith("Uninitialized") and out["events"][2][1] == "gpu-3"
    assert out["registered"] == ["gpu-0", "gpu-1", "gpu-3"] * 2


def test_recovery_codes_are_nvmls() -> None:
    # The agent keeps nvmlGpuRecoveryAction_t's numbers itself; where the installed bindings name them,
    # they must agree.
    for code in NvmlRecoveryCode:
        named = getattr(pynvml, f"NVML_GPU_RECOVERY_ACTION_{code.name}", None)
        assert named in (None, int(code)), code
    assert getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None) in (None, FI_DEV_GET_GPU_RECOVERY_ACTION)


def test_the_agent_loads_and_scans_with_bindings_that_lack_the_recovery_names(tmp_path: Path) -> None:
    # A real node (the lent H200's image) carried nvidia-ml-py 13.610.43, which has no
    # NVML_GPU_RECOVERY_ACTION_BUS_RESET: `dra-agent run` died importing the health watcher. Here the
    # bindings lose every name newer than nvidia-ml-py 12.560 that the agent could reach for.
    script = textwrap.dedent("""
        import importlib, runpy, sys
        import pynvml
        for name in [n for n in dir(pynvml) if n.startswith("NVML_GPU_RECOVERY_ACTION_")]:
            delattr(pynvml, name)
        del pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
        from agent.app.process import _CLUSTER_MODULES, _MODULES
        for module in (*_MODULES, *_CLUSTER_MODULES):
            importlib.import_module(module)
        sys.argv = ["dra-agent", "devices", "--nvml", "sim", "-o", "json"]
        runpy.run_module("agent", run_name="__main__")
    """)
    env = {**os.environ, "DRA_STATE_DIR": str(tmp_path / "state"), "DRA_OFFLINE": str(tmp_path / "offline")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert any(d["kind"] == "gpu" for d in json.loads(proc.stdout))

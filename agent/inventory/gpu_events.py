"""GPU health as events: NVML's XID and ECC events, and a probe for lost, recovered and reset GPUs.

`GpuEventWatcher` runs on one dedicated thread (never the event loop) and works on the NVML the GPU
source opened (`agent.inventory.nvmlapi.Nvml`):

- NVML events: one event set (`agent.inventory.nvmlevents`); each GPU registered for XID critical
  errors and double-bit ECC errors, only the types `nvmlDeviceGetSupportedEventTypes` says it
  reports. A library or GPU without events (`FUNCTION_NOT_FOUND`, `NOT_SUPPORTED`, or no such type) is logged once and
  probed only. The wait is bounded (at most 500 ms) so `stop()` is prompt.
- A probe every `probe_interval` seconds (default 1), two NVML calls per GPU
  (`nvmlDeviceGetHandleByIndex`, `nvmlDeviceGetFieldValues` for the GPU recovery action): a GPU
  whose calls fail with `GPU_IS_LOST`, or that NVML no longer lists, is lost; a lost GPU that
  answers again, or whose recovery action changes, is reported answering with its action. GPUs
  that appear later are registered on the next probe, and so is a lost GPU once it answers again
  (a GPU that fell off the bus lost its registrations).
- NVML as a whole: a probe whose `nvmlDeviceGetCount` (or event set) fails says nothing about any one GPU
  but that NVML no longer answers (the NVIDIA driver unloaded: the GPU Operator's driver container
  reloading it). It is reported once (`NvmlLost`), the event set and every GPU let go of, and NVML shut
  down through the gate (`NvmlGate.lost`), which initializes it again at every later probe until that
  succeeds; the first probe that counts the GPUs again reports `NvmlBack` and learns them afresh (with
  `baseline=True`, each GPU's first answer is reported again: a driver loaded again reset them).

Each finding goes to `on_event(event)` as a frozen dataclass, called on the watcher's thread
(wrap it with `loop.call_soon_threadsafe` to get it onto the loop). Devices are named as
published, `gpu-<minor>`. One GPU's failure, or a callback that raises, is logged and counted,
never the end of the thread.

Baseline: a GPU first seen answering with recovery action NONE (or unknown) says nothing; one first
seen needing an action is reported answering with it; one first seen lost is reported lost. A
watcher made with `baseline=True` also reports each GPU's first answer (`GpuBaseline`: its UUID
and recovery action, before any other event about it), which taints restored from an earlier
run are checked against.
What drives the GPUs from outside NVML (`GpuCommands`: on the simulated machine, `dra-agent sim`) is
applied from the first probe on; a reset it reports is also reported as answering even when NVML
shows no change (after an application XID, whose recovery action stays NONE).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pynvml

from agent.inventory.gpu_event_types import (
    DoubleBitEcc,
    GpuAnswering,
    GpuBaseline,
    GpuEvent,
    GpuLost,
    NvmlBack,
    NvmlLost,
    RecoveryAction,
    XidError,
)
from agent.inventory.nvmlapi import GpuCommands, NoCommands, Nvml, NvmlHandle
from agent.inventory.nvmlcodes import FI_DEV_GET_GPU_RECOVERY_ACTION
from agent.inventory.nvmlevents import ABSENT, EventSet
from agent.inventory.nvmlgate import NvmlGate
from agent.inventory.nvmlvalues import describe_error, field_int, handle_address

log = logging.getLogger(__name__)

__all__ = ["DoubleBitEcc", "GpuAnswering", "GpuBaseline", "GpuEvent", "GpuEventWatcher", "GpuLost", "NvmlBack",
           "NvmlLost", "RecoveryAction", "WatcherStats", "XidError"]

PROBE_INTERVAL = 1.0  # seconds between probes
WAIT_MS = 500  # the longest one nvmlEventSetWait_v2 blocks: how long stop() may take
_GONE = (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT)


@dataclass
class _Gpu:
    index: int
    name: str | None = None  # gpu-<minor>, once the GPU said its minor
    uuid: str | None = None
    handle: NvmlHandle = None
    answering: bool | None = None  # None: not probed yet
    action: RecoveryAction | None = None  # as last reported
    registered: bool = False  # registered for events, or known not to report any
    fields: bool = True  # nvmlDeviceGetFieldValues worth asking
    resets: int = 0
    baselined: bool = False  # its first answer reported (GpuBaseline)


@dataclass
class WatcherStats:
    events: int = 0  # events handed to on_event
    errors: int = 0  # failures logged and gone past
    probes: int = 0  # probes finished
    registered: list[str] = field(default_factory=list)  # devices registered for NVML events


class GpuEventWatcher:
    def __init__(self, nvml: Nvml, on_event: Callable[[GpuEvent], None], *,
                 probe_interval: float = PROBE_INTERVAL, wait_ms: int = WAIT_MS,
                 commands: GpuCommands | None = None, name_hint: Callable[[int], str | None] | None = None,
                 baseline: bool = False, gate: NvmlGate | None = None) -> None:
        """`nvml`: the GPU source's, initialized. `commands`: what else drives the GPUs (the GPU source's,
        applied while this watcher runs; none by default).
        `name_hint`: the published name of the GPU at an NVML index that never said its minor.
        `baseline`: report each GPU's first answer (`GpuBaseline`).
        `gate`: the GPU source's (every probe and wait uses NVML through it; when it is released, the
        event set is freed and every handle forgotten, and the GPUs are learnt afresh afterwards)."""
        self.nvml = nvml
        self.baseline = baseline
        self.gate = gate if gate is not None else NvmlGate(nvml)
        self._generation = self.gate.generation
        self.on_event = on_event
        self.probe_interval = probe_interval
        self.wait_ms = max(1, min(int(wait_ms), WAIT_MS))
        self.commands = commands if commands is not None else NoCommands()
        self.name_hint = name_hint
        self.stats = WatcherStats()
        self._gpus: dict[int, _Gpu] = {}
        self._by_handle: dict[int, int] = {}  # handle address -> NVML index
        self._by_uuid: dict[str, int] = {}
        self._events = EventSet(nvml, probe_interval, self.stats.registered)
        self._logged: dict[str, str] = {}  # key -> message already logged, logged again when it changes
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._probing = threading.Condition()
        self._probes_begun = 0
        self._commanded = False  # `commands` started (after the first probe)
        self.nvml_up: bool | None = None  # whether NVML answered the latest probe (None: not probed yet)

    def start(self) -> None:
        self.gate.on_release(self._release)
        self._thread = threading.Thread(target=self._run, name="gpu-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        self.gate.forget(self._release)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        if self._commanded:
            self.commands.stop()

    def probed(self, timeout: float = 30.0) -> None:
        """Block until two whole probes that began after this call have finished (TimeoutError if they
        have not within `timeout` s). Whatever a probe sees that changed before the call has been
        reported then, and so has an event raised before the call (the thread waited for events
        between the two probes): a test's handshake, where a sleep would only guess."""
        with self._probing:
            target = self._probes_begun + 2
            if not self._probing.wait_for(lambda: self.stats.probes >= target, timeout):
                raise TimeoutError(f"no two GPU probes finished within {timeout:g}s")

    def _start_commands(self) -> None:
        """Apply commands from outside NVML from now on: after the first probe, which registered the GPUs
        for events, so that the XIDs of commands written while no agent ran are delivered, not raised to
        nobody."""
        if not self._commanded:
            self._commanded = True
            self.commands.start()

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        next_probe = 0.0
        try:
            while not self._stopping.is_set():
                with self.gate.use() as generation:
                    if generation != self._generation:
                        self._generation = generation  # NVML initialized again: learnt afresh
                        next_probe = 0.0
                    now = time.monotonic()
                    if now >= next_probe:
                        with self._probing:
                            self._probes_begun += 1
                        self._guarded("probe", self._probe)
                        with self._probing:
                            self.stats.probes += 1
                            self._probing.notify_all()
                        next_probe = now + self.probe_interval
                        self._start_commands()
                    left = max(0.0, min(self.wait_ms / 1000, next_probe - time.monotonic()))
                    waited = self._events.active and self._guarded("wait", functools.partial(self._wait, left))
                if not waited:
                    self._stopping.wait(left)
        finally:
            with self.gate.use():
                self._events.free()

    def _release(self) -> None:
        """NVML is about to be shut down (`NvmlGate.released`; this thread waits at the gate): the event set
        goes, and with the next initialization every GPU is learnt again (its NVML index may have changed;
        one that left the NVIDIA driver is simply not listed, never lost)."""
        self._events.free()
        self._gpus.clear()
        self._by_handle.clear()
        self._by_uuid.clear()

    def _guarded(self, what: str, step: Callable[[], object]) -> bool:
        try:
            step()
            return True
        except Exception as exc:  # the thread outlives whatever one step raises
            self._error(f"<{what}>", f"GPU events: {what} failed: {describe_error(exc)}", exc)
            return False

    def _wait(self, seconds: float) -> None:
        data = self._events.wait(seconds)
        if data is not None:
            self._handle_event(data)

    # -- events ---------------------------------------------------------------------------------

    def _register(self, gpu: _Gpu) -> None:
        if gpu.registered or not self._events.active or gpu.name is None:
            return
        self._events.register(gpu.name, gpu.handle)
        gpu.registered = True

    def _handle_event(self, data: Any) -> None:  # an NVML c_nvmlEventData_t
        gpu = self._gpu_of_handle(data.device)
        if gpu is None or gpu.name is None:
            self._error("<event>", f"NVML event 0x{int(data.eventType):x} for a GPU this agent has no name for")
            return
        try:
            action = self._action(gpu)
        except pynvml.NVMLError as exc:  # the event matters more than the action: sent without it
            self._error(f"<gpu {gpu.index}>", f"{gpu.name}: recovery action after an event: {describe_error(exc)}")
            action = RecoveryAction.UNKNOWN
        else:
            gpu.action = action  # reported with this event: the probe need not report it again
        at = datetime.now(UTC)
        if (raised := self.commands.raised_at(data)) is not None:  # a command's, raised when it was written
            at = datetime.fromtimestamp(raised, UTC)
        if int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
            self._emit(XidError(gpu.name, int(data.eventData), action, at))
        elif int(data.eventType) & pynvml.nvmlEventTypeDoubleBitEccError:
            self._emit(DoubleBitEcc(gpu.name, action, at))

    def _gpu_of_handle(self, handle: NvmlHandle) -> _Gpu | None:
        index = self._by_handle.get(handle_address(handle))
        if index is None:
            # A handle this watcher did not see: NVML handles are stable, but its UUID tells for sure.
            try:
                index = self._by_uuid.get(str(self.nvml.nvmlDeviceGetUUID(handle)))
            except pynvml.NVMLError:
                return None
        return None if index is None else self._gpus.get(index)

    # -- the probe ------------------------------------------------------------------------------

    def _probe(self) -> None:
        try:
            self._events.ensure()
            count = int(self.nvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            self._nvml_lost(describe_error(exc))
            return
        if self.nvml_up is False:
            log.info("NVML answers again: %d GPUs", count)
            self._emit(NvmlBack(datetime.now(UTC)))
        self.nvml_up = True
        for index in range(count):
            gpu = self._gpus.setdefault(index, _Gpu(index))
            try:
                self._probe_gpu(gpu)
            except Exception as exc:  # one GPU's failure costs that GPU's probe only
                self._error(f"<gpu {index}>", f"{self._label(gpu)}: probe failed: {describe_error(exc)}", exc)
        for index in sorted(set(self._gpus) - set(range(count))):
            self._lost(self._gpus[index], f"NVML no longer lists it (index {index} of {count} GPUs)")

    def _nvml_lost(self, reason: str) -> None:
        """NVML failed as a whole: reported once, its session let go of (the gate initializes it again)."""
        self.stats.errors += 1
        if self.nvml_up is False:
            return  # still lost
        self.nvml_up = False
        self._release()  # the event set and every handle belong to the session that is over
        self.gate.lost(reason)
        self._emit(NvmlLost(reason, datetime.now(UTC)))

    def _probe_gpu(self, gpu: _Gpu) -> None:
        try:
            handle = self.nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            self._learn(gpu, handle)
            action = self._action(gpu)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                self._lost(gpu, describe_error(exc))
                return
            if exc.value in _GONE:
                self._lost(gpu, f"NVML no longer finds it: {describe_error(exc)}")
                return
            raise
        self._logged.pop(f"<gpu {gpu.index}>", None)
        resets = self.commands.resets(gpu.index)
        # (A GPU first seen, also after NVML was initialized again, has its count as the baseline.)
        was_reset, gpu.resets = resets != gpu.resets and gpu.answering is not None, resets
        first = gpu.answering is None
        back = gpu.answering is False
        gpu.answering = True
        changed = gpu.action is not None and action != gpu.action
        needs = first and action not in (RecoveryAction.NONE, RecoveryAction.UNKNOWN)
        gpu.action = action
        if self.baseline and not gpu.baselined and gpu.name is not None:
            gpu.baselined = True
            self._emit(GpuBaseline(gpu.name, gpu.uuid or "", action, datetime.now(UTC)))
        self._register(gpu)
        if (back or was_reset or changed or needs) and gpu.name is not None:
            if back:
                log.info("%s answers again (recovery action %s)", gpu.name, action.value)
            self._emit(GpuAnswering(gpu.name, action, datetime.now(UTC)))

    def _learn(self, gpu: _Gpu, handle: NvmlHandle) -> None:
        """Remember the handle, and the minor and UUID once, so events and failures are named."""
        gpu.handle = handle
        self._by_handle[handle_address(handle)] = gpu.index
        if gpu.name is None:
            gpu.name = f"gpu-{int(self.nvml.nvmlDeviceGetMinorNumber(handle))}"
        if gpu.uuid is None:
            gpu.uuid = str(self.nvml.nvmlDeviceGetUUID(handle))
            self._by_uuid[gpu.uuid] = gpu.index

    def _action(self, gpu: _Gpu) -> RecoveryAction:
        if not gpu.fields:
            return RecoveryAction.UNKNOWN
        try:
            values = self.nvml.nvmlDeviceGetFieldValues(gpu.handle, [FI_DEV_GET_GPU_RECOVERY_ACTION])
        except pynvml.NVMLError as exc:
            if exc.value not in ABSENT:
                raise
            gpu.fields = False
            log.info("%s: the GPU recovery action cannot be read (%s); reported as unknown",
                     self._label(gpu), describe_error(exc))
            return RecoveryAction.UNKNOWN
        value = values[0]
        if value.nvmlReturn == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if value.nvmlReturn != pynvml.NVML_SUCCESS:
            return RecoveryAction.UNKNOWN
        action = RecoveryAction.from_nvml(field_int(value))
        if action is RecoveryAction.UNKNOWN:
            self._note(f"<action {field_int(value)}>", f"{self._label(gpu)}: GPU recovery action code "
                       f"{field_int(value)} has no name in this agent; reported as unknown")
        return action

    def _lost(self, gpu: _Gpu, reason: str) -> None:
        if gpu.answering is False:
            return
        gpu.answering = False
        gpu.registered = False  # a GPU off the bus loses its registrations: registered afresh once back
        name = gpu.name or (self.name_hint(gpu.index) if self.name_hint is not None else None)
        if name is None:
            self._error(f"<gpu {gpu.index}>", f"GPU at NVML index {gpu.index} is lost ({reason}); it never "
                        "said its minor, so no published device is named")
            return
        gpu.name = name
        log.warning("%s is lost: %s", name, reason)
        self._emit(GpuLost(name, reason, datetime.now(UTC)))

    # -- helpers --------------------------------------------------------------------------------

    def _emit(self, event: GpuEvent) -> None:
        try:
            self.on_event(event)
            self.stats.events += 1
        except Exception as exc:  # the consumer's failure is not the watcher's end
            self._error("<on_event>", f"GPU events: on_event failed for {event}: {describe_error(exc)}", exc)

    def _label(self, gpu: _Gpu) -> str:
        return gpu.name or f"GPU at NVML index {gpu.index}"

    def _note(self, key: str, message: str) -> None:
        if self._logged.get(key) != message:
            self._logged[key] = message
            log.warning("%s", message)

    def _error(self, key: str, message: str, exc: BaseException | None = None) -> None:
        self.stats.errors += 1
        if self._logged.get(key) != message:
            self._logged[key] = message
            unexpected = exc is not None and not isinstance(exc, pynvml.NVMLError)
            log.warning("%s", message, exc_info=exc if unexpected else None)

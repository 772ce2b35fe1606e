"""GPU health as events: NVML's XID and ECC events, and a probe for lost, recovered and reset GPUs.

`GpuEventWatcher` runs on one dedicated thread (never the event loop) and works on the real
`pynvml` module or a `SimulatedNvml`, with the same calls:

- NVML events: one event set; each GPU registered for XID critical errors and double-bit ECC
  errors, only the types `nvmlDeviceGetSupportedEventTypes` says it reports. A library or GPU
  without events (`FUNCTION_NOT_FOUND`, `NOT_SUPPORTED`, or no such type) is logged once and
  probed only. The wait is bounded (at most 500 ms) so `stop()` is prompt.
- A probe every `probe_interval` seconds (default 1), two NVML calls per GPU
  (`nvmlDeviceGetHandleByIndex`, `nvmlDeviceGetFieldValues` for the GPU recovery action): a GPU
  whose calls fail with `GPU_IS_LOST`, or that NVML no longer lists, is lost; a lost GPU that
  answers again, or whose recovery action changes, is reported answering with its action. GPUs
  that appear later are registered on the next probe, and so is a lost GPU once it answers again
  (a GPU that fell off the bus lost its registrations).

Each finding goes to `on_event(event)` as a frozen dataclass, called on the watcher's thread
(wrap it with `loop.call_soon_threadsafe` to get it onto the loop). Devices are named as
published, `gpu-<minor>`. One GPU's failure, or a callback that raises, is logged and counted,
never the end of the thread.

Baseline: a GPU first seen answering with recovery action NONE (or unknown) says nothing; one first
seen needing an action is reported answering with it; one first seen lost is reported lost.
On the simulated machine, a reset (`dra-agent sim recover`) is also reported as answering even
when NVML shows no change (after an application XID, whose recovery action stays NONE).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pynvml

from agent.inventory.gpu_event_types import (
    DoubleBitEcc,
    GpuAnswering,
    GpuEvent,
    GpuLost,
    RecoveryAction,
    XidError,
)
from agent.inventory.nvmlgate import NvmlGate
from agent.sim.nvml import SimulatedNvml
from agent.sim.profiles import error_name

log = logging.getLogger(__name__)

__all__ = ["DoubleBitEcc", "GpuAnswering", "GpuEvent", "GpuEventWatcher", "GpuLost", "RecoveryAction",
           "WatcherStats", "XidError"]

PROBE_INTERVAL = 1.0  # seconds between probes
WAIT_MS = 500  # the longest one nvmlEventSetWait_v2 blocks: how long stop() may take
WANTED_EVENTS: int = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
_ABSENT = (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED)
_GONE = (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT)


@dataclass
class _Gpu:
    index: int
    name: str | None = None  # gpu-<minor>, once the GPU said its minor
    uuid: str | None = None
    handle: Any = None
    answering: bool | None = None  # None: not probed yet
    action: RecoveryAction | None = None  # as last reported
    registered: bool = False  # registered for events, or known not to report any
    fields: bool = True  # nvmlDeviceGetFieldValues worth asking
    resets: int = 0


@dataclass
class WatcherStats:
    events: int = 0  # events handed to on_event
    errors: int = 0  # failures logged and gone past
    registered: list[str] = field(default_factory=list)  # devices registered for NVML events


class GpuEventWatcher:
    def __init__(self, nvml: Any, on_event: Callable[[GpuEvent], None], *,
                 probe_interval: float = PROBE_INTERVAL, wait_ms: int = WAIT_MS,
                 control_dir: Path | None = None, name_hint: Callable[[int], str | None] | None = None,
                 gate: NvmlGate | None = None) -> None:
        """`nvml`: the pynvml module or a SimulatedNvml, initialized. `control_dir`: on the simulated
        machine, where `dra-agent sim` writes its commands (watched while this watcher runs).
        `name_hint`: the published name of the GPU at an NVML index that never said its minor.
        `gate`: the GPU source's (every probe and wait uses NVML through it; when it is released, the
        event set is freed and every handle forgotten, and the GPUs are learnt afresh afterwards)."""
        self.nvml = nvml
        self.gate = gate if gate is not None else NvmlGate(nvml)
        self._generation = self.gate.generation
        self.on_event = on_event
        self.probe_interval = probe_interval
        self.wait_ms = max(1, min(int(wait_ms), WAIT_MS))
        self.control_dir = control_dir
        self.name_hint = name_hint
        self.stats = WatcherStats()
        self._sim = nvml if isinstance(nvml, SimulatedNvml) else None
        self._gpus: dict[int, _Gpu] = {}
        self._by_handle: dict[int, int] = {}  # handle address -> NVML index
        self._by_uuid: dict[str, int] = {}
        self._event_set: Any = None
        self._events_absent = False
        self._logged: dict[str, str] = {}  # key -> message already logged, logged again when it changes
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._sim is not None and self.control_dir is not None:
            try:
                self._sim.watch_control(self.control_dir)
            except OSError as exc:  # out of inotify instances, an unwritable state dir: events still flow
                log.warning("dra-agent sim commands are not applied: cannot watch %s: %s", self.control_dir, exc)
                self.control_dir = None
        self.gate.on_release(self._release)
        self._thread = threading.Thread(target=self._run, name="gpu-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        self.gate.forget(self._release)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        if self._sim is not None and self.control_dir is not None:
            self._sim.stop_watching()

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
                        self._guarded("probe", self._probe)
                        next_probe = now + self.probe_interval
                    left = max(0.0, min(self.wait_ms / 1000, next_probe - time.monotonic()))
                    waited = self._event_set is not None and self._guarded("wait", functools.partial(self._wait, left))
                if not waited:
                    self._stopping.wait(left)
        finally:
            with self.gate.use():
                self._free_event_set()

    def _release(self) -> None:
        """NVML is about to be shut down (`NvmlGate.released`; this thread waits at the gate): the event set
        goes, and with the next initialization every GPU is learnt again (its NVML index may have changed;
        one that left the NVIDIA driver is simply not listed, never lost)."""
        self._free_event_set()
        self._gpus.clear()
        self._by_handle.clear()
        self._by_uuid.clear()

    def _guarded(self, what: str, step: Callable[[], object]) -> bool:
        try:
            step()
            return True
        except Exception as exc:  # the thread outlives whatever one step raises
            self._error(f"<{what}>", f"GPU events: {what} failed: {_describe(exc)}", exc)
            return False

    def _wait(self, seconds: float) -> None:
        try:
            data = self.nvml.nvmlEventSetWait_v2(self._event_set, max(1, int(seconds * 1000)))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return
            if exc.value in _ABSENT:
                self._no_events(f"nvmlEventSetWait_v2: {_describe(exc)}")
                return
            raise
        self._handle_event(data)

    # -- events ---------------------------------------------------------------------------------

    def _ensure_event_set(self) -> None:
        if self._event_set is not None or self._events_absent:
            return
        try:
            self._event_set = self.nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            if exc.value in _ABSENT:
                self._no_events(f"nvmlEventSetCreate: {_describe(exc)}")
                return
            raise

    def _no_events(self, why: str) -> None:
        log.warning("NVML events are not available (%s); GPUs are probed every %.1f s only", why,
                    self.probe_interval)
        self._events_absent = True
        self._free_event_set()

    def _free_event_set(self) -> None:
        event_set, self._event_set = self._event_set, None
        if event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(event_set)
            except Exception as exc:  # the library may be shut down already
                log.debug("nvmlEventSetFree: %s", _describe(exc))

    def _register(self, gpu: _Gpu) -> None:
        if gpu.registered or self._event_set is None or gpu.name is None:
            return
        try:
            supported = int(self.nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle))
            wanted = supported & WANTED_EVENTS
            if wanted:
                self.nvml.nvmlDeviceRegisterEvents(gpu.handle, wanted, self._event_set)
        except pynvml.NVMLError as exc:
            if exc.value not in _ABSENT:
                raise
            log.info("%s: NVML events not supported (%s); probed only", gpu.name, _describe(exc))
        else:
            if wanted:
                self.stats.registered.append(gpu.name)
                log.debug("%s: registered for NVML events 0x%x", gpu.name, wanted)
            else:
                log.info("%s reports neither XID nor double-bit ECC events; probed only", gpu.name)
        gpu.registered = True

    def _handle_event(self, data: Any) -> None:
        gpu = self._gpu_of_handle(data.device)
        if gpu is None or gpu.name is None:
            self._error("<event>", f"NVML event 0x{int(data.eventType):x} for a GPU this agent has no name for")
            return
        try:
            action = self._action(gpu)
        except pynvml.NVMLError as exc:  # the event matters more than the action: sent without it
            self._error(f"<gpu {gpu.index}>", f"{gpu.name}: recovery action after an event: {_describe(exc)}")
            action = RecoveryAction.UNKNOWN
        else:
            gpu.action = action  # reported with this event: the probe need not report it again
        at = datetime.now(UTC)
        if int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
            self._emit(XidError(gpu.name, int(data.eventData), action, at))
        elif int(data.eventType) & pynvml.nvmlEventTypeDoubleBitEccError:
            self._emit(DoubleBitEcc(gpu.name, action, at))

    def _gpu_of_handle(self, handle: Any) -> _Gpu | None:
        index = self._by_handle.get(_address(handle))
        if index is None:
            # A handle this watcher did not see: NVML handles are stable, but its UUID tells for sure.
            try:
                index = self._by_uuid.get(str(self.nvml.nvmlDeviceGetUUID(handle)))
            except pynvml.NVMLError:
                return None
        return None if index is None else self._gpus.get(index)

    # -- the probe ------------------------------------------------------------------------------

    def _probe(self) -> None:
        self._ensure_event_set()
        count = int(self.nvml.nvmlDeviceGetCount())
        for index in range(count):
            gpu = self._gpus.setdefault(index, _Gpu(index))
            try:
                self._probe_gpu(gpu)
            except Exception as exc:  # one GPU's failure costs that GPU's probe only
                self._error(f"<gpu {index}>", f"{self._label(gpu)}: probe failed: {_describe(exc)}", exc)
        for index in sorted(set(self._gpus) - set(range(count))):
            self._lost(self._gpus[index], f"NVML no longer lists it (index {index} of {count} GPUs)")

    def _probe_gpu(self, gpu: _Gpu) -> None:
        try:
            handle = self.nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            self._learn(gpu, handle)
            action = self._action(gpu)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                self._lost(gpu, _describe(exc))
                return
            if exc.value in _GONE:
                self._lost(gpu, f"NVML no longer finds it: {_describe(exc)}")
                return
            raise
        self._logged.pop(f"<gpu {gpu.index}>", None)
        resets = self._sim.reset_count(gpu.index) if self._sim is not None else 0
        # (A GPU first seen, also after NVML was initialized again, has its count as the baseline.)
        was_reset, gpu.resets = resets != gpu.resets and gpu.answering is not None, resets
        first = gpu.answering is None
        back = gpu.answering is False
        gpu.answering = True
        changed = gpu.action is not None and action != gpu.action
        needs = first and action not in (RecoveryAction.NONE, RecoveryAction.UNKNOWN)
        gpu.action = action
        self._register(gpu)
        if (back or was_reset or changed or needs) and gpu.name is not None:
            if back:
                log.info("%s answers again (recovery action %s)", gpu.name, action.value)
            self._emit(GpuAnswering(gpu.name, action, datetime.now(UTC)))

    def _learn(self, gpu: _Gpu, handle: Any) -> None:
        """Remember the handle, and the minor and UUID once, so events and failures are named."""
        gpu.handle = handle
        self._by_handle[_address(handle)] = gpu.index
        if gpu.name is None:
            gpu.name = f"gpu-{int(self.nvml.nvmlDeviceGetMinorNumber(handle))}"
        if gpu.uuid is None:
            gpu.uuid = str(self.nvml.nvmlDeviceGetUUID(handle))
            self._by_uuid[gpu.uuid] = gpu.index

    def _action(self, gpu: _Gpu) -> RecoveryAction:
        if not gpu.fields:
            return RecoveryAction.UNKNOWN
        try:
            values = self.nvml.nvmlDeviceGetFieldValues(gpu.handle, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
        except pynvml.NVMLError as exc:
            if exc.value not in _ABSENT:
                raise
            gpu.fields = False
            log.info("%s: the GPU recovery action cannot be read (%s); reported as unknown",
                     self._label(gpu), _describe(exc))
            return RecoveryAction.UNKNOWN
        value = values[0]
        if value.nvmlReturn == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if value.nvmlReturn != pynvml.NVML_SUCCESS:
            return RecoveryAction.UNKNOWN
        action = RecoveryAction.from_nvml(_field_int(value))
        if action is RecoveryAction.UNKNOWN:
            self._note(f"<action {_field_int(value)}>", f"{self._label(gpu)}: GPU recovery action code "
                       f"{_field_int(value)} has no name in this agent; reported as unknown")
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
            self._error("<on_event>", f"GPU events: on_event failed for {event}: {_describe(exc)}", exc)

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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, pynvml.NVMLError):
        return f"{exc} ({error_name(exc.value)})"
    return f"{type(exc).__name__}: {exc}"


def _address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _field_int(value: Any) -> int:
    """The integer in a c_nvmlFieldValue_t, read as its valueType says."""
    kind = value.valueType
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(value.value.ulVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return int(value.value.ullVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(value.value.sllVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        return int(value.value.siVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT:
        return int(value.value.usVal)
    return int(value.value.uiVal)

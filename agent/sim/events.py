"""The simulated NVML's events and recovery actions: event sets that really wait, and the faults that
fill them.

Kept apart from `nvml_sim` (the discovery calls) because it is a small concurrent object of its
own: event sets are queues behind one condition variable, so a thread blocked in
`nvmlEventSetWait_v2` wakes the moment `raise_xid` queues an event, and one waiting for nothing
really sleeps for its timeout, as it would in the driver.

Only the state lives here; `SimulatedNvml` checks initialization, lost GPUs and injected faults
before it delegates, so every call fails the way the rest of the simulated library does.

The recovery actions are the driver's, not the process's: once the machine is materialized
(`keep_actions`) they are kept in `<machine>/gpu-recovery.json` with the simulated boot ID, so a
GPU that needs a reset still does after an agent restart, and no longer after a simulated reboot.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pynvml

from agent.fsutil import atomic_write
from agent.inventory.nvmlcodes import FI_DEV_GET_GPU_RECOVERY_ACTION, NvmlRecoveryCode

log = logging.getLogger(__name__)

# XIDs NVIDIA documents as caused by the application (the contract's list): the GPU needs nothing.
RECOVERY_ACTIONS = "gpu-recovery.json"  # below the machine's directory (`keep_actions`)
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# What the simulated GPUs say they can report (nvmlDeviceGetSupportedEventTypes), as a datacenter
# GPU does: ECC, XIDs, clocks and power states.
SUPPORTED_EVENTS: int = (pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
                    | pynvml.nvmlEventTypePState | pynvml.nvmlEventTypeXidCriticalError
                    | pynvml.nvmlEventTypeClock)

_SET_BASE = 0x5E70_0000  # event set handles are addresses from here, never dereferenced


@dataclass(frozen=True)
class SimEvent:
    index: int  # NVML index of the GPU
    event_type: int  # one nvmlEventType* bit
    data: int  # the XID for nvmlEventTypeXidCriticalError, else 0
    raised_at: float | None = None  # unix seconds, when the command that raised it was written (else now)


@dataclass
class _EventSet:
    registrations: dict[int, int] = field(default_factory=dict)  # GPU index -> event type mask
    queue: deque[SimEvent] = field(default_factory=deque)


class SimEvents:
    """Event sets, per-GPU supported event types and recovery actions of one simulated machine."""

    def __init__(self, gpu_count: int) -> None:
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._waiters_changed = threading.Condition(lock)  # (for `until_waiting`, so waiters never wake each other)
        self._sets: dict[int, _EventSet] = {}
        self._next_set = 1
        self._supported: list[int] = [SUPPORTED_EVENTS] * gpu_count
        self._actions: list[int] = [NvmlRecoveryCode.NONE] * gpu_count
        self._closed = False  # the library was shut down: waiters give up
        self._kept: tuple[Path, Callable[[], str]] | None = None  # (file, boot ID) once `keep_actions`
        self._waiting = 0  # threads blocked in wait() now

    def keep_actions(self, path: Path, boot_id: Callable[[], str]) -> None:
        """Keep the recovery actions in `path` from now on; those saved there in this boot are loaded."""
        try:
            saved = orjson.loads(path.read_bytes())
            actions = [int(a) for a in saved["actions"]]
            if saved["bootId"] == boot_id() and len(actions) == len(self._actions):
                with self._cond:
                    self._actions = actions
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("simulated recovery actions in %s are not readable (%s): every GPU needs none", path, exc)
        self._kept = (path, boot_id)
        self._save()

    def _save(self) -> None:
        if self._kept is None:
            return
        path, boot_id = self._kept
        with self._cond:
            actions = list(self._actions)
        atomic_write(path, orjson.dumps({"bootId": boot_id(), "actions": actions}), mode=0o644)

    # Event sets.
    def create(self) -> Any:
        with self._cond:
            number = self._next_set
            self._next_set += 1
            self._sets[number] = _EventSet()
        return ctypes.cast(ctypes.c_void_p(_SET_BASE + number), pynvml.c_nvmlEventSet_t)

    def free(self, event_set: Any) -> None:
        with self._cond:
            self._sets.pop(self._set_number(event_set))
            self._cond.notify_all()

    def supported(self, index: int) -> int:
        with self._cond:
            return self._supported[index]

    def set_supported(self, index: int, mask: int) -> None:
        with self._cond:
            self._supported[index] = mask

    def register(self, index: int, event_types: int, event_set: Any) -> None:
        with self._cond:
            number = self._set_number(event_set)
            if event_types & ~self._supported[index]:
                # As the driver answers when any requested type is one this GPU cannot report.
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            registrations = self._sets[number].registrations
            registrations[index] = registrations.get(index, 0) | event_types

    def forget(self, index: int) -> None:
        """GPU `index` left the bus: no event set hears from it until it is registered again."""
        with self._cond:
            for entry in self._sets.values():
                entry.registrations.pop(index, None)

    def wait(self, event_set: Any, timeout_ms: int) -> SimEvent:
        """The next event of the set; NVML_ERROR_TIMEOUT when none arrives within `timeout_ms`."""
        deadline = time.monotonic() + max(int(timeout_ms), 0) / 1000
        with self._cond:
            number = self._set_number(event_set)
            while True:
                entry = self._sets.get(number)
                if entry is None:  # freed while this thread waited
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
                if self._closed:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
                if entry.queue:
                    return entry.queue.popleft()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
                self._waiting += 1
                self._waiters_changed.notify_all()
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting -= 1

    def until_waiting(self, count: int, timeout: float) -> bool:
        """Block until `count` threads are blocked in `wait`; False if they are not within `timeout`."""
        with self._waiters_changed:
            return self._waiters_changed.wait_for(lambda: self._waiting >= count, timeout)

    def open(self) -> None:
        with self._cond:
            self._closed = False

    def shutdown(self) -> None:
        """The library was shut down: waiting threads return UNINITIALIZED at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # Faults.
    def queue(self, event: SimEvent, action: int | None) -> int:
        """Deliver `event` to every set registered for its GPU and type; set the GPU's recovery
        action when `action` is given. Returns how many sets received it."""
        delivered = 0
        with self._cond:
            if action is not None:
                self._actions[event.index] = action
            for entry in self._sets.values():
                if entry.registrations.get(event.index, 0) & event.event_type:
                    entry.queue.append(event)
                    delivered += 1
            self._cond.notify_all()
        if action is not None:
            self._save()
        return delivered

    def action(self, index: int) -> int:
        with self._cond:
            return self._actions[index]

    def set_action(self, index: int, action: int) -> None:
        with self._cond:
            self._actions[index] = action
        self._save()

    def _set_number(self, event_set: Any) -> int:
        # Caller holds the condition's lock.
        if not isinstance(event_set, pynvml.c_nvmlEventSet_t):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        number = (ctypes.cast(event_set, ctypes.c_void_p).value or 0) - _SET_BASE
        if number not in self._sets:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return number


def event_data(handle: Any, event: SimEvent) -> Any:
    """The `c_nvmlEventData_t` nvmlEventSetWait_v2 returns for `event`."""
    data = pynvml.c_nvmlEventData_t()
    data.device = handle
    data.eventType = event.event_type
    data.eventData = event.data
    # Not a MIG instance's event: NVML says 0xFFFFFFFF for "no instance".
    data.gpuInstanceId = 0xFFFFFFFF
    data.computeInstanceId = 0xFFFFFFFF
    if event.raised_at is not None:
        # Not NVML's: an XID a command written while no agent ran raised when the machine applied it is as
        # old as the command (`agent.sim.nvmlopen.SimCommands.raised_at` reads it for the event watcher).
        data.raised_at = event.raised_at
    return data


def field_values(field_ids: list[int] | list[tuple[int, int]], recovery_action: int) -> Any:
    """The `c_nvmlFieldValue_t` array nvmlDeviceGetFieldValues returns: the GPU recovery action
    where asked, NOT_SUPPORTED in each other entry's nvmlReturn (as the driver answers per field)."""
    values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
    now_us = time.time_ns() // 1000
    for entry, field_id in zip(values, field_ids, strict=True):
        if isinstance(field_id, tuple):
            entry.fieldId, entry.scopeId = field_id
        else:
            entry.fieldId = field_id
        entry.timestamp = now_us
        entry.latencyUsec = 0
        if entry.fieldId == FI_DEV_GET_GPU_RECOVERY_ACTION:
            entry.nvmlReturn = pynvml.NVML_SUCCESS
            entry.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            entry.value.uiVal = recovery_action
        else:
            entry.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
    return values

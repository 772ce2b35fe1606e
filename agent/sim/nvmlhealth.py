"""The simulated NVML's device health: the pynvml event API (`nvmlEventSetCreate`,
`nvmlDeviceGetSupportedEventTypes`, `nvmlDeviceRegisterEvents`, `nvmlEventSetWait_v2`, `nvmlEventSetFree`),
`nvmlDeviceGetFieldValues` for the GPU recovery action, and the faults that feed them (`raise_xid`,
`raise_double_bit_ecc`, `lose`, `recover`), also as command files from outside the process
(`watch_control`, `agent.sim.control`). Mixed into `SimulatedNvml` (`agent.sim.nvml`), whose lock, GPU
state and checks it uses; the event sets themselves are `agent.sim.events`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

import pynvml

from agent.inventory.nvmlcodes import NvmlRecoveryCode
from agent.sim.control import ControlWatcher, SimCommand, device_index
from agent.sim.events import APPLICATION_XIDS, SimEvent, SimEvents, event_data, field_values
from agent.sim.machine import SimGpu, SimProfile
from agent.sim.mighandles import address, gpu_handle
from agent.sim.nvmlview import NvmlView

# The event and field-value calls, which faults may name too (`inject_error`).
EVENT_DEVICE_FUNCTIONS = frozenset({"nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents",
                                    "nvmlDeviceGetFieldValues"})
EVENT_SYSTEM_FUNCTIONS = frozenset({"nvmlEventSetCreate", "nvmlEventSetWait_v2", "nvmlEventSetWait",
                                    "nvmlEventSetFree"})


class _Nvml(Protocol):
    """What the health calls need of the simulated NVML they are part of."""

    profile: SimProfile
    _lock: threading.Lock
    _lost: list[bool]
    _resets: list[int]
    _events: SimEvents
    _control: ControlWatcher | None
    _view: NvmlView

    def _checked_index(self, index: int) -> int: ...

    def _system(self, function: str) -> None: ...

    def _device(self, function: str, handle: Any) -> tuple[int, SimGpu]: ...

    def lose(self, index: int) -> None: ...

    def raise_xid(self, index: int, xid: int, *, raised_at: float | None = None) -> int: ...

    def recover(self, index: int) -> None: ...

    def apply(self, command: SimCommand) -> None: ...

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any: ...


class SimHealth:
    """The event API and health faults of `SimulatedNvml`."""

    _control: ControlWatcher | None  # the command files watched (`watch_control`), if any

    def lose(self: _Nvml, index: int) -> None:
        """The GPU falls off the bus: every call about it fails with GPU_IS_LOST, and its event
        registrations are gone (the GPU that comes back after a reset is registered afresh)."""
        with self._lock:
            self._lost[self._checked_index(index)] = True
        self._events.forget(index)

    def raise_xid(self: _Nvml, index: int, xid: int, *, raised_at: float | None = None) -> int:
        """An XID on GPU `index`: queued to every event set registered for it and for XID critical
        errors, and the GPU's recovery action set (NONE for an application XID, else GPU_RESET).
        Returns how many event sets received it."""
        if isinstance(xid, bool) or not isinstance(xid, int) or not 0 < xid < 1000:
            raise ValueError(f"XID must be an integer 1..999, not {xid!r}")
        action = (NvmlRecoveryCode.NONE if xid in APPLICATION_XIDS
                  else NvmlRecoveryCode.GPU_RESET)
        event = SimEvent(self._checked_index(index), pynvml.nvmlEventTypeXidCriticalError, xid, raised_at)
        return self._events.queue(event, action)

    def raise_double_bit_ecc(self: _Nvml, index: int) -> int:
        """An uncorrectable (double-bit) ECC error on GPU `index`; the GPU then needs a reset."""
        event = SimEvent(self._checked_index(index), pynvml.nvmlEventTypeDoubleBitEccError, 0)
        return self._events.queue(event, NvmlRecoveryCode.GPU_RESET)

    def recover(self: _Nvml, index: int) -> None:
        """A GPU reset: the GPU answers again and needs nothing (recovery action NONE)."""
        with self._lock:
            self._lost[self._checked_index(index)] = False
            self._resets[index] += 1
        self._events.set_action(index, NvmlRecoveryCode.NONE)

    def reset_count(self: _Nvml, index: int) -> int:
        """How many resets (`recover`) the GPU at NVML index `index` has had: not an NVML call, but the one
        way a reset that changed nothing NVML shows (after an application XID) can be seen."""
        slot = self._view.slot(index)
        with self._lock:
            return self._resets[self._checked_index(index if slot is None else slot)]

    def wait_for_waiters(self: _Nvml, count: int = 1, timeout: float = 30.0) -> None:
        """Block until `count` threads wait in nvmlEventSetWait(_v2) (TimeoutError if they do not
        within `timeout` s): a test raises its event only once the waiter it means to wake waits."""
        if not self._events.until_waiting(count, timeout):
            raise TimeoutError(f"{count} threads did not wait for NVML events within {timeout:g}s")

    def set_supported_events(self: _Nvml, index: int, mask: int) -> None:
        """What nvmlDeviceGetSupportedEventTypes answers for GPU `index` (0: no events at all)."""
        self._events.set_supported(self._checked_index(index), mask)

    def apply(self: _Nvml, command: SimCommand) -> None:
        """Apply one control command (see `nvml_sim_control`)."""
        index = device_index(self.profile, command.device)
        if command.command == "xid":
            assert command.xid is not None  # SimCommand checks it
            self.raise_xid(index, command.xid, raised_at=command.written)
        elif command.command == "lose":
            self.lose(index)
        else:
            self.recover(index)

    # The control channel.
    def watch_control(self: _Nvml, directory: Path) -> None:
        """Apply the command files written to `directory` now and whenever new ones appear."""
        if self._control is not None:
            raise RuntimeError(f"the simulated NVML already watches {self._control.directory}")
        control = ControlWatcher(directory, self.apply)
        control.start()
        self._control = control

    def stop_watching(self: _Nvml) -> None:
        control, self._control = self._control, None
        if control is not None:
            control.stop()

    def nvmlEventSetCreate(self: _Nvml) -> Any:
        self._system("nvmlEventSetCreate")
        return self._events.create()

    def nvmlDeviceGetSupportedEventTypes(self: _Nvml, handle: Any) -> int:
        index = self._device("nvmlDeviceGetSupportedEventTypes", handle)[0]
        return self._events.supported(index)

    def nvmlDeviceRegisterEvents(self: _Nvml, handle: Any, eventTypes: int, eventSet: Any) -> None:
        index = self._device("nvmlDeviceRegisterEvents", handle)[0]
        self._events.register(index, int(eventTypes), eventSet)
        self._view.register(address(eventSet), index)

    def nvmlEventSetWait_v2(self: _Nvml, eventSet: Any, timeoutms: int) -> Any:
        self._system("nvmlEventSetWait_v2")
        event = self._events.wait(eventSet, timeoutms)
        return event_data(gpu_handle(event.index), event)

    def nvmlEventSetWait(self: _Nvml, eventSet: Any, timeoutms: int) -> Any:
        self._system("nvmlEventSetWait")
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self: _Nvml, eventSet: Any) -> None:
        self._system("nvmlEventSetFree")
        self._events.free(eventSet)
        self._view.free_set(address(eventSet))

    def nvmlDeviceGetFieldValues(self: _Nvml, handle: Any, fieldIds: list[int] | list[tuple[int, int]]) -> Any:
        index = self._device("nvmlDeviceGetFieldValues", handle)[0]
        return field_values(fieldIds, self._events.action(index))

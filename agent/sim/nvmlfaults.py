"""The simulated NVML's fault injection and control channel: what tests and `dra-agent sim` do to the
simulated GPUs (lose one, raise an XID or an ECC error, reset it), kept apart from the NVML calls
(`agent.sim.nvml`), which answer according to the state these set."""

from __future__ import annotations

import threading
from pathlib import Path

import pynvml

from agent.sim.control import ControlWatcher, SimCommand, device_index
from agent.sim.events import APPLICATION_XIDS, SimEvent, SimEvents
from agent.sim.nvmlview import NvmlView
from agent.sim.profiles import DEVICE_FUNCTIONS, SYSTEM_FUNCTIONS, SimProfile, error_code

# The event and field-value calls, which faults may name too (`inject_error`).
EVENT_DEVICE_FUNCTIONS = frozenset({"nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents",
                                    "nvmlDeviceGetFieldValues"})
EVENT_SYSTEM_FUNCTIONS = frozenset({"nvmlEventSetCreate", "nvmlEventSetWait_v2", "nvmlEventSetWait",
                                    "nvmlEventSetFree"})
# Persistence mode (off on every GPU at start, as after a boot without nvidia-persistenced).
PERSISTENCE_FUNCTIONS = frozenset({"nvmlDeviceGetPersistenceMode", "nvmlDeviceSetPersistenceMode"})


class SimFaults:
    """The faults of a simulated machine's GPUs, by profile index (the NVML index while every GPU is listed)."""

    profile: SimProfile
    _lock: threading.Lock
    _system_errors: dict[str, int]
    _gpu_errors: list[dict[str, int]]
    _lost: list[bool]
    _resets: list[int]
    _events: SimEvents
    _control: ControlWatcher | None
    _view: NvmlView
    _fault_functions: frozenset[str]

    # Fault injection.
    def inject_error(self, index: int | None, function: str, code: int | str) -> None:
        """Make `function` fail with `code` on GPU `index` (None: a system call, or every GPU)."""
        allowed = DEVICE_FUNCTIONS | EVENT_DEVICE_FUNCTIONS | self._fault_functions | PERSISTENCE_FUNCTIONS
        if index is None:
            allowed |= SYSTEM_FUNCTIONS | EVENT_SYSTEM_FUNCTIONS
        if function not in allowed:
            raise ValueError(f"{function!r} is not a function the simulated NVML answers")
        value = error_code(code, function)
        with self._lock:
            if index is None:
                self._system_errors[function] = value
            else:
                self._gpu_errors[self._checked_index(index)][function] = value

    def lose(self, index: int) -> None:
        """The GPU falls off the bus: every call about it fails with GPU_IS_LOST, and its event
        registrations are gone (the GPU that comes back after a reset is registered afresh)."""
        with self._lock:
            self._lost[self._checked_index(index)] = True
        self._events.forget(index)

    def raise_xid(self, index: int, xid: int) -> int:
        """An XID on GPU `index`: queued to every event set registered for it and for XID critical
        errors, and the GPU's recovery action set (NONE for an application XID, else GPU_RESET).
        Returns how many event sets received it."""
        if isinstance(xid, bool) or not isinstance(xid, int) or not 0 < xid < 1000:
            raise ValueError(f"XID must be an integer 1..999, not {xid!r}")
        action = (pynvml.NVML_GPU_RECOVERY_ACTION_NONE if xid in APPLICATION_XIDS
                  else pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
        event = SimEvent(self._checked_index(index), pynvml.nvmlEventTypeXidCriticalError, xid)
        return self._events.queue(event, action)

    def raise_double_bit_ecc(self, index: int) -> int:
        """An uncorrectable (double-bit) ECC error on GPU `index`; the GPU then needs a reset."""
        event = SimEvent(self._checked_index(index), pynvml.nvmlEventTypeDoubleBitEccError, 0)
        return self._events.queue(event, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)

    def recover(self, index: int) -> None:
        """A GPU reset: the GPU answers again and needs nothing (recovery action NONE)."""
        with self._lock:
            self._lost[self._checked_index(index)] = False
            self._resets[index] += 1
        self._events.set_action(index, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)

    def reset_count(self, index: int) -> int:
        """How many resets (`recover`) the GPU at NVML index `index` has had: not an NVML call, but the one
        way a reset that changed nothing NVML shows (after an application XID) can be seen."""
        slot = self._view.slot(index)
        with self._lock:
            return self._resets[self._checked_index(index if slot is None else slot)]

    def set_supported_events(self, index: int, mask: int) -> None:
        """What nvmlDeviceGetSupportedEventTypes answers for GPU `index` (0: no events at all)."""
        self._events.set_supported(self._checked_index(index), mask)

    def apply(self, command: SimCommand) -> None:
        """Apply one control command (see `nvml_sim_control`)."""
        index = device_index(self.profile, command.device)
        if command.command == "xid":
            assert command.xid is not None  # SimCommand checks it
            self.raise_xid(index, command.xid)
        elif command.command == "lose":
            self.lose(index)
        else:
            self.recover(index)

    # The control channel.
    def watch_control(self, directory: Path) -> None:
        """Apply the command files written to `directory` now and whenever new ones appear."""
        if self._control is not None:
            raise RuntimeError(f"the simulated NVML already watches {self._control.directory}")
        control = ControlWatcher(directory, self.apply)
        control.start()
        self._control = control

    def stop_watching(self) -> None:
        control, self._control = self._control, None
        if control is not None:
            control.stop()

    def clear_errors(self) -> None:
        with self._lock:
            self._system_errors.clear()
            for errors in self._gpu_errors:
                errors.clear()
            self._lost = [False] * len(self._lost)
        for index in range(len(self.profile.gpus)):
            self._events.set_action(index, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)

    def _checked_index(self, index: int) -> int:
        if not 0 <= index < len(self.profile.gpus):
            raise IndexError(f"profile {self.profile.name} has no GPU {index}")
        return index

"""The GPU event watcher's NVML event set: made on first use, each GPU registered once for the XID
critical and double-bit ECC events it supports, waited on with a bound.

A library or GPU without events (`FUNCTION_NOT_FOUND`, `NOT_SUPPORTED`, or none of the wanted types)
is said once in the log and left to the watcher's probe (`agent.inventory.gpu_events`). Used on the
watcher's thread only.
"""

from __future__ import annotations

import logging
from typing import Any

import pynvml

from agent.inventory.nvmlapi import Nvml, NvmlHandle
from agent.inventory.nvmlvalues import describe_error

log = logging.getLogger(__name__)

WANTED_EVENTS: int = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
ABSENT = (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED)


class EventSet:
    def __init__(self, nvml: Nvml, probe_interval: float, registered: list[str]) -> None:
        self.nvml = nvml  # initialized
        self.probe_interval = probe_interval  # said when events are not available
        self.registered = registered  # devices registered for NVML events, appended to (the watcher's stats)
        self._set: NvmlHandle = None
        self._absent = False  # no events from this library: never asked again

    @property
    def active(self) -> bool:
        return self._set is not None

    def ensure(self) -> None:
        """Make the event set, unless there is one or the library has no events."""
        if self._set is not None or self._absent:
            return
        try:
            self._set = self.nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            if exc.value in ABSENT:
                self._no_events(f"nvmlEventSetCreate: {describe_error(exc)}")
                return
            raise

    def free(self) -> None:
        event_set, self._set = self._set, None
        if event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(event_set)
            except Exception as exc:  # the library may be shut down already
                log.debug("nvmlEventSetFree: %s", describe_error(exc))

    def register(self, name: str, handle: NvmlHandle) -> None:
        """Register GPU `name` for the wanted events it supports (or say that it reports none).
        NVMLError for anything but the absence of events."""
        try:
            supported = int(self.nvml.nvmlDeviceGetSupportedEventTypes(handle))
            wanted = supported & WANTED_EVENTS
            if wanted:
                self.nvml.nvmlDeviceRegisterEvents(handle, wanted, self._set)
        except pynvml.NVMLError as exc:
            if exc.value not in ABSENT:
                raise
            log.info("%s: NVML events not supported (%s); probed only", name, describe_error(exc))
            return
        if wanted:
            self.registered.append(name)
            log.debug("%s: registered for NVML events 0x%x", name, wanted)
        else:
            log.info("%s reports neither XID nor double-bit ECC events; probed only", name)

    def wait(self, seconds: float) -> Any:
        """The next event's data, or None when none came within `seconds` (at least 1 ms) or the library
        turned out to have no events."""
        try:
            return self.nvml.nvmlEventSetWait_v2(self._set, max(1, int(seconds * 1000)))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            if exc.value in ABSENT:
                self._no_events(f"nvmlEventSetWait_v2: {describe_error(exc)}")
                return None
            raise

    def _no_events(self, why: str) -> None:
        log.warning("NVML events are not available (%s); GPUs are probed every %.1f s only", why,
                    self.probe_interval)
        self._absent = True
        self.free()

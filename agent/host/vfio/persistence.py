"""NVML persistence mode of a GPU about to leave its host driver.

With persistence mode on, the NVIDIA driver keeps the GPU initialized with no client, and
`nvidia-persistenced` (when it set the mode) holds the device open: unbinding then either blocks in
the driver or pulls the GPU from under the daemon. So a GPU with persistence mode on is DeviceBusy
(retryable: turn it off with `nvidia-smi -i <bus id> -pm 0`, or stop the daemon).

NVML may not say: no NVML open (no GPU source, the library did not load), the GPU not in NVML's
list, or a library without the call (`FunctionNotFound`, older or stand-in libraries) or a GPU
without the feature (`NotSupported`). Then the mode is unknown and nothing is refused here: the
`/proc` scan (`agent.host.vfio.inuse`) still sees the daemon's open handle.
"""

from __future__ import annotations

import logging
from typing import Protocol

import pynvml

from agent.host.vfio.errors import DeviceBusy

log = logging.getLogger(__name__)


class PersistenceNvml(Protocol):
    """The two NVML calls this check makes (every `agent.inventory.nvmlapi.Nvml` has them)."""

    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str) -> object: ...

    def nvmlDeviceGetPersistenceMode(self, handle: object) -> int: ...


def persistence_mode(nvml: PersistenceNvml | None, bdf: str) -> bool | None:
    """Whether GPU `bdf` has persistence mode on; None when NVML cannot say (see the module docstring)."""
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByPciBusId(bdf)
        return bool(int(nvml.nvmlDeviceGetPersistenceMode(handle)) == pynvml.NVML_FEATURE_ENABLED)
    except pynvml.NVMLError as exc:
        log.debug("GPU %s: persistence mode unknown (NVML: %s)", bdf, exc)
        return None


def check_persistence_off(nvml: PersistenceNvml | None, bdf: str) -> None:
    """DeviceBusy when NVML says GPU `bdf` has persistence mode on; nothing when it is off or unknown."""
    if persistence_mode(nvml, bdf):
        raise DeviceBusy(f"GPU {bdf} has NVML persistence mode on: the NVIDIA driver keeps it in use; turn it "
                         f"off (nvidia-smi -i {bdf} -pm 0, or stop nvidia-persistenced) before passing it through")

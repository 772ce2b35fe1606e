"""NVML queries of a GPU's MIG instances, for `agent.hostprep.mig`: the GPU instances on a GPU, the one at
a placement, and the compute instances of a GPU instance (NVML's list-out convention). Blocking; NVML
errors are raised as NVML raises them, for the caller to judge."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pynvml

from agent.inventory import mig as migs
from agent.inventory.nvmlapi import Nvml, NvmlHandle

# Compute instance profiles, largest first (the full-size one of a GPU instance is the first it offers
# whose slices equal its own).
CI_PROFILES = (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
               pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
               pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)


def gpu_instances(nv: Nvml, handle: NvmlHandle) -> list[tuple[int, int, int, str]]:
    """(id, start, size, profile name) of every GPU instance on the GPU."""
    layout = migs.read_layout(nv, handle)
    out = []
    for p in layout.profiles if layout else ():
        for gi in listed(nv.nvmlDeviceGetGpuInstances, handle, p.id, pynvml.c_nvmlGpuInstance_t):
            info = nv.nvmlGpuInstanceGetInfo(gi)
            out.append((int(info.id), int(info.placement.start), int(info.placement.size), p.name))
    return out


def gi_at(nv: Nvml, handle: NvmlHandle, profile_id: int, start: int) -> int | None:
    """The id of the GPU instance of the profile at `start`, None when there is none."""
    for gi in listed(nv.nvmlDeviceGetGpuInstances, handle, profile_id, pynvml.c_nvmlGpuInstance_t):
        info = nv.nvmlGpuInstanceGetInfo(gi)
        if int(info.placement.start) == start:
            return int(info.id)
    return None


def ci_handles(nv: Nvml, gi: NvmlHandle) -> list[NvmlHandle]:
    """The compute instances of a GPU instance, of every profile it offers."""
    out = []
    for ci_profile in CI_PROFILES:
        try:
            out += listed(nv.nvmlGpuInstanceGetComputeInstances, gi, ci_profile, pynvml.c_nvmlComputeInstance_t)
        except pynvml.NVMLError:
            continue
    return out


def ci_ids(nv: Nvml, gi: NvmlHandle) -> list[int]:
    return [int(nv.nvmlComputeInstanceGetInfo(ci).id) for ci in ci_handles(nv, gi)]


def listed(call: Callable[..., Any], owner: Any, profile_id: int, kind: Any, most: int = 8) -> list[Any]:
    """NVML's list-out convention: an array of `most` (a GPU has at most 7 GPU instances, a GPU
    instance 8 compute instances) and its size in, how many were filled out."""
    array = (kind * most)()
    count = ctypes.c_uint(most)
    try:
        call(owner, profile_id, array, ctypes.byref(count))
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
            return []  # MIG mode off: no instances
        raise
    return list(array[: count.value])

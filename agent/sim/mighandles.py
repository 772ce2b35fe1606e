"""Handles of the simulated NVML's GPUs and MIG objects, and NVML's calling conventions for list and out
arguments.

A GPU instance, compute instance or MIG device handle is a pointer-sized value that encodes the GPU's
index and the instance ids (`split`), so a handle stays valid as long as the instance it names exists,
whichever process created it.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

GPU_BASE = 0x5151_0000
GI_BASE = 0x6A00_0000
CI_BASE = 0x6B00_0000
MIG_BASE = 0x6C00_0000
_SUCCESS: int = pynvml.NVML_SUCCESS
PER_GPU = 0x1_0000  # handle space per GPU: GPU instance id * 256 + compute instance id


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def fill(arrayRef: Any, countRef: Any, items: list[Any]) -> int:
    """NVML's list-out convention: with no array, say how many; with one too small (count in), fail
    INSUFFICIENT_SIZE saying how many; else fill it and say how many."""
    count = target(countRef)
    if arrayRef is not None:
        if count.value < len(items):
            count.value = len(items)
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        out = target(arrayRef)
        for i, item in enumerate(items):
            out[i] = item
    count.value = len(items)
    return _SUCCESS


def target(ref: Any) -> Any:
    """The object behind a ctypes argument as pynvml callers pass it: `byref(x)`, `pointer(x)` or `x`."""
    if ref is None:
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    obj = getattr(ref, "_obj", None)  # ctypes.byref(...) keeps its object here
    if obj is not None:
        return obj
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    return ref


def address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def split(offset: int) -> tuple[int, int, int]:
    """A handle's offset from its base -> (GPU index, GPU instance id, compute instance id)."""
    gpu, rest = divmod(offset, PER_GPU)
    gi, ci = divmod(rest, 256)
    return gpu, gi, ci


def gi_handle(index: int, gi: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(GI_BASE + index * PER_GPU + gi * 256), pynvml.c_nvmlGpuInstance_t)


def ci_handle(index: int, gi: int, ci: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(CI_BASE + index * PER_GPU + gi * 256 + ci),
                       pynvml.c_nvmlComputeInstance_t)


def mig_handle(index: int, gi: int, ci: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(MIG_BASE + index * PER_GPU + gi * 256 + ci), pynvml.c_nvmlDevice_t)


def gpu_handle(index: int) -> Any:
    """GPU `index`'s handle: a real c_nvmlDevice_t, never dereferenced; its address encodes the index."""
    return ctypes.cast(ctypes.c_void_p(GPU_BASE + index), pynvml.c_nvmlDevice_t)


def gpu_index(handle: Any, count: int) -> int:
    """The index of the GPU `handle` names, one of `count` GPUs (INVALID_ARGUMENT otherwise)."""
    if not isinstance(handle, pynvml.c_nvmlDevice_t):
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    index = address(handle) - GPU_BASE
    if not 0 <= index < count:
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return index

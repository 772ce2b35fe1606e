"""The simulated NVML's MIG: GPU instance profiles, their placements, and GPU and compute instances.

`SimMig` answers the pynvml MIG calls (same names, arguments, structs and errors as the module)
for the GPUs of a simulated machine; `SimulatedNvml` delegates them here. Placement rules are
the hardware's as NVML states them: a GPU instance occupies the memory slices of its placement
(`start`, `size`), a placement must be one `nvmlDeviceGetGpuInstancePossiblePlacements` lists for
its profile, two instances never share a memory slice, and a profile has at most `instanceCount`
instances. Anything else fails as NVML does: an overlap or one instance too many is
`NVML_ERROR_INSUFFICIENT_RESOURCES`, an unlisted placement `NVML_ERROR_INVALID_ARGUMENT`, a profile
the GPU does not offer `NVML_ERROR_NOT_SUPPORTED`, creating with MIG mode off
`NVML_ERROR_NOT_SUPPORTED`, destroying a GPU instance that still has compute instances (or turning
MIG off while GPU instances exist) `NVML_ERROR_IN_USE`.

Profile queries (profile info, placements) answer whatever the MIG mode, as drivers that report
`NVML_FI_DEV_IS_MIG_MODE_INDEPENDENT_MIG_QUERY_CAPABLE` do, so a GPU with MIG off still shows what it
could be split into. `nvmlDeviceSetMigMode` takes effect at once here (activation status
NVML_SUCCESS); on real hardware the change may stay pending until a GPU reset
(`nvmlDeviceGetMigMode` then answers [current, pending] with the two differing).

The profile tables (H100 80GB) are in `agent.inventory.nvml_mig_profiles`.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from agent.inventory.nvml_mig_profiles import MigProfileSpec

# Compute instance profiles a GPU instance offers: NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE, n <= its slices.
_CI_PROFILES = {pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: 1, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
                pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: 3, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
                pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: 7}
_SUCCESS: int = pynvml.NVML_SUCCESS
_NO_ROOM: int = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
_GI_BASE = 0x6A00_0000
_CI_BASE = 0x6B00_0000
_MIG_BASE = 0x6C00_0000
_PER_GPU = 0x1_0000  # handle space per GPU: GPU instance id * 256 + compute instance id


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass(slots=True)
class _Gi:
    id: int
    spec: MigProfileSpec
    start: int
    cis: dict[int, int] = field(default_factory=dict)  # compute instance id -> its compute slices

    def covers(self) -> set[int]:
        return set(range(self.start, self.start + self.spec.size))


@dataclass(slots=True)
class _GpuMig:
    table: tuple[MigProfileSpec, ...]
    mode: int
    gis: dict[int, _Gi] = field(default_factory=dict)


# (function, GPU handle) -> (GPU index, its UUID), raising the GPU's faults; (function, GPU index) -> its
# UUID, likewise; GPU index -> its handle.
Resolve = Callable[[str, Any], tuple[int, str]]
Check = Callable[[str, int], str]
HandleOf = Callable[[int], Any]


class SimMig:
    """MIG state of every simulated GPU (`modes[i]` None: GPU i is not MIG capable). `resolve` checks a
    GPU handle (and its faults) and names the GPU; `check` does the same for a GPU index (calls on
    instance handles); `handle_of` gives a GPU's handle."""

    def __init__(self, tables: list[tuple[MigProfileSpec, ...]], modes: list[int | None],
                 resolve: Resolve, check: Check, handle_of: HandleOf) -> None:
        self._lock = threading.Lock()
        self._gpus: list[_GpuMig | None] = [
            None if mode is None else _GpuMig(table, mode) for table, mode in zip(tables, modes, strict=True)]
        self._resolve = resolve
        self._check = check
        self._handle_of = handle_of

    # -- MIG mode ------------------------------------------------------------------------------------

    def mode(self, index: int) -> list[int] | None:
        """[current, pending] for GPU `index`; None: not MIG capable."""
        gpu = self._gpus[index]
        return None if gpu is None else [gpu.mode, gpu.mode]

    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        gpu = self._gpu("nvmlDeviceSetMigMode", device)[1]
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            if mode == pynvml.NVML_DEVICE_MIG_DISABLE and gpu.gis:
                raise _err(pynvml.NVML_ERROR_IN_USE)
            gpu.mode = mode
        return _SUCCESS  # the activation status: applied, no reset needed here

    # -- profiles and placements ---------------------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        spec = self._spec_by_enum(self._gpu("nvmlDeviceGetGpuInstanceProfileInfo", device)[1], profile)
        if version == 2:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = f"MIG {spec.name}".encode()
        elif version == 1:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
        else:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = spec.id
        info.isP2pSupported = 0
        info.sliceCount = spec.slices
        info.instanceCount = spec.instances
        info.multiprocessorCount = spec.multiprocessors
        info.copyEngineCount = spec.copy_engines
        info.decoderCount = spec.decoders
        info.encoderCount = spec.encoders
        info.jpegCount = spec.jpegs
        info.ofaCount = spec.ofas
        info.memorySizeMB = spec.memory_mib
        return info

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, device: Any, profileId: int, placementsRef: Any,
                                                   countRef: Any) -> int:
        spec = self._spec_by_id(self._gpu("nvmlDeviceGetGpuInstancePossiblePlacements", device)[1], profileId)
        return _fill(placementsRef, countRef, [pynvml.c_nvmlGpuInstancePlacement_t(start, spec.size)
                                               for start in spec.starts])

    nvmlDeviceGetGpuInstancePossiblePlacements_v2 = nvmlDeviceGetGpuInstancePossiblePlacements

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        gpu = self._gpu("nvmlDeviceGetGpuInstanceRemainingCapacity", device)[1]
        spec = self._spec_by_id(gpu, profileId)
        with self._lock:
            if gpu.mode != pynvml.NVML_DEVICE_MIG_ENABLE:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return sum(1 for s in spec.starts if self._refusal(gpu, spec, s) is None)

    # -- GPU instances -------------------------------------------------------------------------------

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, device: Any, profileId: int, placement: Any) -> Any:
        index, gpu = self._gpu("nvmlDeviceCreateGpuInstanceWithPlacement", device)
        spec = self._spec_by_id(gpu, profileId)
        where = _target(placement)
        with self._lock:
            if gpu.mode != pynvml.NVML_DEVICE_MIG_ENABLE:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if where.start not in spec.starts or where.size != spec.size:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if (code := self._refusal(gpu, spec, where.start)) is not None:
                raise _err(code)
            gi_id = min(set(range(1, 64)) - set(gpu.gis))
            gpu.gis[gi_id] = _Gi(gi_id, spec, where.start)
        return _gi_handle(index, gi_id)

    def nvmlDeviceGetGpuInstances(self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
        index, gpu = self._gpu("nvmlDeviceGetGpuInstances", device)
        spec = self._spec_by_id(gpu, profileId)
        with self._lock:
            ids = sorted(g.id for g in gpu.gis.values() if g.spec is spec)
        return _fill(gpuInstancesRef, countRef, [_gi_handle(index, gi_id) for gi_id in ids])

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        index, gpu = self._gpu("nvmlDeviceGetGpuInstanceById", device)
        with self._lock:
            if gpuInstanceId not in gpu.gis:
                raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return _gi_handle(index, gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        index, _, gi = self._gi("nvmlGpuInstanceGetInfo", gpuInstance)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = self._handle_of(index)
        info.id = gi.id
        info.profileId = gi.spec.id
        info.placement.start = gi.start
        info.placement.size = gi.spec.size
        return info

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        _, gpu, gi = self._gi("nvmlGpuInstanceDestroy", gpuInstance)
        with self._lock:
            if gi.cis:
                raise _err(pynvml.NVML_ERROR_IN_USE)
            del gpu.gis[gi.id]
        return _SUCCESS

    # -- compute instances ---------------------------------------------------------------------------

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, device: Any, profile: int, engProfile: int,
                                                     version: int = 2) -> Any:
        _, _, gi = self._gi("nvmlGpuInstanceGetComputeInstanceProfileInfo", device)
        slices = _CI_PROFILES.get(profile)
        if slices is None or slices > gi.spec.slices:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if version == 2:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            info.name = (f"MIG {gi.spec.name}" if slices == gi.spec.slices
                         else f"MIG {slices}c.{gi.spec.name}").encode()
        elif version == 1:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_t()
        else:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = gi.spec.slices // slices
        info.multiprocessorCount = gi.spec.multiprocessors * slices // gi.spec.slices
        info.sharedCopyEngineCount = gi.spec.copy_engines
        info.sharedDecoderCount = gi.spec.decoders
        info.sharedEncoderCount = gi.spec.encoders
        info.sharedJpegCount = gi.spec.jpegs
        info.sharedOfaCount = gi.spec.ofas
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        index, _, gi = self._gi("nvmlGpuInstanceCreateComputeInstance", gpuInstance)
        slices = _CI_PROFILES.get(profileId)
        if slices is None or slices > gi.spec.slices:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            if sum(gi.cis.values()) + slices > gi.spec.slices:
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            ci_id = min(set(range(0, 8)) - set(gi.cis))
            gi.cis[ci_id] = slices
        return _ci_handle(index, gi.id, ci_id)

    def nvmlGpuInstanceGetComputeInstances(self, gpuInstance: Any, profileId: int, computeInstancesRef: Any,
                                           countRef: Any) -> int:
        index, _, gi = self._gi("nvmlGpuInstanceGetComputeInstances", gpuInstance)
        wanted = _CI_PROFILES.get(profileId)
        with self._lock:
            ids = sorted(c for c, s in gi.cis.items() if s == wanted)
        return _fill(computeInstancesRef, countRef, [_ci_handle(index, gi.id, ci_id) for ci_id in ids])

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        index, gi, ci_id = self._ci("nvmlComputeInstanceGetInfo", computeInstance)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = self._handle_of(index)
        info.gpuInstance = _gi_handle(index, gi.id)
        info.id = ci_id
        slices = gi.cis[ci_id]
        info.profileId = next(p for p, s in _CI_PROFILES.items() if s == slices)
        info.placement.start = 0
        info.placement.size = slices
        return info

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        _, gi, ci_id = self._ci("nvmlComputeInstanceDestroy", computeInstance)
        with self._lock:
            gi.cis.pop(ci_id, None)
        return _SUCCESS

    # -- MIG devices ---------------------------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetMaxMigDeviceCount", device)[1]
        return max((s.instances for s in gpu.table if s.size == 1), default=0)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu_index, gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", device)
        with self._lock:
            devices = sorted((gi.id, ci) for gi in gpu.gis.values() for ci in gi.cis)
        if not 0 <= index < len(devices):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return _mig_handle(gpu_index, *devices[index])

    def is_mig_handle(self, handle: Any) -> bool:
        return isinstance(handle, pynvml.c_nvmlDevice_t) and _address(handle) >= _MIG_BASE

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> bool:
        return self.is_mig_handle(device)

    def mig_uuid(self, function: str, handle: Any) -> str:
        """`MIG-<uuid>` of a MIG device: stable for its parent, GPU instance and compute instance."""
        parent_uuid, gi, ci = self._mig_device(function, handle)
        h = hashlib.sha256(f"nvml-sim-mig/{parent_uuid}/{gi.id}/{gi.start}/{ci}".encode()).hexdigest()
        return f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        return self._mig_device("nvmlDeviceGetGpuInstanceId", device)[1].id

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        return self._mig_device("nvmlDeviceGetComputeInstanceId", device)[2]

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        self._mig_device("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
        return self._handle_of(_split(_address(migDevice) - _MIG_BASE)[0])

    # -- internals -----------------------------------------------------------------------------------

    def _refusal(self, gpu: _GpuMig, spec: MigProfileSpec, start: int) -> int | None:
        """Why a new instance of `spec` at `start` cannot be created (an NVML error code), or None."""
        if sum(1 for g in gpu.gis.values() if g.spec is spec) >= spec.instances:
            return _NO_ROOM
        wanted = set(range(start, start + spec.size))
        if any(wanted & g.covers() for g in gpu.gis.values()):
            return _NO_ROOM
        return None

    def _gpu(self, function: str, handle: Any) -> tuple[int, _GpuMig]:
        index, _ = self._resolve(function, handle)
        gpu = self._gpus[index]
        if gpu is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return index, gpu

    def _gi(self, function: str, handle: Any) -> tuple[int, _GpuMig, _Gi]:
        if not isinstance(handle, pynvml.c_nvmlGpuInstance_t):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        index, gi_id, _ = _split(_address(handle) - _GI_BASE)
        gpu = self._indexed(function, index)[0]
        with self._lock:
            gi = gpu.gis.get(gi_id)
        if gi is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index, gpu, gi

    def _ci(self, function: str, handle: Any) -> tuple[int, _Gi, int]:
        if not isinstance(handle, pynvml.c_nvmlComputeInstance_t):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        index, gi_id, ci_id = _split(_address(handle) - _CI_BASE)
        gpu = self._indexed(function, index)[0]
        with self._lock:
            gi = gpu.gis.get(gi_id)
            if gi is None or ci_id not in gi.cis:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index, gi, ci_id

    def _mig_device(self, function: str, handle: Any) -> tuple[str, _Gi, int]:
        if not self.is_mig_handle(handle):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        index, gi_id, ci_id = _split(_address(handle) - _MIG_BASE)
        gpu, uuid = self._indexed(function, index)
        with self._lock:
            gi = gpu.gis.get(gi_id)
            if gi is None or ci_id not in gi.cis:
                raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return uuid, gi, ci_id

    def _indexed(self, function: str, index: int) -> tuple[_GpuMig, str]:
        """The MIG state of GPU `index` (an instance handle's), after the GPU's faults; and its UUID."""
        if not 0 <= index < len(self._gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        uuid = self._check(function, index)
        gpu = self._gpus[index]
        if gpu is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, uuid

    @staticmethod
    def _spec_by_enum(gpu: _GpuMig, profile: int) -> MigProfileSpec:
        if not isinstance(profile, int) or not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for spec in gpu.table:
            if spec.enum == profile:
                return spec
        raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @staticmethod
    def _spec_by_id(gpu: _GpuMig, profile_id: int) -> MigProfileSpec:
        for spec in gpu.table:
            if spec.id == profile_id:
                return spec
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _fill(arrayRef: Any, countRef: Any, items: list[Any]) -> int:
    """NVML's list-out convention: with no array, say how many; with one too small (count in), fail
    INSUFFICIENT_SIZE saying how many; else fill it and say how many."""
    count = _target(countRef)
    if arrayRef is not None:
        if count.value < len(items):
            count.value = len(items)
            raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        out = _target(arrayRef)
        for i, item in enumerate(items):
            out[i] = item
    count.value = len(items)
    return _SUCCESS


def _target(ref: Any) -> Any:
    """The object behind a ctypes argument as pynvml callers pass it: `byref(x)`, `pointer(x)` or `x`."""
    if ref is None:
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    obj = getattr(ref, "_obj", None)  # ctypes.byref(...) keeps its object here
    if obj is not None:
        return obj
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    return ref


def _address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _split(offset: int) -> tuple[int, int, int]:
    """A handle's offset from its base -> (GPU index, GPU instance id, compute instance id)."""
    gpu, rest = divmod(offset, _PER_GPU)
    gi, ci = divmod(rest, 256)
    return gpu, gi, ci


def _gi_handle(index: int, gi: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(_GI_BASE + index * _PER_GPU + gi * 256), pynvml.c_nvmlGpuInstance_t)


def _ci_handle(index: int, gi: int, ci: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(_CI_BASE + index * _PER_GPU + gi * 256 + ci),
                       pynvml.c_nvmlComputeInstance_t)


def _mig_handle(index: int, gi: int, ci: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(_MIG_BASE + index * _PER_GPU + gi * 256 + ci), pynvml.c_nvmlDevice_t)

"""The simulated NVML's MIG: GPU instance profiles, their placements, and GPU and compute instances.

`SimMig` answers the pynvml MIG calls (same names, arguments, structs and errors as the module)
for the GPUs of a simulated machine; `SimulatedNvml` delegates them here. Placement rules are
the hardware's as NVML states them: a GPU instance occupies the memory slices of its placement
(`start`, `size`), a placement must be one `nvmlDeviceGetGpuInstancePossiblePlacements` lists for
its profile, two instances never share a memory slice, a profile has at most `instanceCount`
instances, and instances side by side hold no more compute slices or engines than the GPU has (what
its whole-GPU profile holds: an A30's two media profiles never exist together). Anything else fails
as NVML does: an overlap, one instance too many or an engine too many is
`NVML_ERROR_INSUFFICIENT_RESOURCES`, an unlisted placement `NVML_ERROR_INVALID_ARGUMENT`, a profile
the GPU does not offer `NVML_ERROR_NOT_SUPPORTED`, creating with MIG mode off
`NVML_ERROR_NOT_SUPPORTED`, destroying a GPU instance that still has compute instances (or turning
MIG off while GPU instances exist) `NVML_ERROR_IN_USE`.

Profile queries (profile info, placements) answer whatever the MIG mode, as drivers that report
`NVML_FI_DEV_IS_MIG_MODE_INDEPENDENT_MIG_QUERY_CAPABLE` do, so a GPU with MIG off still shows what it
could be split into. `nvmlDeviceSetMigMode` takes effect at once here (activation status
NVML_SUCCESS); on real hardware the change may stay pending until a GPU reset
(`nvmlDeviceGetMigMode` then answers [current, pending] with the two differing).

The profile tables (A30, A100, H100, H200) are in `agent.sim.migprofiles`. Attached to a simulated
machine's directory (`attach`), the state outlives the process like hardware's does
(`agent.sim.migstate`): every change is written there, and read back by the next
simulated NVML on that machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator
from operator import attrgetter
from pathlib import Path
from typing import Any

import pynvml

from agent.sim.mighandles import (
    CI_BASE,
    GI_BASE,
    MIG_BASE,
    address,
    ci_handle,
    fill,
    gi_handle,
    mig_handle,
    split,
    target,
)
from agent.sim.miginfo import CI_PROFILES, compute_instance_profile_info, gpu_instance_profile_info
from agent.sim.migprofiles import MigProfileSpec
from agent.sim.migstate import MigMachine, SimGi, SimGpuMig

_SUCCESS: int = pynvml.NVML_SUCCESS
_NO_ROOM: int = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


# What one GPU instance holds of the GPU's compute slices and engines (no two instances share them).
_SHARES = tuple(attrgetter(name) for name in ("slices", "copy_engines", "decoders", "encoders", "jpegs", "ofas"))


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
        self._gpus: list[SimGpuMig | None] = [
            None if mode is None else SimGpuMig(table, mode) for table, mode in zip(tables, modes, strict=True)]
        self._resolve = resolve
        self._check = check
        self._handle_of = handle_of
        self._machine: MigMachine | None = None

    def attach(self, root: Path, minors: list[int]) -> None:
        """Keep the MIG state in the simulated machine at `root` (GPU i has minor `minors[i]`): what an
        earlier process left there is loaded now, each change is written there."""
        machine = MigMachine(root, minors)
        with self._lock:
            machine.attach(self._gpus)
            self._machine = machine

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold the state for a change: this process's lock, the machine's lock, the machine's latest
        state read first and the result written after (not when the change raises)."""
        with self._lock:
            machine = self._machine
            if machine is None:
                yield
                return
            with machine.locked():
                machine.refresh(self._gpus)
                yield
                machine.save(self._gpus)

    def _refresh(self) -> None:
        """Another process (a second agent, a test) may have changed the machine's state."""
        if self._machine is not None:
            with self._lock:
                self._machine.refresh(self._gpus)

    # -- MIG mode ------------------------------------------------------------------------------------

    def mode(self, index: int) -> list[int] | None:
        """[current, pending] for GPU `index`; None: not MIG capable."""
        gpu = self._gpus[index]
        return None if gpu is None else [gpu.mode, gpu.mode]

    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        gpu = self._gpu("nvmlDeviceSetMigMode", device)[1]
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._changing():
            if mode == pynvml.NVML_DEVICE_MIG_DISABLE and gpu.gis:
                raise _err(pynvml.NVML_ERROR_IN_USE)
            gpu.mode = mode
        return _SUCCESS  # the activation status: applied, no reset needed here

    # -- profiles and placements ---------------------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int, version: int = 2) -> Any:
        spec = self._spec_by_enum(self._gpu("nvmlDeviceGetGpuInstanceProfileInfo", device)[1], profile)
        return gpu_instance_profile_info(spec, version)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, device: Any, profileId: int, placementsRef: Any,
                                                   countRef: Any) -> int:
        spec = self._spec_by_id(self._gpu("nvmlDeviceGetGpuInstancePossiblePlacements", device)[1], profileId)
        return fill(placementsRef, countRef, [pynvml.c_nvmlGpuInstancePlacement_t(start, spec.size)
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
        where = target(placement)
        with self._changing():
            if gpu.mode != pynvml.NVML_DEVICE_MIG_ENABLE:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if where.start not in spec.starts or where.size != spec.size:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if (code := self._refusal(gpu, spec, where.start)) is not None:
                raise _err(code)
            gi_id = min(set(range(1, 64)) - set(gpu.gis))
            gpu.gis[gi_id] = SimGi(gi_id, spec, where.start)
        return gi_handle(index, gi_id)

    def nvmlDeviceGetGpuInstances(self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
        index, gpu = self._gpu("nvmlDeviceGetGpuInstances", device)
        spec = self._spec_by_id(gpu, profileId)
        with self._lock:
            ids = sorted(g.id for g in gpu.gis.values() if g.spec is spec)
        return fill(gpuInstancesRef, countRef, [gi_handle(index, gi_id) for gi_id in ids])

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        index, gpu = self._gpu("nvmlDeviceGetGpuInstanceById", device)
        with self._lock:
            if gpuInstanceId not in gpu.gis:
                raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return gi_handle(index, gpuInstanceId)

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
        with self._changing():
            now = gpu.gis.get(gi.id)  # (as the machine's state says now)
            if now is None:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if now.cis:
                raise _err(pynvml.NVML_ERROR_IN_USE)
            del gpu.gis[gi.id]
        return _SUCCESS

    # -- compute instances ---------------------------------------------------------------------------

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, device: Any, profile: int, engProfile: int,
                                                     version: int = 2) -> Any:
        _, _, gi = self._gi("nvmlGpuInstanceGetComputeInstanceProfileInfo", device)
        return compute_instance_profile_info(gi.spec, profile, engProfile, version)

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        index, gpu, gi = self._gi("nvmlGpuInstanceCreateComputeInstance", gpuInstance)
        slices = CI_PROFILES.get(profileId)
        if slices is None or slices > gi.spec.slices:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._changing():
            gi = gpu.gis.get(gi.id) or gi  # (as the machine's state says now)
            if sum(gi.cis.values()) + slices > gi.spec.slices:
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            ci_id = min(set(range(0, 8)) - set(gi.cis))
            gi.cis[ci_id] = slices
        return ci_handle(index, gi.id, ci_id)

    def nvmlGpuInstanceGetComputeInstances(self, gpuInstance: Any, profileId: int, computeInstancesRef: Any,
                                           countRef: Any) -> int:
        index, _, gi = self._gi("nvmlGpuInstanceGetComputeInstances", gpuInstance)
        wanted = CI_PROFILES.get(profileId)
        with self._lock:
            ids = sorted(c for c, s in gi.cis.items() if s == wanted)
        return fill(computeInstancesRef, countRef, [ci_handle(index, gi.id, ci_id) for ci_id in ids])

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        index, gi, ci_id = self._ci("nvmlComputeInstanceGetInfo", computeInstance)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = self._handle_of(index)
        info.gpuInstance = gi_handle(index, gi.id)
        info.id = ci_id
        slices = gi.cis[ci_id]
        info.profileId = next(p for p, s in CI_PROFILES.items() if s == slices)
        info.placement.start = 0
        info.placement.size = slices
        return info

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        index, gi, ci_id = self._ci("nvmlComputeInstanceDestroy", computeInstance)
        gpu = self._indexed("nvmlComputeInstanceDestroy", index)[0]
        with self._changing():
            if (now := gpu.gis.get(gi.id)) is not None:  # (as the machine's state says now)
                now.cis.pop(ci_id, None)
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
        return mig_handle(gpu_index, *devices[index])

    def is_mig_handle(self, handle: Any) -> bool:
        return isinstance(handle, pynvml.c_nvmlDevice_t) and address(handle) >= MIG_BASE

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
        return self._handle_of(split(address(migDevice) - MIG_BASE)[0])

    # -- internals -----------------------------------------------------------------------------------

    def _refusal(self, gpu: SimGpuMig, spec: MigProfileSpec, start: int) -> int | None:
        """Why a new instance of `spec` at `start` cannot be created (an NVML error code), or None."""
        if sum(1 for g in gpu.gis.values() if g.spec is spec) >= spec.instances:
            return _NO_ROOM
        wanted = set(range(start, start + spec.size))
        if any(wanted & g.covers() for g in gpu.gis.values()):
            return _NO_ROOM
        # Compute slices and engines belong to one GPU instance each; the GPU has what its largest
        # profile (the whole GPU's) holds.
        for share in _SHARES:
            if sum(share(g.spec) for g in gpu.gis.values()) + share(spec) > max(map(share, gpu.table)):
                return _NO_ROOM
        return None

    def _gpu(self, function: str, handle: Any) -> tuple[int, SimGpuMig]:
        index, _ = self._resolve(function, handle)
        self._refresh()
        gpu = self._gpus[index]
        if gpu is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return index, gpu

    def _gi(self, function: str, handle: Any) -> tuple[int, SimGpuMig, SimGi]:
        if not isinstance(handle, pynvml.c_nvmlGpuInstance_t):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        index, gi_id, _ = split(address(handle) - GI_BASE)
        gpu = self._indexed(function, index)[0]
        with self._lock:
            gi = gpu.gis.get(gi_id)
        if gi is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index, gpu, gi

    def _ci(self, function: str, handle: Any) -> tuple[int, SimGi, int]:
        if not isinstance(handle, pynvml.c_nvmlComputeInstance_t):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        index, gi_id, ci_id = split(address(handle) - CI_BASE)
        gpu = self._indexed(function, index)[0]
        with self._lock:
            gi = gpu.gis.get(gi_id)
            if gi is None or ci_id not in gi.cis:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index, gi, ci_id

    def _mig_device(self, function: str, handle: Any) -> tuple[str, SimGi, int]:
        if not self.is_mig_handle(handle):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        index, gi_id, ci_id = split(address(handle) - MIG_BASE)
        gpu, uuid = self._indexed(function, index)
        with self._lock:
            gi = gpu.gis.get(gi_id)
            if gi is None or ci_id not in gi.cis:
                raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return uuid, gi, ci_id

    def _indexed(self, function: str, index: int) -> tuple[SimGpuMig, str]:
        """The MIG state of GPU `index` (an instance handle's), after the GPU's faults; and its UUID."""
        if not 0 <= index < len(self._gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        uuid = self._check(function, index)
        self._refresh()
        gpu = self._gpus[index]
        if gpu is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, uuid

    @staticmethod
    def _spec_by_enum(gpu: SimGpuMig, profile: int) -> MigProfileSpec:
        if not isinstance(profile, int) or not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for spec in gpu.table:
            if spec.enum == profile:
                return spec
        raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)

    @staticmethod
    def _spec_by_id(gpu: SimGpuMig, profile_id: int) -> MigProfileSpec:
        for spec in gpu.table:
            if spec.id == profile_id:
                return spec
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

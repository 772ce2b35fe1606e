"""MIG profile tables of the simulated GPUs: what NVML answers about each GPU instance profile of a
GPU model, and where its instances may be placed.

H100 80GB facts (`H100_80GB`), from `nvidia-smi mig -lgip` on an H100 SXM5 80GB HBM3 and NVIDIA's MIG
user guide ("Supported MIG Profiles", https://docs.nvidia.com/datacenter/tesla/mig-user-guide/):
8 memory slices, 7 compute slices; profile ids are those NVML reports (19, 20, 15, 14, 9, 5, 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pynvml


@dataclass(frozen=True, slots=True)
class MigProfileSpec:
    """One GPU instance profile of a GPU model: what `nvmlDeviceGetGpuInstanceProfileInfo` answers
    for NVML_GPU_INSTANCE_PROFILE_<enum>, and the placements (memory slice starts, each `size` long)."""

    enum: int
    id: int
    name: str
    slices: int  # compute slices (sliceCount)
    instances: int  # instanceCount: the most instances of this profile at once
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    memory_mib: int
    starts: tuple[int, ...]
    size: int  # memory slices one placement covers


H100_MEMORY_SLICES = 8
H100_80GB: tuple[MigProfileSpec, ...] = (
    MigProfileSpec(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, "1g.10gb", 1, 7, 16, 1, 1, 0, 1, 0, 9984,
                   (0, 1, 2, 3, 4, 5, 6), 1),
    # +me: the media extensions (the GPU's one OFA engine); one instance at a time.
    MigProfileSpec(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, "1g.10gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 9984,
                   (0, 1, 2, 3, 4, 5, 6), 1),
    MigProfileSpec(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, "1g.20gb", 1, 4, 26, 1, 1, 0, 1, 0, 20096,
                   (0, 2, 4, 6), 2),
    MigProfileSpec(pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, "2g.20gb", 2, 3, 32, 2, 2, 0, 2, 0, 20096,
                   (0, 2, 4), 2),
    MigProfileSpec(pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, "3g.40gb", 3, 2, 60, 3, 3, 0, 3, 0, 40448,
                   (0, 4), 4),
    MigProfileSpec(pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, "4g.40gb", 4, 1, 64, 4, 4, 0, 4, 0, 40448,
                   (0,), 4),
    MigProfileSpec(pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, "7g.80gb", 7, 1, 132, 8, 7, 0, 7, 1, 81152,
                   (0,), 8),
)
# Profile tables a simulated GPU may name (`migProfiles` in a machine profile).
MIG_TABLES: Mapping[str, tuple[MigProfileSpec, ...]] = {"h100-80gb": H100_80GB}
# The MIG calls, which faults may name too (`SimulatedNvml.inject_error`).
MIG_FUNCTIONS = frozenset({
    "nvmlDeviceSetMigMode", "nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstancePossiblePlacements",
    "nvmlDeviceGetGpuInstanceRemainingCapacity", "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlDeviceGetGpuInstances", "nvmlDeviceGetGpuInstanceById", "nvmlGpuInstanceGetInfo",
    "nvmlGpuInstanceDestroy", "nvmlGpuInstanceGetComputeInstanceProfileInfo",
    "nvmlGpuInstanceCreateComputeInstance", "nvmlGpuInstanceGetComputeInstances", "nvmlComputeInstanceGetInfo",
    "nvmlComputeInstanceDestroy", "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex",
})

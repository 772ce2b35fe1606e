"""The NVML info structs the simulated NVML answers about MIG profiles: a GPU instance profile's
(`nvmlDeviceGetGpuInstanceProfileInfo`) and the compute instance profiles a GPU instance offers
(`nvmlGpuInstanceGetComputeInstanceProfileInfo`), in the struct version asked for. The state and the
placement rules are `agent.sim.mig`'s.
"""

from __future__ import annotations

from typing import Any

import pynvml

from agent.sim.migprofiles import MigProfileSpec

# Compute instance profiles a GPU instance offers: NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE, n <= its slices.
CI_PROFILES: dict[int, int] = {
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: 1, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: 3, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: 7}


def gpu_instance_profile_info(spec: MigProfileSpec, version: int) -> Any:
    """`c_nvmlGpuInstanceProfileInfo_v2_t` (version 2, with the name) or the v1 struct."""
    if version == 2:
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.name = f"MIG {spec.name}".encode()
    elif version == 1:
        info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
    else:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
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


def compute_instance_profile_info(gi: MigProfileSpec, profile: int, engine_profile: int, version: int) -> Any:
    """The compute instance profile `profile` (NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE) of a GPU instance
    of profile `gi`; NOT_SUPPORTED when it is larger than the GPU instance."""
    slices = CI_PROFILES.get(profile)
    if slices is None or slices > gi.slices:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    if engine_profile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if version == 2:
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.name = (f"MIG {gi.name}" if slices == gi.slices else f"MIG {slices}c.{gi.name}").encode()
    elif version == 1:
        info = pynvml.c_nvmlComputeInstanceProfileInfo_t()
    else:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    info.id = profile
    info.sliceCount = slices
    info.instanceCount = gi.slices // slices
    info.multiprocessorCount = gi.multiprocessors * slices // gi.slices
    info.sharedCopyEngineCount = gi.copy_engines
    info.sharedDecoderCount = gi.decoders
    info.sharedEncoderCount = gi.encoders
    info.sharedJpegCount = gi.jpegs
    info.sharedOfaCount = gi.ofas
    return info

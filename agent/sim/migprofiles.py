"""MIG profile tables of the simulated GPUs: what NVML answers about each GPU instance profile of a
GPU model, and where its instances may be placed.

From NVIDIA's MIG user guide ("Supported MIG Profiles", https://docs.nvidia.com/datacenter/tesla/mig-user-guide/):
each profile's name, compute slices (fraction of SMs), instance count, copy engines, decoders, JPEG and
OFA engines, and its placements (the guide's `nvidia-smi mig -lgipp` listing and placement figures:
8 memory slices and 7 compute slices on A100, H100 and H200, 4 and 4 on A30). From NVML as
`nvidia-smi mig -lgip` shows it: the profile ids (19, 20, 15, 14, 9, 5, 0 on the 8-slice GPUs; 14, 21,
5, 6, 0 on A30), the H100 80GB's multiprocessors and memory, and the H200's memory (a real H200's NVML,
read by tests/hw, agreed with every other field of its table here). The other models' multiprocessors
(14 per compute slice on GA100) and memory sizes (a little under the profile's share of the GPU, its
name's GB rounded up) are the simulator's own. tests/test_mig.py holds the tables to the guide.
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


_P = pynvml
_EIGHT = (0, 1, 2, 3, 4, 5, 6)  # 1-slice placements of an 8-memory-slice GPU (slice 7 has no SM slice)


def _eight_slices(names: tuple[str, str, str, str], mib: tuple[int, int, int, int],
                  sms: tuple[int, int, int, int, int, int], engines: tuple[tuple[int, int, int, int], ...],
                  ) -> tuple[MigProfileSpec, ...]:
    """The seven profiles of an 8-memory-slice GPU (A100, H100, H200): `names` and `mib` for 1, 2, 4 and
    8 memory slices; `sms` for 1g, 1g (2 slices), 2g, 3g, 4g, 7g (1g+me has 1g's); `engines` (copy
    engines, decoders, JPEG, OFA) for 1g, 1g+me, 1g (2 slices), 2g, 3g, 4g, 7g."""
    one, two, four, whole = names
    rows = ((_P.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, f"1g.{one}", 1, 7, sms[0], mib[0], _EIGHT, 1),
            (_P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, f"1g.{one}+me", 1, 1, sms[0], mib[0], _EIGHT, 1),
            (_P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, f"1g.{two}", 1, 4, sms[1], mib[1], (0, 2, 4, 6), 2),
            (_P.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, f"2g.{two}", 2, 3, sms[2], mib[1], (0, 2, 4), 2),
            (_P.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, f"3g.{four}", 3, 2, sms[3], mib[2], (0, 4), 4),
            (_P.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, f"4g.{four}", 4, 1, sms[4], mib[2], (0,), 4),
            (_P.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, f"7g.{whole}", 7, 1, sms[5], mib[3], (0,), 8))
    return tuple(MigProfileSpec(enum, pid, name, slices, instances, sm, ce, dec, 0, jpeg, ofa, memory, starts, size)
                 for (enum, pid, name, slices, instances, sm, memory, starts, size), (ce, dec, jpeg, ofa)
                 in zip(rows, engines, strict=True))


# GA100 (A100): no JPEG or OFA but in 1g+me and the whole GPU; 14 SMs per compute slice.
_GA100_SMS = (14, 14, 28, 42, 56, 98)
_GA100_ENGINES = ((1, 0, 0, 0), (1, 1, 1, 1), (1, 1, 0, 0), (2, 1, 0, 0), (3, 2, 0, 0), (4, 2, 0, 0), (7, 5, 1, 1))
# GH100 (H100, H200): a decoder and a JPEG engine per compute slice, the OFA in 1g+me and the whole GPU.
_GH100_SMS = (16, 26, 32, 60, 64, 132)
_GH100_ENGINES = ((1, 1, 1, 0), (1, 1, 1, 1), (1, 1, 1, 0), (2, 2, 2, 0), (3, 3, 3, 0), (4, 4, 4, 0), (8, 7, 7, 1))

H100_80GB = _eight_slices(("10gb", "20gb", "40gb", "80gb"), (9984, 20096, 40448, 81152), _GH100_SMS, _GH100_ENGINES)
H100_94GB = _eight_slices(("12gb", "24gb", "47gb", "94gb"), (11776, 23808, 47872, 95744), _GH100_SMS, _GH100_ENGINES)
H100_96GB = _eight_slices(("12gb", "24gb", "48gb", "96gb"), (12032, 24064, 48640, 97792), _GH100_SMS, _GH100_ENGINES)
# As a real H200 answered (driver 580.159.04, `make hw-check`): memory 16 GiB, 32.5, 69.75 and 140 GiB, a
# smaller share of the GPU's 143771 MiB than the H100s' profiles take of theirs.
H200_141GB = _eight_slices(("18gb", "35gb", "71gb", "141gb"), (16384, 33280, 71424, 143360), _GH100_SMS,
                           _GH100_ENGINES)
A100_40GB = _eight_slices(("5gb", "10gb", "20gb", "40gb"), (4864, 9856, 19968, 40192), _GA100_SMS, _GA100_ENGINES)
A100_80GB = _eight_slices(("10gb", "20gb", "40gb", "80gb"), (9728, 19968, 40192, 81152), _GA100_SMS, _GA100_ENGINES)
# A30: 4 memory and 4 compute slices; one JPEG and one OFA engine, in whichever +me instance (or the whole GPU).
A30_24GB: tuple[MigProfileSpec, ...] = (
    MigProfileSpec(_P.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 14, "1g.6gb", 1, 4, 14, 1, 0, 0, 0, 0, 5888, (0, 1, 2, 3), 1),
    MigProfileSpec(_P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 21, "1g.6gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 5888,
                   (0, 1, 2, 3), 1),
    MigProfileSpec(_P.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 5, "2g.12gb", 2, 2, 28, 2, 2, 0, 0, 0, 12032, (0, 2), 2),
    MigProfileSpec(_P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1, 6, "2g.12gb+me", 2, 1, 28, 2, 2, 0, 1, 1, 12032,
                   (0, 2), 2),
    MigProfileSpec(_P.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 0, "4g.24gb", 4, 1, 56, 4, 4, 0, 1, 1, 24064, (0,), 4),
)
# Profile tables a simulated GPU may name (`migProfiles` in a machine profile).
MIG_TABLES: Mapping[str, tuple[MigProfileSpec, ...]] = {
    "a30-24gb": A30_24GB, "a100-40gb": A100_40GB, "a100-80gb": A100_80GB, "h100-80gb": H100_80GB,
    "h100-94gb": H100_94GB, "h100-96gb": H100_96GB, "h200-141gb": H200_141GB}
# The MIG calls, which faults may name too (`SimulatedNvml.inject_error`).
MIG_FUNCTIONS = frozenset({
    "nvmlDeviceSetMigMode", "nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstancePossiblePlacements",
    "nvmlDeviceGetGpuInstanceRemainingCapacity", "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlDeviceGetGpuInstances", "nvmlDeviceGetGpuInstanceById", "nvmlGpuInstanceGetInfo",
    "nvmlGpuInstanceDestroy", "nvmlGpuInstanceGetComputeInstanceProfileInfo",
    "nvmlGpuInstanceCreateComputeInstance", "nvmlGpuInstanceGetComputeInstances", "nvmlComputeInstanceGetInfo",
    "nvmlComputeInstanceDestroy", "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex",
})

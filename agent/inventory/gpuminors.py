"""GPU minors from the NVIDIA kernel driver's list (`<proc>/driver/nvidia/gpus/<bus id>/information`),
and through it the names of GPUs that fail in NVML before saying their minor: when the driver lists
exactly NVML's GPUs, the minors no answering GPU has are those of the failing ones. A GPU that neither
names is a `SourceProblem` ("GPU at NVML index N"). Used by `gpus.GpuSource.scan`."""

from __future__ import annotations

import os
import re
from pathlib import Path

from agent.host.pci import normalize_bus_id
from agent.inventory import DeviceFailure, ScanResult, SourceProblem

# The kernel driver's list of its GPUs, under the proc root: <bus id>/information.
DRIVER_GPUS = Path("driver", "nvidia", "gpus")
_DEVICE_MINOR = re.compile(r"^Device Minor:\s*(\d+)\s*$", re.MULTILINE)


def driver_minors(proc_root: Path) -> dict[str, int]:
    """Bus ID -> minor number of each GPU the NVIDIA kernel driver lists under `proc_root`
    (empty when it lists none or the directory is not there)."""
    top = proc_root / DRIVER_GPUS
    try:
        entries = sorted(os.listdir(top))
    except OSError:
        return {}
    minors = {}
    for entry in entries:
        try:
            found = _DEVICE_MINOR.search((top / entry / "information").read_text(errors="replace"))
            if found:
                minors[normalize_bus_id(entry)] = int(found.group(1))
        except (OSError, ValueError):
            continue
    return minors


def name_the_rest(proc_root: Path, count: int, known: set[int], unnamed: dict[int, str],
                  minors: dict[int, int], result: ScanResult) -> None:
    """Name GPUs that failed before saying their minor: when the kernel driver lists exactly
    NVML's GPUs, the minors no answering GPU has are those of the failing ones.

    `count`: NVML's GPU count; `known`: the minors of the GPUs that answered; `unnamed`: NVML index ->
    why, for the failing GPUs that never said their minor; `minors` (NVML index -> minor, the
    source's) learns the minor of a GPU named here alone. The failures go into `result`."""
    by_bus = driver_minors(proc_root)
    listed = set(by_bus.values())
    left = sorted(listed - known)
    if len(by_bus) == len(listed) == count and known <= listed and len(left) == len(unnamed):
        if len(unnamed) == 1:
            [(index, reason)] = unnamed.items()
            [minor] = left
            bus = next(b for b, m in by_bus.items() if m == minor)
            minors[index] = minor
            result.failed_devices.append(DeviceFailure(f"gpu-{minor}", f"NVML index {index}, {bus}: {reason}"))
            return
        # Each of these GPUs fails; which reason is whose is not known.
        reasons = sorted(set(unnamed.values()))
        why = reasons[0] if len(reasons) == 1 else "; ".join(
            f"NVML index {i}: {r}" for i, r in sorted(unnamed.items()))
        indexes = ", ".join(map(str, sorted(unnamed)))
        for minor in left:
            result.failed_devices.append(DeviceFailure(f"gpu-{minor}", f"one of NVML indexes {indexes}: {why}"))
        return
    # No name it would be published under: reported for people, not on the health stream.
    for index, reason in sorted(unnamed.items()):
        result.problems.append(SourceProblem(f"GPU at NVML index {index}", reason))

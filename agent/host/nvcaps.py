"""The NVIDIA driver's capability files and device nodes (`/proc/driver/nvidia/capabilities`,
`/dev/nvidia-caps`): what a MIG device's container needs beside the GPU's own nodes. The same layout
on a real host and in the simulated machine's tree, so MIG prepare and the simulator share it."""

from __future__ import annotations

from pathlib import Path


def caps_dir(proc: Path, gpu_minor: int) -> Path:
    """The GPU's MIG capabilities directory under the (simulated or real) /proc."""
    return proc / "driver" / "nvidia" / "capabilities" / f"gpu{gpu_minor}" / "mig"

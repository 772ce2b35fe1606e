"""Seed an offline directory for `make run` from the example claims.

Fills in this node's name, the driver name, a NIC this node really has and the
passthrough device of a GPU (`make run`'s simulated machine's second GPU, or this host's
first NVIDIA GPU when NVML loads), so every example can be prepared on the machine at hand:

    python examples/seed.py .run
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

from agent import counters
from agent.config import settings_from
from agent.inventory.gpus import probe
from agent.inventory.nics import NicSource
from agent.inventory.nvml_profiles import load_profile
from agent.inventory.pci import nvidia_display_functions

HERE = Path(__file__).resolve().parent


def first_nic(settings) -> str | None:  # type: ignore[no-untyped-def]
    source = NicSource(settings)
    source.open()
    try:
        devices = sorted(source.scan().devices, key=lambda d: d.name)
    finally:
        source.close()
    return devices[0].name if devices else None


def vfio_gpu(settings) -> str | None:  # type: ignore[no-untyped-def]
    """The passthrough device name of the GPU the VM example claims: the simulated machine's second GPU
    (gpu-1, alone in its IOMMU group), as `make run` picks the simulation when NVML does not load."""
    if settings.nvml.kind == "sim" or (settings.nvml.kind == "auto" and probe() == "sim"):
        profile = load_profile(settings.nvml.profile if settings.nvml.kind == "sim" else "dgx-h100")
        return counters.passthrough_name("gpu", profile.gpus[1].bus_id) if len(profile.gpus) > 1 else None
    functions = nvidia_display_functions(settings.sysfs_root)
    return counters.passthrough_name("gpu", functions[0]) if functions else None


def seed(run_dir: Path) -> list[Path]:
    settings = settings_from(None)
    nic = first_nic(settings)
    gpu = vfio_gpu(settings)
    values = {"DRIVER": settings.driver_name, "NODE_NAME": settings.node_name, "NIC_DEVICE": nic or "",
              "VFIO_GPU_DEVICE": gpu or ""}
    written = []
    for src in sorted((HERE / "resourceclaims").rglob("*.yaml")):
        text = src.read_text()
        if "${NIC_DEVICE}" in text and not nic:
            print(f"seed: no NIC published on this node, skipping {src.name}", file=sys.stderr)
            continue
        if "${VFIO_GPU_DEVICE}" in text and not gpu:
            print(f"seed: no GPU to pass through on this node, skipping {src.name}", file=sys.stderr)
            continue
        dst = run_dir / "offline" / src.relative_to(HERE)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(string.Template(text).substitute(values))
        written.append(dst)
    return written


if __name__ == "__main__":
    for path in seed(Path(sys.argv[1] if len(sys.argv) > 1 else ".run")):
        print(f"seed: {path}")

"""Seed an offline directory for `make run` from the example claims.

Fills in this node's name, the driver name, a NIC this node really has, the
passthrough device of a GPU (`make run`'s simulated machine's second GPU, or this host's
first NVIDIA GPU when NVML loads) and that of an SR-IOV VF (the simulated machine's first VF, or
this host's first VF that can be passed through), so every example can be prepared on the machine
at hand:

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
from agent.inventory.passthrough import NicVariants
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


def _simulated(settings) -> bool:  # type: ignore[no-untyped-def]
    """`make run` simulates the machine: asked to, or when NVML does not load."""
    return bool(settings.nvml.kind == "sim" or (settings.nvml.kind == "auto" and probe() == "sim"))


def vfio_gpu(settings) -> str | None:  # type: ignore[no-untyped-def]
    """The passthrough device name of the GPU the VM example claims: the simulated machine's second GPU
    (gpu-1, alone in its IOMMU group), as `make run` picks the simulation when NVML does not load."""
    if _simulated(settings):
        profile = load_profile(settings.nvml.profile if settings.nvml.kind == "sim" else "dgx-h100")
        return counters.passthrough_name("gpu", profile.gpus[1].bus_id) if len(profile.gpus) > 1 else None
    functions = nvidia_display_functions(settings.sysfs_root)
    return counters.passthrough_name("gpu", functions[0]) if functions else None


def vfio_vf(settings) -> str | None:  # type: ignore[no-untyped-def]
    """The passthrough device name of the VF the VM's network example claims: the simulated machine's
    first VF (its sysfs is written when the agent starts, so named from the profile), or the first VF
    of this host that NIC discovery gives a passthrough device."""
    if _simulated(settings):
        profile = load_profile(settings.nvml.profile if settings.nvml.kind == "sim" else "dgx-h100")
        vfs = [nic.vf_bus_id(0) for nic in profile.nics if nic.num_vfs]
        return counters.passthrough_name("nic", vfs[0]) if vfs else None
    found = sorted(d.name for d in NicVariants(exclude=settings.nic_exclude).apply(settings.sysfs_root, []))
    return found[0] if found else None


def seed(run_dir: Path) -> list[Path]:
    settings = settings_from(None)
    nic = first_nic(settings)
    gpu = vfio_gpu(settings)
    vf = vfio_vf(settings)
    values = {"DRIVER": settings.driver_name, "NODE_NAME": settings.node_name, "NIC_DEVICE": nic or "",
              "VFIO_GPU_DEVICE": gpu or "", "VFIO_VF_DEVICE": vf or ""}
    written = []
    for src in sorted((HERE / "resourceclaims").rglob("*.yaml")):
        text = src.read_text()
        if "${NIC_DEVICE}" in text and not nic:
            print(f"seed: no NIC published on this node, skipping {src.name}", file=sys.stderr)
            continue
        if "${VFIO_GPU_DEVICE}" in text and not gpu:
            print(f"seed: no GPU to pass through on this node, skipping {src.name}", file=sys.stderr)
            continue
        if "${VFIO_VF_DEVICE}" in text and not vf:
            print(f"seed: no SR-IOV VF to pass through on this node, skipping {src.name}", file=sys.stderr)
            continue
        dst = run_dir / "offline" / src.relative_to(HERE)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(string.Template(text).substitute(values))
        written.append(dst)
    return written


if __name__ == "__main__":
    for path in seed(Path(sys.argv[1] if len(sys.argv) > 1 else ".run")):
        print(f"seed: {path}")

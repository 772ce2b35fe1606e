"""Seed an offline directory for `make run` from the example claims.

Fills in this node's name, the driver name, a NIC this node really has, the
passthrough device of a GPU (`make run`'s simulated machine's second GPU, or this host's
first NVIDIA GPU when NVML loads), that of an SR-IOV VF (the simulated machine's first VF, or
this host's first VF that can be passed through) and a MIG placement (the simulated machine's only:
preparing one reconfigures its GPU), so every example can be prepared on the machine at hand:

    python examples/seed.py .run
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

from agent import counters
from agent.config import settings_from
from agent.host.pci import nvidia_display_functions
from agent.inventory.gpus import probe
from agent.inventory.mig import MigProfile, device_name
from agent.inventory.nics import NicSource
from agent.inventory.passthrough import NicVariants
from agent.sim.migprofiles import MIG_TABLES
from agent.sim.profiles import load_profile

HERE = Path(__file__).resolve().parent


def first_nic(settings) -> tuple[str, bool] | None:  # type: ignore[no-untyped-def]
    """The first NIC discovery publishes that is not the node's uplink, else the uplink; and whether
    it is the uplink (which prepare never moves into a pod: the example then leaves it on the host)."""
    source = NicSource(settings)
    source.open()
    try:
        devices = sorted(source.scan().devices, key=lambda d: (bool(d.attributes.get("uplink")), d.name))
    finally:
        source.close()
    return (devices[0].name, bool(devices[0].attributes.get("uplink"))) if devices else None


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


def mig_device(settings) -> tuple[str, str] | None:  # type: ignore[no-untyped-def]
    """(device, profile name) of the MIG placement the MIG example claims: the smallest profile at its
    first placement on the simulated machine's last MIG-capable GPU (`gpu-one` and the VM example hold
    the first two GPUs). None with `--dynamic-mig` off, or on real GPUs: preparing it would turn MIG mode
    on and make a GPU instance on a GPU of this host."""
    if not settings.dynamic_mig or not _simulated(settings):
        return None
    profile = load_profile(settings.nvml.profile if settings.nvml.kind == "sim" else "dgx-h100")
    capable = [g for g in profile.gpus if g.mig_mode is not None and g.mig_profiles]
    if not capable:
        return None
    gpu = capable[-1]
    # The first of the smallest in the table: 1g.10gb on an H100 (its +me twin follows it).
    spec = min(MIG_TABLES[gpu.mig_profiles], key=lambda p: (p.memory_mib, p.slices))
    named = MigProfile(enum=spec.enum, id=spec.id, name=spec.name, compute_slices=spec.slices,
                       instances=spec.instances, engines=(), memory=spec.memory_mib << 20, starts=spec.starts,
                       size=spec.size)
    return device_name(gpu.minor, named, spec.starts[0]), spec.name


def seed(run_dir: Path) -> list[Path]:
    settings = settings_from(None)
    nic, uplink = first_nic(settings) or ("", False)
    gpu = vfio_gpu(settings)
    vf = vfio_vf(settings)
    mig, mig_profile = mig_device(settings) or ("", "")
    values = {"DRIVER": settings.driver_name, "NODE_NAME": settings.node_name, "NIC_DEVICE": nic,
              "NIC_MOVE": "false" if uplink else "true",
              "VFIO_GPU_DEVICE": gpu or "", "VFIO_VF_DEVICE": vf or "", "MIG_DEVICE": mig,
              "MIG_PROFILE": mig_profile}
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
        if "${MIG_DEVICE}" in text and not mig:
            print(f"seed: no MIG placement to claim (seeded on the simulated machine only, with --dynamic-mig "
                  f"on), skipping {src.name}", file=sys.stderr)
            continue
        dst = run_dir / "offline" / src.relative_to(HERE)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(string.Template(text).substitute(values))
        written.append(dst)
    return written


if __name__ == "__main__":
    for path in seed(Path(sys.argv[1] if len(sys.argv) > 1 else ".run")):
        print(f"seed: {path}")

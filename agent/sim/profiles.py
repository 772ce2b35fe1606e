"""Machine descriptions for the simulated NVML: the builtin profiles and the JSON loader (what they
describe, `SimGpu`, `SimNic` and `SimProfile`, is `agent.sim.machine`).

The schema is documented in `agent.sim.nvml`; the PCI keys below are for passthrough.
Parsing is strict (an unknown key or function name is an error) so that a misspelt fault in a
profile fails loudly instead of silently injecting nothing.

Builtins: `dgx-h100` (8 GPUs, each alone in its IOMMU group, the last with 20 SR-IOV VFs for vGPU,
and a ConnectX-7 with 4 of 8 SR-IOV VFs on) and `hgx-16` (16 GPUs on two NUMA nodes, and such a NIC).

PCI keys, per GPU:

    iommuGroup      its group number (default 100 + index); GPUs naming the same one share it
    audio           true: an HD audio function (class 0x0403) at function 1 of its slot, same group
    bridgeInGroup   true: the root port above it is in its group too (no ACS)
    vgpuVfs         N: SR-IOV on with N VFs (as NVIDIA's `sriov-manage -e` enables them on Ampere and
                    later): VF n at function 4 + n of the GPU's slot (`0000:db:00.4`, ...), on the
                    nvidia driver, no IOMMU group of its own here; its vGPU types are listed on each
                    VF (one vGPU per VF), none on the GPU (`agent.sim.kernel.mdev`). Default 0: the
                    types on the GPU itself (the layout of GPUs without SR-IOV)

MIG key, per GPU: `migProfiles` names the GPU's MIG profile table (`a30-24gb`, `a100-40gb`, `a100-80gb`,
`h100-80gb` (the builtins' default), `h100-94gb`, `h100-96gb`, `h200-141gb`);
with `migMode` set the GPU answers the MIG calls with that table's profiles and placements.

and at the top level:

    iommufd         false: the host has no /dev/iommu nor VFIO device cdevs (default true)
    nics            [{"busId": "0000:4b:00.0", "interface": "ens75f0np0", "numaNode": 0,
                      "totalVfs": 8, "numVfs": 4, "driver": "mlx5_core", "vendor": 0x15b3,
                      "device": 0x1021, "vfDevice": 0x101e, "iommuGroup": 200}]
                    a NIC PF (own group, default 200 + 32 * index) and its enabled VFs (the next
                    groups), VF n at routing ID PF + 1 + n, each with `net/<interface>[v<n>]/address`
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pynvml

from agent.host.pci import normalize_bus_id
from agent.sim.machine import (
    DEVICE_FUNCTIONS,
    GPU_GROUP_BASE,
    NIC_GROUP_BASE,
    NIC_GROUP_STRIDE,
    SYSTEM_FUNCTIONS,
    ProfileError,
    SimGpu,
    SimNic,
    SimProfile,
    error_code,
)
from agent.sim.migprofiles import MIG_TABLES

# The machine's model is `agent.sim.machine`; its names are used through this module too.
__all__ = ["BUILTIN", "DEVICE_FUNCTIONS", "SYSTEM_FUNCTIONS", "ProfileError", "SimGpu", "SimNic", "SimProfile",
           "derived_uuid", "error_code", "load_profile", "parse_profile"]

_GPU_KEYS = frozenset({
    "name", "busId", "memoryTotal", "numaNode", "nvmlNumaNode", "uuid", "minor", "pcieRoot", "brand",
    "architecture", "computeCapability", "migMode", "pciDeviceId", "pciSubSystemId", "inSysfs", "lost",
    "errors", "iommuGroup", "audio", "bridgeInGroup", "migProfiles", "vgpuVfs",
})
_TOP_KEYS = frozenset({"driverVersion", "cudaDriverVersion", "errors", "defaults", "gpus", "nics", "iommufd"})

def _faults(raw: object, allowed: frozenset[str], where: str) -> dict[str, int]:
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where}: errors must be an object of NVML function name -> error code")
    out = {}
    for fn, code in raw.items():
        if fn not in allowed:
            raise ProfileError(f"{where}: errors names {fn!r}, which is not one of {sorted(allowed)}")
        out[fn] = error_code(code, f"{where}.errors.{fn}")
    return out


def _constant(value: object, prefix: str, where: str) -> int:
    if isinstance(value, str):
        found = getattr(pynvml, value if value.startswith(prefix) else prefix + value.upper(), None)
        if isinstance(found, int):
            return found
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ProfileError(f"{where}: {value!r} is not an integer or a {prefix}* constant")


def _int(value: object, where: str) -> int:
    if isinstance(value, str):
        try:
            return int(value, 0)
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ProfileError(f"{where}: {value!r} is not an integer")


def _pair(value: object, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ProfileError(f"{where}: must be [a, b] or null")
    return _int(value[0], where), _int(value[1], where)


def derived_uuid(profile: str, index: int) -> str:
    """A stable GPU UUID for the index-th GPU of a profile (same machine, same UUIDs)."""
    h = hashlib.sha256(f"nvml-sim/{profile}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _gpu(profile: str, index: int, raw: Mapping[str, Any]) -> SimGpu:
    where = f"gpus[{index}]"
    unknown = set(raw) - _GPU_KEYS
    if unknown:
        raise ProfileError(f"{where}: unknown keys {sorted(unknown)}")
    for key in ("name", "busId", "memoryTotal"):
        if key not in raw:
            raise ProfileError(f"{where}: {key} is required")
    try:
        bus_id = normalize_bus_id(str(raw["busId"]))
    except ValueError as exc:
        raise ProfileError(f"{where}.busId: {exc}") from None
    domain, bus, _ = bus_id.split(":")
    # By default each GPU sits alone behind a root port on the bus just above its own.
    root = raw.get("pcieRoot") or f"pci{domain}:{max(int(bus, 16) - 1, 0):02x}"
    nvml_numa = raw.get("nvmlNumaNode")
    return SimGpu(
        name=str(raw["name"]),
        bus_id=bus_id,
        memory_total=_int(raw["memoryTotal"], f"{where}.memoryTotal"),
        uuid=str(raw.get("uuid") or derived_uuid(profile, index)),
        minor=_int(raw.get("minor", index), f"{where}.minor"),
        pcie_root=str(root),
        numa_node=_int(raw.get("numaNode", -1), f"{where}.numaNode"),
        nvml_numa_node=None if nvml_numa is None else _int(nvml_numa, f"{where}.nvmlNumaNode"),
        brand=_constant(raw.get("brand", pynvml.NVML_BRAND_NVIDIA), "NVML_BRAND_", f"{where}.brand"),
        architecture=_constant(raw.get("architecture", pynvml.NVML_DEVICE_ARCH_UNKNOWN), "NVML_DEVICE_ARCH_",
                               f"{where}.architecture"),
        compute_capability=_pair(raw.get("computeCapability"), f"{where}.computeCapability"),
        mig_mode=_pair(raw.get("migMode"), f"{where}.migMode"),
        pci_device_id=_int(raw.get("pciDeviceId", 0x000010DE), f"{where}.pciDeviceId"),
        pci_subsystem_id=_int(raw.get("pciSubSystemId", 0), f"{where}.pciSubSystemId"),
        in_sysfs=bool(raw.get("inSysfs", True)),
        lost=bool(raw.get("lost", False)),
        errors=_faults(raw.get("errors", {}), DEVICE_FUNCTIONS, where),
        iommu_group=_int(raw.get("iommuGroup", GPU_GROUP_BASE + index), f"{where}.iommuGroup"),
        audio=_bool(raw.get("audio", False), f"{where}.audio"),
        bridge_in_group=_bool(raw.get("bridgeInGroup", False), f"{where}.bridgeInGroup"),
        mig_profiles=_mig_table(raw.get("migProfiles", ""), f"{where}.migProfiles"),
        vgpu_vfs=_vf_count(raw.get("vgpuVfs", 0), f"{where}.vgpuVfs"),
    )


def _vf_count(value: object, where: str) -> int:
    count = _int(value, where)
    if not 0 <= count <= 60:  # VFs from function 4 of the slot, within the slot's device numbers
        raise ProfileError(f"{where}: {count} is not a VF count from 0 to 60")
    return count


def _mig_table(value: object, where: str) -> str:
    if value != "" and value not in MIG_TABLES:
        raise ProfileError(f"{where}: {value!r} is not a MIG profile table ({', '.join(sorted(MIG_TABLES))})")
    return str(value)


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ProfileError(f"{where}: {value!r} is not true or false")
    return value


_NIC_KEYS = frozenset({"busId", "interface", "pcieRoot", "numaNode", "vendor", "device", "vfDevice", "driver",
                       "totalVfs", "numVfs", "iommuGroup"})


def _nic(index: int, raw: object) -> SimNic:
    where = f"nics[{index}]"
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where} must be an object")
    unknown = set(raw) - _NIC_KEYS
    if unknown:
        raise ProfileError(f"{where}: unknown keys {sorted(unknown)}")
    if "busId" not in raw:
        raise ProfileError(f"{where}: busId is required")
    try:
        bus_id = normalize_bus_id(str(raw["busId"]))
    except ValueError as exc:
        raise ProfileError(f"{where}.busId: {exc}") from None
    domain, bus, _ = bus_id.split(":")
    total = _int(raw.get("totalVfs", 0), f"{where}.totalVfs")
    num = _int(raw.get("numVfs", 0), f"{where}.numVfs")
    if not 0 <= num <= total <= NIC_GROUP_STRIDE - 1:
        raise ProfileError(f"{where}: need 0 <= numVfs ({num}) <= totalVfs ({total}) <= {NIC_GROUP_STRIDE - 1}")
    return SimNic(
        bus_id=bus_id,
        interface=str(raw.get("interface", f"simnic{index}")),
        pcie_root=str(raw.get("pcieRoot") or f"pci{domain}:{max(int(bus, 16) - 1, 0):02x}"),
        numa_node=_int(raw.get("numaNode", -1), f"{where}.numaNode"),
        vendor=_int(raw.get("vendor", 0x15B3), f"{where}.vendor"),
        device=_int(raw.get("device", 0x1021), f"{where}.device"),
        vf_device=_int(raw.get("vfDevice", 0x101E), f"{where}.vfDevice"),
        driver=str(raw.get("driver", "mlx5_core")),
        total_vfs=total,
        num_vfs=num,
        iommu_group=_int(raw.get("iommuGroup", NIC_GROUP_BASE + NIC_GROUP_STRIDE * index), f"{where}.iommuGroup"),
    )


def _check_functions(gpus: list[SimGpu], nics: list[SimNic]) -> None:
    """No two PCI functions share an address; groups are shared only where the profile says so (a
    GPU's explicit `iommuGroup`), never by accident of the automatic numbering."""
    owners: dict[str, str] = {}
    for i, g in enumerate(gpus):
        own = [g.bus_id, *([g.audio_bus_id] if g.audio else []), *(g.vf_bus_id(n) for n in range(g.vgpu_vfs))]
        for bdf in own:
            if bdf in owners:
                raise ProfileError(f"gpus[{i}]: PCI function {bdf} is also {owners[bdf]}")
            owners[bdf] = f"gpus[{i}]"
    nic_groups: dict[int, str] = {}
    for i, n in enumerate(nics):
        for k, bdf in enumerate([n.bus_id] + [n.vf_bus_id(v) for v in range(n.total_vfs)]):
            if bdf in owners:
                raise ProfileError(f"nics[{i}]: PCI function {bdf} is also {owners[bdf]}")
            owners[bdf] = f"nics[{i}]"
            nic_groups[n.iommu_group + k] = f"nics[{i}]"
    for i, g in enumerate(gpus):
        if g.iommu_group in nic_groups:
            raise ProfileError(f"gpus[{i}]: IOMMU group {g.iommu_group} is also used by {nic_groups[g.iommu_group]}")


def parse_profile(name: str, raw: object) -> SimProfile:
    if not isinstance(raw, Mapping):
        raise ProfileError("a profile must be a JSON object")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ProfileError(f"unknown keys {sorted(unknown)}")
    defaults = raw.get("defaults", {})
    gpus_raw = raw.get("gpus", [])
    nics_raw = raw.get("nics", [])
    if not isinstance(defaults, Mapping) or not isinstance(gpus_raw, list) or not isinstance(nics_raw, list):
        raise ProfileError("defaults must be an object, gpus and nics lists")
    gpus = []
    for i, g in enumerate(gpus_raw):
        if not isinstance(g, Mapping):
            raise ProfileError(f"gpus[{i}] must be an object")
        gpus.append(_gpu(name, i, {**defaults, **g}))
    for attr, key in (("bus_id", "busId"), ("minor", "minor"), ("uuid", "uuid")):
        values = [getattr(g, attr) for g in gpus]
        dupes = sorted({str(v) for v in values if values.count(v) > 1})
        if dupes:
            raise ProfileError(f"two GPUs share {key} {', '.join(dupes)}")
    for i, g in enumerate(gpus):
        named = "iommuGroup" in gpus_raw[i] or "iommuGroup" in defaults
        shared = [j for j, o in enumerate(gpus) if j != i and o.iommu_group == g.iommu_group]
        if shared and not named:
            raise ProfileError(f"gpus[{i}]: its automatic IOMMU group {g.iommu_group} is one gpus[{shared[0]}] "
                               "names; give both an iommuGroup to share a group")
    nics = [_nic(i, n) for i, n in enumerate(nics_raw)]
    _check_functions(gpus, nics)
    return SimProfile(
        name=name,
        driver_version=str(raw.get("driverVersion", "570.124.06")),
        cuda_driver_version=_int(raw.get("cudaDriverVersion", 12080), "cudaDriverVersion"),
        gpus=tuple(gpus),
        errors=_faults(raw.get("errors", {}), SYSTEM_FUNCTIONS | DEVICE_FUNCTIONS, "profile"),
        nics=tuple(nics),
        iommufd=_bool(raw.get("iommufd", True), "iommufd"),
    )


_DGX_H100: dict[str, Any] = {
    "driverVersion": "570.124.06",
    "cudaDriverVersion": 12080,
    "defaults": {
        "name": "NVIDIA H100 80GB HBM3",
        "memoryTotal": 85520809984,
        "brand": "NVML_BRAND_NVIDIA",
        "architecture": "NVML_DEVICE_ARCH_HOPPER",
        "computeCapability": [9, 0],
        "migMode": [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE],
        "migProfiles": "h100-80gb",
        "pciDeviceId": 0x233010DE,  # 10de:2330, H100 SXM5 80GB
        "pciSubSystemId": 0x16C110DE,
    },
    "gpus": [
        {"busId": f"0000:{bus}:00.0", "numaNode": numa}
        for bus, numa in (("18", 0), ("2a", 0), ("3a", 0), ("5d", 0),
                          ("9a", 1), ("ab", 1), ("ba", 1))
    ] + [
        # The last H100 as a vGPU host with SR-IOV: 20 VFs (the most vGPUs of its smallest type), the vGPU
        # types on them. The others list their types on the GPU (the layout of GPUs without SR-IOV).
        {"busId": "0000:db:00.0", "numaNode": 1, "vgpuVfs": 20},
    ],
    # A ConnectX-7 with SR-IOV on, four of its eight VFs enabled (for VF passthrough).
    "nics": [{"busId": "0000:4b:00.0", "interface": "ens75f0np0", "numaNode": 0, "totalVfs": 8, "numVfs": 4}],
}

# Sixteen H100s on two NUMA nodes, each GPU alone in its IOMMU group: more counter sets than one
# ResourceSlice may carry (8), so the slices need two counter slices.
_HGX_16: dict[str, Any] = {
    "driverVersion": _DGX_H100["driverVersion"],
    "cudaDriverVersion": _DGX_H100["cudaDriverVersion"],
    "defaults": _DGX_H100["defaults"],
    "gpus": [{"busId": f"0000:{0x0c + 0x0f * i:02x}:00.0", "numaNode": i // 8} for i in range(16)],
    "nics": [{"busId": "0000:f5:00.0", "interface": "ens245f0np0", "numaNode": 1, "totalVfs": 8, "numVfs": 4}],
}

BUILTIN: dict[str, dict[str, Any]] = {"dgx-h100": _DGX_H100, "hgx-16": _HGX_16}


def load_profile(spec: str) -> SimProfile:
    """A builtin profile by name, or a JSON file by path."""
    if spec in BUILTIN:
        return parse_profile(spec, BUILTIN[spec])
    path = Path(spec)
    if not path.is_file():
        raise ProfileError(f"{spec!r} is neither a builtin profile ({', '.join(sorted(BUILTIN))}) "
                           "nor a JSON file")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{path}: {exc}") from None
    try:
        return parse_profile(path.stem, raw)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None

"""What a simulated machine is: its GPUs (`SimGpu`), NICs (`SimNic`) and the whole (`SimProfile`), the
NVML calls faults may name, and the NVML error codes they name (read as NVML's own, by
`agent.inventory.nvmlvalues`). `agent.sim.profiles` reads machines from JSON profiles (and holds the
builtins); the simulated NVML, sysfs and kernel act them out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import pynvml

from agent.inventory.nvmlvalues import error_code as nvml_error_code

# The per-GPU calls the simulation answers; faults may name any of them.
DEVICE_FUNCTIONS = frozenset({
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByPciBusId",
    "nvmlDeviceGetIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetBrand",
    "nvmlDeviceGetArchitecture", "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMigMode",
    "nvmlDeviceGetNumaNodeId",
})
SYSTEM_FUNCTIONS = frozenset({
    "nvmlInit", "nvmlInitWithFlags", "nvmlShutdown", "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetNVMLVersion",
    "nvmlDeviceGetCount",
})

# Groups the profile does not name: a GPU's is 100 + its index, a NIC's functions 200 + 32 * NIC index + n.
GPU_GROUP_BASE = 100
NIC_GROUP_BASE = 200
NIC_GROUP_STRIDE = 32


class ProfileError(ValueError):
    """A simulated-NVML profile that cannot be used, with what is wrong in it."""


@dataclass(frozen=True)
class SimGpu:
    name: str
    bus_id: str  # canonical `0000:18:00.0`
    memory_total: int
    uuid: str
    minor: int
    pcie_root: str  # `pci0000:17`
    numa_node: int = -1  # what sysfs says; -1 = no affinity
    nvml_numa_node: int | None = None  # None: nvmlDeviceGetNumaNodeId is NOT_SUPPORTED
    brand: int = pynvml.NVML_BRAND_NVIDIA
    architecture: int = pynvml.NVML_DEVICE_ARCH_UNKNOWN
    compute_capability: tuple[int, int] | None = None
    mig_mode: tuple[int, int] | None = None  # None: not MIG capable
    pci_device_id: int = 0x000010DE  # (device << 16) | vendor, as NVML packs it
    pci_subsystem_id: int = 0
    in_sysfs: bool = True
    lost: bool = False
    errors: Mapping[str, int] = field(default_factory=dict)
    iommu_group: int = -1  # parse_profile assigns it; -1 only in hand-built records (100 + index then)
    audio: bool = False  # an HD audio function (class 0x0403) at function 1 of the slot, same group
    bridge_in_group: bool = False  # the root port above the GPU is in the GPU's group (no ACS)
    mig_profiles: str = ""  # the MIG profile table (agent.sim.migprofiles.MIG_TABLES); "": no profile offered
    # SR-IOV VFs the vGPU manager enabled (`sriov-manage -e`): its vGPU types are on them, one vGPU per VF,
    # not on the GPU itself (0: none, the types on the GPU, as older GPUs without SR-IOV have them).
    vgpu_vfs: int = 0

    @property
    def audio_bus_id(self) -> str:
        """Function 1 of the GPU's slot, where its audio function sits."""
        return self.bus_id[:-1] + "1"

    def vf_bus_id(self, n: int) -> str:
        """VF n's address: from function 4 of the GPU's slot on, as NVIDIA's GPUs place them (n = 0: .4,
        n = 4: the next slot's .0)."""
        domain, bus, rest = self.bus_id.split(":")
        slot = int(rest.split(".")[0], 16)
        routing = slot * 8 + 4 + n
        return f"{domain}:{bus}:{routing // 8:02x}.{routing % 8}"

    @property
    def nvml_bus_id(self) -> bytes:
        """The bus ID as NVML spells it: 8-digit domain, upper-case hex."""
        domain, bus, rest = self.bus_id.split(":")
        return f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}".encode()


@dataclass(frozen=True)
class SimNic:
    """A NIC physical function, with SR-IOV virtual functions when `total_vfs` > 0."""

    bus_id: str
    interface: str  # the PF's netdev name; VF n's is `<interface>v<n>`
    pcie_root: str
    numa_node: int = -1
    vendor: int = 0x15B3  # Mellanox
    device: int = 0x1021  # ConnectX-7
    vf_device: int = 0x101E  # ConnectX family VF
    driver: str = "mlx5_core"
    total_vfs: int = 0
    num_vfs: int = 0
    iommu_group: int = NIC_GROUP_BASE  # the PF's; VF n's is this + 1 + n

    def vf_bus_id(self, n: int) -> str:
        """VF n (from 0) at routing-ID offset 1 + n, stride 1, from the PF (ARI: device and function
        numbers run together)."""
        domain, bus, rest = self.bus_id.split(":")
        dev, fn = rest.split(".")
        rid = (int(dev, 16) << 3 | int(fn)) + 1 + n
        return f"{domain}:{bus}:{rid >> 3:02x}.{rid & 7}"

    def mac(self, vf: int | None = None) -> str:
        """A stable locally administered MAC for the PF (None) or VF n."""
        h = hashlib.sha256(f"nic-sim/{self.bus_id}/{vf}".encode()).digest()
        return ":".join(f"{b:02x}" for b in (0x02, *h[:5]))


@dataclass(frozen=True)
class SimProfile:
    name: str
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[SimGpu, ...]
    errors: Mapping[str, int] = field(default_factory=dict)
    nics: tuple[SimNic, ...] = ()
    iommufd: bool = True  # the host has /dev/iommu and VFIO device cdevs (/dev/vfio/devices/vfioN)


def error_code(value: object, where: str) -> int:
    """An NVML error code a profile or fault names (`agent.inventory.nvmlvalues.error_code`); ProfileError
    when it is none."""
    code = nvml_error_code(value)
    if code is None:
        raise ProfileError(f"{where}: {value!r} is not an NVML error code")
    return code

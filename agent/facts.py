"""What discovery knows about a device beyond what it publishes: the typed facts prepare, health
and the claim status work from (`Device.node`).

One type per family of kinds:

- `GpuFacts` for every form of a GPU that NVML knows (a whole GPU, its shared form, a MIG placement,
  a vGPU): the GPU's identity (`GpuIdentity`) and the form's target, which is what prepare makes of
  it: `None` (the GPU as it is), a `GpuShare`, a `MigPlacement` or a `VgpuType`.
- `PassthroughFacts` for a passthrough (VFIO) variant of a GPU or NIC function: the function, its
  IOMMU group and drivers. A GPU on vfio-pci has left NVML, so a variant has no GPU identity.
- `NicFacts`, `CpuFacts`, `MemoryFacts` for the node's other devices.

Each type says the kind of its device (`kind`; a device's kind and facts always agree) and the PCI
function it is or is made of (`pci_bus_id`). Discovery makes the facts first and derives the device's
published attributes from them (`agent.inventory.published`); nothing reads attributes back to learn a
fact.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.kinds import Kind


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """Which GPU: NVML's answers about it."""

    uuid: str  # GPU-...
    index: int  # NVML's index
    minor: int  # /dev/nvidia<minor>
    pci_bus_id: str  # 0000:18:00.0


@dataclass(frozen=True, slots=True)
class MigPlacement:
    """A MIG placement: the profile (by name; `agent.inventory.mig.find_profile` gives NVML's enum and
    id on the GPU) and the memory slices the GPU instance covers."""

    profile: str  # 1g.10gb
    start: int  # the first memory slice
    size: int  # memory slices


@dataclass(frozen=True, slots=True)
class VgpuType:
    """A vGPU (mediated device) type as the agent publishes it: its id, name, framebuffer and the
    number of instances one GPU can host."""

    id: str  # nvidia-1021: the mdev type directory
    name: str  # GRID H100-4C
    framebuffer: int | None  # bytes
    instances: int


@dataclass(frozen=True, slots=True)
class GpuShare:
    """The GPU shared by claims, each with a share of its memory (consumable capacity)."""


GpuTarget = MigPlacement | VgpuType | GpuShare | None


@dataclass(frozen=True, slots=True)
class GpuFacts:
    """A form of a GPU: the GPU, and what of it the device stands for."""

    gpu: GpuIdentity
    target: GpuTarget = None

    @property
    def kind(self) -> Kind:
        if self.target is None:
            return Kind.GPU
        if isinstance(self.target, GpuShare):
            return Kind.GPUSHARE
        return Kind.MIG if isinstance(self.target, MigPlacement) else Kind.VGPU

    @property
    def pci_bus_id(self) -> str:
        return self.gpu.pci_bus_id


@dataclass(frozen=True, slots=True)
class PassthroughFacts:
    """A GPU or NIC function for passthrough: the function, its IOMMU group, the driver it had when
    discovery read it ("": none), and the host driver it goes back to at unprepare (its driver when
    discovery last saw it off vfio-pci; "" when never seen so: prepare's record then decides)."""

    native: Kind  # Kind.GPU | Kind.NIC: what the function is on the host
    pci_bus_id: str
    iommu_group: int
    driver: str = ""
    host_driver: str = ""
    mac: str = ""  # a NIC function's MAC, as last seen while it had its netdev

    @property
    def kind(self) -> Kind:
        return Kind.VFIO


@dataclass(frozen=True, slots=True)
class NicFacts:
    """A network port: its interface and addresses, and its PCI function ("" for a virtual one)."""

    interface: str
    mac: str = ""
    ips: tuple[str, ...] = ()  # CIDR, IPv4 first
    link_up: bool = False
    pci_bus_id: str = ""
    # Why it is the node's uplink (`agent.inventory.uplinks`: it, or a link above it, carries a default
    # route or an address of the Node), "" when it is not: never moved into a pod nor passed through,
    # which would cut the node off.
    uplink_reason: str = ""

    @property
    def uplink(self) -> bool:
        return bool(self.uplink_reason)

    @property
    def kind(self) -> Kind:
        return Kind.NIC


@dataclass(frozen=True, slots=True)
class CpuFacts:
    """The online CPUs of a NUMA node, and the same CPUs by core (each core's hardware threads), which is
    how prepare hands out a claim's share of them (`agent.claims.cpuset`)."""

    cpus: tuple[int, ...]
    cores: tuple[tuple[int, ...], ...] = ()

    @property
    def kind(self) -> Kind:
        return Kind.CPU

    @property
    def pci_bus_id(self) -> str:
        return ""


@dataclass(frozen=True, slots=True)
class MemoryFacts:
    """The memory of a NUMA node."""

    numa_node: int

    @property
    def kind(self) -> Kind:
        return Kind.MEMORY

    @property
    def pci_bus_id(self) -> str:
        return ""


DeviceFacts = GpuFacts | PassthroughFacts | NicFacts | CpuFacts | MemoryFacts

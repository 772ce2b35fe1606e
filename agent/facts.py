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

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

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


class MigProfileShape(Protocol):
    """What `MigChoice.pick` reads of a MIG profile (`agent.inventory.mig.MigProfile`)."""

    @property
    def name(self) -> str: ...
    @property
    def compute_slices(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def memory(self) -> int: ...


_P = TypeVar("_P", bound=MigProfileShape)


@dataclass(frozen=True, slots=True)
class MigChoice:
    """Which MIG profiles have their placements published (`--mig-profiles`): `all`, or a comma list of
    profile names (`1g.10gb+me`) and compute sizes (`3g`: the GPU's plainest profile of 3 compute slices,
    the one without media extensions and with the fewest memory slices: 3g.40gb on an H100, 3g.20gb on an
    A100 40GB). A GPU offering none of them gets no MIG devices."""

    names: frozenset[str] = frozenset()
    sizes: frozenset[int] = frozenset()
    every: bool = False

    @classmethod
    def parse(cls, setting: str) -> MigChoice:
        words = [w.strip() for w in setting.split(",") if w.strip()]
        if words == ["all"]:
            return cls(every=True)
        if not words or "all" in words:
            raise ValueError(f"--mig-profiles {setting!r}: all (alone), or a comma list of profile names "
                             "(1g.10gb) and compute sizes (1g); --dynamic-mig=false publishes none")
        sizes = {int(w[:-1]) for w in words if _SIZE.fullmatch(w)}
        names = {w for w in words if not _SIZE.fullmatch(w)}
        if bad := sorted(n for n in names if not _PROFILE.fullmatch(n)):
            raise ValueError(f"--mig-profiles {setting!r}: {', '.join(bad)} is neither a MIG profile name "
                             "(1g.10gb, 1g.10gb+me) nor a compute size (1g)")
        return cls(frozenset(names), frozenset(sizes))

    def pick(self, profiles: Sequence[_P]) -> tuple[_P, ...]:
        """The profiles chosen among a GPU's (`agent.inventory.mig.MigProfile`), in their order."""
        if self.every:
            return tuple(profiles)
        plainest: dict[int, _P] = {}
        for p in profiles:
            known = plainest.get(p.compute_slices)
            if "+" not in p.name and (known is None or (p.size, p.memory) < (known.size, known.memory)):
                plainest[p.compute_slices] = p
        return tuple(p for p in profiles if p.name in self.names
                     or (p.compute_slices in self.sizes and plainest.get(p.compute_slices) is p))


_SIZE = re.compile(r"[1-9][0-9]?g")
_PROFILE = re.compile(r"[1-9][0-9]?g\.[0-9]+gb(\+[a-z0-9]+)*")


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

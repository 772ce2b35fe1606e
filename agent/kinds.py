"""Device kinds: what each kind of device is, said once, in one table.

`Kind` is the type of `Device.kind`. Its values are the kind names the agent has always used
(`dra-agent devices` shows them, the metrics label devices with them), so nothing on the wire or
on disk changes. Every question that depends on the kind (can it be prepared, is it a PCI function,
which form of a GPU is it, what does prepare create for it, ...) is a property of the kind, read
from `TRAITS`; no module keeps a list of kinds of its own.

The traits:

- `published_type`: the device's `type` attribute (a shared GPU publishes `shared`, not `gpushare`).
- `preparable`: the prepare engine knows how to prepare it; any other device is refused before any
  side effect, never half-prepared (a kind may be published ahead of its prepare path).
- `function`: the device is a whole PCI function (a GPU, a NIC port's function, a passthrough
  variant): one lock per function for all of its forms, and the native ones have a passthrough
  variant that excludes them (`agent.hostprep.vfio`).
- `form`: the device is another form of a native device's hardware (a passthrough variant, a MIG
  placement, a vGPU, a shared GPU): it carries the native device's taints, health and readiness
  (`agent.health.service`), and is published from memory with a lost GPU.
- `gpu_form`: which form of a GPU the device takes it in, for the forms that exclude each other on
  one GPU (`GpuForm`; a passthrough variant only when its function is a GPU).
- `partition_kind`: what prepare creates on the host for it (`PartitionKind`: a MIG instance, a mediated
  device), by the partitioner of that kind (`agent.hostprep.partitions`).
- `passthrough`: prepare binds its PCI function to vfio-pci for a VM (it takes `VfioConfig`).
- `shared`: it is handed out in shares (consumable capacity): each allocation result names a share
  and the memory it consumed.
- `compatibility_group`: the compatibility group of its counter consumption (`agent.counters`),
  where it has one ("" for none).
- `cuda_uuid`: its CDI device tells the container the UUID CUDA knows it by (`DRA_<DEVICE>_UUID`; a
  shared GPU's is set with its memory limit, `agent.claims.plan`).
- `toolkit`: a container's CUDA uses it (a whole or shared GPU, a MIG device): the NVIDIA Container
  Toolkit's own CDI device for its GPU is added for the driver's libraries (a MIG device's parent GPU's;
  `agent.claims.toolkit`), and `CUDA_VISIBLE_DEVICES` names it (`agent.claims.plan`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class GpuForm(StrEnum):
    """The forms a GPU can be used in at one time. Two different forms of one GPU never coexist: the
    whole GPU (native or passed through) with a share or a partition, shares with partitions, and MIG
    with vGPU (the driver takes the GPU into one mode or the other). Forms of one kind go together:
    shares are what sharing is for, partitions are kept apart by the counters, and the native GPU and
    its passthrough variant by `agent.hostprep.vfio`."""

    WHOLE = "whole GPU"
    SHARED = "shared GPU"
    MIG = "MIG"
    VGPU = "vGPU"

    def clashes(self, other: GpuForm) -> bool:
        return self is not other


class PartitionKind(StrEnum):
    """What prepare creates on the host for a partition device (the value is the record's `kind`)."""

    MIG = "mig"  # a MIG GPU instance and its compute instance
    MDEV = "mdev"  # a mediated device (vGPU)

    @property
    def uuid_attribute(self) -> str:
        """The attribute the made partition's UUID is given in the device metadata file."""
        return _UUID_ATTRIBUTES[self]


# A MIG device's UUID is the one CUDA knows it by; a mediated device's goes to the VM's
# launcher (KubeVirt reads `mdevUUID` before `pciBusID`).
_UUID_ATTRIBUTES = {PartitionKind.MIG: "uuid", PartitionKind.MDEV: "mdevUUID"}


@dataclass(frozen=True, slots=True)
class Traits:
    """What one kind of device is (see the module docstring for each field)."""

    published_type: str
    preparable: bool = True
    function: bool = False
    form: bool = False
    gpu_form: GpuForm | None = None
    partition_kind: PartitionKind | None = None
    passthrough: bool = False
    shared: bool = False
    compatibility_group: str = ""
    cuda_uuid: bool = False
    toolkit: bool = False


class Kind(StrEnum):
    # In the order prepare's refusal lists them.
    GPU = "gpu"  # a whole GPU (NVML)
    NIC = "nic"  # a network port
    CPU = "cpu"  # the CPUs of a NUMA node
    MEMORY = "memory"  # the memory of a NUMA node
    VFIO = "vfio"  # a GPU or NIC function for passthrough to a VM (agent.inventory.passthrough)
    GPUSHARE = "gpushare"  # a GPU shared by claims (agent.inventory.gpushare)
    MIG = "mig"  # a MIG placement (agent.inventory.mig)
    VGPU = "vgpu"  # a vGPU: a mediated device of one type (agent.inventory.vgpu)

    @property
    def traits(self) -> Traits:
        return TRAITS[self]

    @property
    def published_type(self) -> str:
        return TRAITS[self].published_type

    @property
    def preparable(self) -> bool:
        return TRAITS[self].preparable

    @property
    def function(self) -> bool:
        return TRAITS[self].function

    @property
    def form(self) -> bool:
        return TRAITS[self].form

    @property
    def gpu_form(self) -> GpuForm | None:
        return TRAITS[self].gpu_form

    @property
    def partition_kind(self) -> PartitionKind | None:
        return TRAITS[self].partition_kind

    @property
    def passthrough(self) -> bool:
        return TRAITS[self].passthrough

    @property
    def shared(self) -> bool:
        return TRAITS[self].shared

    @property
    def compatibility_group(self) -> str:
        return TRAITS[self].compatibility_group

    @property
    def cuda_uuid(self) -> bool:
        return TRAITS[self].cuda_uuid

    @property
    def toolkit(self) -> bool:
        return TRAITS[self].toolkit


TRAITS: Mapping[Kind, Traits] = {
    Kind.GPU: Traits("gpu", function=True, gpu_form=GpuForm.WHOLE, cuda_uuid=True, toolkit=True),
    Kind.NIC: Traits("nic", function=True),
    Kind.CPU: Traits("cpu"),
    Kind.MEMORY: Traits("memory"),
    Kind.VFIO: Traits("vfio", function=True, form=True, gpu_form=GpuForm.WHOLE, passthrough=True),
    Kind.GPUSHARE: Traits("shared", form=True, gpu_form=GpuForm.SHARED, shared=True, toolkit=True),
    Kind.MIG: Traits("mig", form=True, gpu_form=GpuForm.MIG, partition_kind=PartitionKind.MIG,
                     compatibility_group="mig", cuda_uuid=True, toolkit=True),
    Kind.VGPU: Traits("vgpu", form=True, gpu_form=GpuForm.VGPU, partition_kind=PartitionKind.MDEV,
                      compatibility_group="vgpu"),
}


def preparable_kinds() -> list[Kind]:
    """The kinds prepare knows, in `Kind` order."""
    return [k for k in Kind if TRAITS[k].preparable]


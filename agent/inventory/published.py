"""The attributes a device publishes from its facts (`agent.facts`), derived here and only here.

Discovery makes a device's facts first and its attributes from them, adding what it read that is no
fact the agent works from (a GPU's product and driver versions, a NIC's MTU, PCI topology, ...). The
agent never reads these attributes back: prepare, health and the claim status take the facts.

- a GPU form: `type`, and by target: the whole GPU `uuid`, `index`, `minor`; a MIG placement
  `profile`, `parentUUID`, `placementStart`, `placementSize`; a vGPU `vgpuType`, `mdevType`,
  `parentUUID`; a shared GPU nothing more (it carries all of its GPU's attributes, `form_attributes`);
- a passthrough variant: `type=vfio`, `nativeType` (`gpu` | `nic`), `iommuGroup`, and a NIC
  function's `macAddress`;
- a NIC: `type=nic`, `ifName`, `macAddress`, `linkUp`, `ipv4` and `ipv6` (the first of each);
- CPUs: `type=cpu`; memory: `type=memory` and the NUMA node;
- with `--partition-type-attribute`, a MIG placement or a vGPU: `partitionType` (`with_partition_type`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from agent.facts import (
    CpuFacts,
    DeviceFacts,
    GpuFacts,
    GpuShare,
    MemoryFacts,
    MigPlacement,
    NicFacts,
    PassthroughFacts,
    VgpuType,
)
from agent.model import NUMA_NODE, AttrValue, Device

TYPE = "type"
MDEV_TYPE = "mdevType"
NATIVE_TYPE = "nativeType"
IOMMU_GROUP = "iommuGroup"
MAC_ADDRESS = "macAddress"
MIG_CAPABLE = "migCapable"
MIG_ENABLED = "migEnabled"
# A partition's type for ResourcePoolStatusRequest summaries (the slice's `partitionTypeAttribute`).
PARTITION_TYPE = "partitionType"
# What a whole GPU publishes of itself alone: its identity and its MIG mode. A shared GPU is the whole
# GPU and carries them too; a MIG placement or a vGPU is a part of it and carries every other attribute
# of its GPU (product, brand, architecture, versions, PCI attributes), by default any new one as well.
WHOLE_GPU_ONLY = frozenset(("uuid", "index", "minor", MIG_CAPABLE, MIG_ENABLED))


def attributes(facts: DeviceFacts) -> dict[str, AttrValue]:
    """The attributes `facts` give, `type` first."""
    out: dict[str, AttrValue] = {TYPE: facts.kind.published_type}
    if isinstance(facts, GpuFacts):
        gpu, target = facts.gpu, facts.target
        if target is None:
            out |= {"uuid": gpu.uuid, "index": gpu.index, "minor": gpu.minor}
        elif isinstance(target, MigPlacement):
            out |= {"profile": target.profile, "parentUUID": gpu.uuid, "placementStart": target.start,
                    "placementSize": target.size}
        elif isinstance(target, VgpuType):
            out |= {"vgpuType": target.name, MDEV_TYPE: target.id, "parentUUID": gpu.uuid}
    elif isinstance(facts, PassthroughFacts):
        out |= {NATIVE_TYPE: facts.native.published_type, IOMMU_GROUP: facts.iommu_group}
        if facts.mac:
            out[MAC_ADDRESS] = facts.mac
    elif isinstance(facts, NicFacts):
        out["ifName"] = facts.interface
        if facts.mac:
            out[MAC_ADDRESS] = facts.mac
        out["linkUp"] = facts.link_up
        out["uplink"] = facts.uplink
        v4 = [ip for ip in facts.ips if ":" not in ip]
        v6 = [ip for ip in facts.ips if ":" in ip]
        if v4:
            out["ipv4"] = v4[0]
        if v6:
            out["ipv6"] = v6[0]
    elif isinstance(facts, MemoryFacts):
        out[NUMA_NODE] = facts.numa_node
    else:
        assert isinstance(facts, CpuFacts)
    return out


def form_attributes(gpu_attributes: Mapping[str, AttrValue], facts: GpuFacts) -> dict[str, AttrValue]:
    """The attributes of a form of a GPU, given the whole GPU's: its own, and what it carries of its GPU's."""
    if isinstance(facts.target, GpuShare):
        carried = dict(gpu_attributes)
    else:
        carried = {k: v for k, v in gpu_attributes.items() if k not in WHOLE_GPU_ONLY}
    return carried | attributes(facts)


def partition_type(facts: GpuFacts) -> str | None:
    """The partition type of a MIG placement or a vGPU: devices with one value take the same counters.

    So it names the GPU (each GPU has a counter set of its own), and for a MIG placement also where it
    starts (the memory slices it covers are counters: two placements of a profile never cost the same),
    which makes each placement a type of its own: `gpu-0 1g.10gb@3`. The instances of one vGPU type on
    one GPU take the same share of its memory: `gpu-0 GRID H100-8C`."""
    target, minor = facts.target, facts.gpu.minor
    if isinstance(target, MigPlacement):
        return f"gpu-{minor} {target.profile}@{target.start}"
    if isinstance(target, VgpuType):
        return f"gpu-{minor} {target.name}"
    return None


def with_partition_type(device: Device) -> Device:
    """The device with its `partitionType` attribute, when it is a partition (MIG placement, vGPU)."""
    facts = device.node
    value = partition_type(facts) if isinstance(facts, GpuFacts) else None
    if value is None:
        return device
    return dataclasses.replace(device, attributes={**device.attributes, PARTITION_TYPE: value})

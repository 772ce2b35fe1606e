"""vGPU devices at prepare: the `Partitioner` for mediated devices (`agent.hostprep.partitions`).

A claim for a published vGPU device (`gpu-0-vgpu-nvidia-1021-3`, `agent.inventory.vgpu`) gets a new
mediated device of that type on that GPU, made at prepare and removed at unprepare:

- plan: the GPU is on its host driver (not passed through to a VM), offers the type, and the type
  has an instance available now (NVIDIA's driver offers none of another type once the GPU hosts
  one); the parent is the GPU, or on a GPU whose SR-IOV VFs list the types (Ampere and later), its
  first VF with an instance of the type available (a VF hosts one vGPU). The device the scheduler
  allocated stays the GPU's, on its counter set; the record names the parent. No side effect.
- create, one step (step 0): choose the UUID and record it (`write`) BEFORE writing it to the type's
  `create`, then wait (bounded) for the device. A crash anywhere leaves a record naming the UUID of
  any device that may exist, so `destroy` can always find it. Idempotent: a device with that UUID,
  type and parent already there is taken as made.
- destroy: write 1 to the device's `remove` when it is there (after waiting out a write to `create`
  the simulated kernel has not applied yet); nothing when it is not (never made, removed already,
  or forgotten by a reboot). One step, so nothing to record on the way.
- device: the allocated device with `mdevUUID` (KubeVirt reads it before `pciBusID`) and the VFIO
  nodes of the device's own IOMMU group (`/dev/vfio/vfio`, `/dev/vfio/<group>`: the legacy
  interface; an mdev has no iommufd cdev here).

Blocking (sysfs writes and bounded waits): call from the claim's worker thread.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid as uuidlib

from agent import failpoints
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import DevicePartition
from agent.facts import GpuFacts, VgpuType
from agent.host.mdev import sysfs as mdev
from agent.host.mdev.errors import MdevError, NoInstanceAvailable, ParentUnavailable, TypeNotOffered
from agent.host.vfio.host import VfioHost
from agent.host.vfio.pci import VFIO_PCI, current_driver
from agent.hostprep.partitions import WritePartition
from agent.kinds import PartitionKind

log = logging.getLogger(__name__)

CREATED = 1  # the step after the only one: the device exists


class VgpuPartitioner:
    """Mediated devices for claims, on the host (or simulated machine) `host`."""

    kind = PartitionKind.MDEV

    def __init__(self, host: VfioHost, *, timeout: float = mdev.DEFAULT_TIMEOUT) -> None:
        self.host = host
        self.timeout = timeout  # per create or remove

    def plan(self, uid: str, allocated: AllocatedDevice) -> DevicePartition:
        dev = allocated.device
        if not isinstance(dev.node, GpuFacts) or not isinstance(target := dev.node.target, VgpuType):
            raise MdevError(f"device {dev.name} is not a vGPU device this agent published")
        parent, type_id = dev.node.gpu.pci_bus_id, target.id
        driver = current_driver(self.host.sysfs, parent)  # the GPU's: its VFs are there only while it is
        if driver == VFIO_PCI:
            raise ParentUnavailable(f"device {dev.name}: GPU {parent} is bound to {VFIO_PCI} (passed through to a "
                                    "VM): it hosts no vGPU until it is back on its host driver")
        offered = mdev.gpu_types(self.host.sysfs, parent)
        if not offered:
            raise ParentUnavailable(f"device {dev.name}: GPU {parent} offers no vGPU types now (bound to "
                                    f"{driver or 'no driver'}; is the vGPU host driver loaded?)")
        t = next((o for o in offered if o.id == type_id), None)
        if t is None:
            raise TypeNotOffered(f"device {dev.name}: GPU {parent} does not offer vGPU type {type_id} (it offers "
                                 f"{', '.join(o.id for o in offered)})")
        if t.available <= 0:
            present = mdev.gpu_mdevs(self.host.sysfs, parent)
            held = sorted(set(present.values()))
            why = (f"it hosts {len(present)} vGPU(s) of type {', '.join(held)}, and one GPU hosts one type at a time"
                   if held and held != [type_id] else f"all instances of {type_id} are in use")
            raise NoInstanceAvailable(f"device {dev.name}: GPU {parent} has no {type_id} ({t.name}) instance "
                                      f"available: {why}; retry once one is released")
        on = mdev.parent_for(self.host.sysfs, parent, type_id)
        if on is None:  # gone between the two reads
            raise NoInstanceAvailable(f"device {dev.name}: GPU {parent} has no {type_id} instance available now; "
                                      "retry once one is released")
        return DevicePartition(device=dev.name, kind=PartitionKind.MDEV, parent=on, profile=type_id,
                               boot_id=self.host.boot_id())

    def create(self, part: DevicePartition, write: WritePartition) -> DevicePartition:
        if part.uuid and self._present(part):
            return dataclasses.replace(part, step=CREATED)
        # The UUID goes to the record before the kernel hears of it: whatever happens next, recovery
        # knows which device to look for. A recorded one is kept (its CDI spec and metadata name it).
        part = dataclasses.replace(part, uuid=part.uuid or str(uuidlib.uuid4()), step=0,
                                   boot_id=self.host.boot_id())
        write(part)
        failpoints.hit("mdev-before-create")
        mdev.create(self.host.sysfs, part.parent, part.profile, part.uuid, timeout=self.timeout)
        failpoints.hit("mdev-after-create")
        log.info("mediated device %s (%s) created on %s for %s", part.uuid, part.profile, part.parent, part.device)
        return dataclasses.replace(part, step=CREATED)

    def destroy(self, part: DevicePartition, write: WritePartition | None) -> None:
        if not part.uuid:
            return  # the UUID is recorded before `create` is written: none was
        mdev.wait_created(self.host.sysfs, part.parent, part.profile, part.uuid, timeout=self.timeout)
        if not mdev.exists(self.host.sysfs, part.uuid):
            return
        failpoints.hit("mdev-before-remove")
        mdev.remove(self.host.sysfs, part.uuid, timeout=self.timeout)
        log.info("mediated device %s (%s) removed from %s (%s)", part.uuid, part.profile, part.parent, part.device)

    def exists(self, part: DevicePartition) -> bool:
        return part.step == CREATED and self._present(part)

    def _present(self, part: DevicePartition) -> bool:
        """A mediated device with the partition's UUID, parent and type is on the host."""
        sysfs = self.host.sysfs
        return bool(part.uuid) and mdev.exists(sysfs, part.uuid) and mdev.parent_of(sysfs, part.uuid) == part.parent \
            and mdev.type_of(sysfs, part.uuid) == part.profile

    def remake(self, part: DevicePartition) -> DevicePartition:
        """The same UUID (the claim's files name it: the VM keeps its mediated device's identity)."""
        return dataclasses.replace(part, step=0, boot_id=self.host.boot_id())

    def device(self, part: DevicePartition, allocated: AllocatedDevice) -> AllocatedDevice:
        nodes = mdev.vfio_nodes(self.host.sysfs, self.host.dev, part.uuid)
        return dataclasses.replace(allocated, device=dataclasses.replace(allocated.device, device_nodes=nodes),
                                   made=part)


__all__ = ["CREATED", "VgpuPartitioner"]

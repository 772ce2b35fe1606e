"""MIG partitions at prepare: a GPU instance at the allocated placement and its compute instance.

A published MIG device (`gpu-<minor>-mig-<profile>-<start>`, `agent.inventory.mig`) stands for a
placement; prepare makes it real through NVML, in steps, each written in the claim's record
(`DevicePartition.step`) before it happens and each judged against what NVML shows now, so a step a
crash interrupted is done again or adopted, never doubled:

0. MIG mode on, when it is off and can be turned on without a GPU reset (NVML's activation status and
   the pending mode say so; otherwise a precise MigModeUnavailable). `mode_changed` is recorded
   before the mode is touched, so an unprepare knows to turn it off again.
1. The GPU instance at the placement (`nvmlDeviceCreateGpuInstanceWithPlacement`). A GPU instance of
   the profile already there (this step ran before a crash) is adopted.
2. The compute instance covering the whole GPU instance (the full-size compute profile); its GPU
   instance id is in the record first.
3. The MIG device's handle and UUID (`MIG-...`); its compute instance id is in the record first.

`destroy` converges from any prefix: the compute instances of the claim's GPU instance, the GPU
instance, and MIG mode off when the agent turned it on (this claim or another one: `agent.hostprep.migmode`)
and no GPU instance is left (an H100 allows
that without a reset, so the full GPU is free again). The container gets the MIG UUID
(`DRA_<DEVICE>_UUID`, the metadata's `uuid` attribute), the parent's device nodes and the GI and CI
access capabilities' nodes, `/dev/nvidia-caps/nvidia-cap<minor>`, the minors read where the driver
publishes them (`/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<id>/[ci<id>/]access`); the driver
makes no such nodes itself, so the agent creates the ones missing, as nvidia-modprobe does
(`agent.host.nvcaps`).
The NVML queries (instances, compute instances) are in `agent.hostprep.migquery`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pynvml

from agent import failpoints
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import DevicePartition
from agent.errors import ClaimFailure
from agent.facts import GpuFacts, MigPlacement
from agent.host.nvcaps import CapError, caps_dir, ensure_node
from agent.hostprep.migmode import MigModeMarks
from agent.hostprep.migquery import (
    CI_PROFILES,
    ci_handles,
    ci_ids,
    gi_at,
    gpu_instances,
)
from agent.hostprep.partitions import WritePartition
from agent.inventory import Inventory
from agent.inventory import mig as migs
from agent.inventory.gpus import SHARED_NODES, GpuSource
from agent.inventory.nvmlapi import Nvml, NvmlHandle
from agent.inventory.nvmlgate import NvmlGate
from agent.kinds import PartitionKind
from agent.model import DeviceNode

log = logging.getLogger(__name__)

STEP_MODE, STEP_GI, STEP_CI, STEP_UUID, DONE = range(5)
_STEP_NAMES = ("mode", "gpu-instance", "compute-instance", "uuid")
_ENABLE: int = pynvml.NVML_DEVICE_MIG_ENABLE
_DISABLE: int = pynvml.NVML_DEVICE_MIG_DISABLE
_GONE = (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT)


class MigFailure(ClaimFailure):
    """A MIG partition cannot be created or removed now (NVML's answer is in the message)."""


class MigModeUnavailable(MigFailure):
    """MIG mode is off and cannot be turned on without a GPU reset (or a change is pending one)."""


class PlacementTaken(MigFailure):
    """The placement overlaps a GPU instance that exists (another claim's, or made outside the agent)."""


@dataclass(frozen=True, slots=True)
class NvmlAccess:
    nvml: Nvml  # the GPU source's
    dev_root: Path
    proc_root: Path
    node_placeholders: bool = False  # where mknod is refused, an empty file stands in for a node (the source's)
    gate: NvmlGate | None = None  # the GPU source's: NVML is used through it (agent.inventory.nvmlgate)


def nvml_of(inventory: Inventory) -> Callable[[], NvmlAccess | None]:
    """The GPU source's NVML as it is when asked (None: no GPU source, or NVML not open)."""
    def access() -> NvmlAccess | None:
        for source in inventory.sources:
            if isinstance(source, GpuSource) and source.nvml is not None:
                return NvmlAccess(source.nvml, source.dev_root, source.proc_root, source.node_placeholders,
                                  source.gate)
        return None
    return access


class MigPartitioner:
    """`agent.hostprep.partitions.Partitioner` for MIG devices. Blocking: call with the parent GPU's lock."""

    kind = PartitionKind.MIG

    def __init__(self, access: Callable[[], NvmlAccess | None], boot_id: Callable[[], str],
                 marks: MigModeMarks) -> None:
        self._access = access
        self._boot_id = boot_id
        self._marks = marks  # GPUs the agent put into MIG mode (turned off by whichever claim goes last)

    # -- prepare ---------------------------------------------------------------------------------

    def plan(self, uid: str, allocated: AllocatedDevice) -> DevicePartition:
        with self._using():
            return self._plan(uid, allocated)

    def _plan(self, uid: str, allocated: AllocatedDevice) -> DevicePartition:
        dev = allocated.device
        if not isinstance(dev.node, GpuFacts) or not isinstance(where := dev.node.target, MigPlacement):
            raise MigFailure(f"device {dev.name} is not a MIG placement this agent published")
        parent = dev.node.gpu.uuid
        nv, handle = self._parent(parent, dev.name)
        profile = self._profile(nv, handle, where.profile, dev.name)
        if where.start not in profile.starts or where.size != profile.size:
            raise MigFailure(f"device {dev.name}: GPU {parent} has no placement {where.start} (size "
                             f"{where.size}) for profile {profile.name} (it offers {list(profile.starts)})")
        current, pending = self._mode(nv, handle, dev.name)
        if current != _ENABLE and pending == _ENABLE:
            raise MigModeUnavailable(f"device {dev.name}: MIG mode of GPU {parent} is pending: it takes "
                                     "effect only after a GPU reset (nvidia-smi -r), which the agent does not do")
        if current == _ENABLE:
            for gi_id, start, size, name in gpu_instances(nv, handle):
                if start < where.start + where.size and where.start < start + size:
                    raise PlacementTaken(
                        f"device {dev.name}: memory slices {where.start}..{where.start + where.size - 1} of GPU "
                        f"{parent} overlap GPU instance {gi_id} ({name} at {start}); retry once it is "
                        "destroyed")
        return DevicePartition(dev.name, PartitionKind.MIG, parent, profile.name, where.start,
                               boot_id=self._boot_id())

    def create(self, part: DevicePartition, write: WritePartition) -> DevicePartition:
        with self._using():
            return self._create(part, write)

    def _create(self, part: DevicePartition, write: WritePartition) -> DevicePartition:
        nv, handle = self._parent(part.parent, part.device)
        profile = self._profile(nv, handle, part.profile, part.device)
        for step in range(part.step, DONE):
            if part.step != step:
                part = dataclasses.replace(part, step=step)
                write(part)
            failpoints.hit(f"mig-before-{_STEP_NAMES[step]}")
            if step == STEP_MODE:
                part = self._enable(nv, handle, part, write)
            elif step == STEP_GI:
                part = dataclasses.replace(part, gpu_instance=self._make_gi(nv, handle, profile, part))
            elif step == STEP_CI:
                part = dataclasses.replace(part, compute_instance=self._make_ci(nv, handle, part))
            else:
                part = dataclasses.replace(part, uuid=self._mig_uuid(nv, handle, part))
            failpoints.hit(f"mig-after-{_STEP_NAMES[step]}")
        return dataclasses.replace(part, step=DONE)

    def _enable(self, nv: Nvml, handle: NvmlHandle, part: DevicePartition, write: WritePartition) -> DevicePartition:
        current, pending = self._mode(nv, handle, part.device)
        if current == _ENABLE:
            return part
        if pending == _ENABLE and not part.mode_changed:
            raise MigModeUnavailable(f"device {part.device}: MIG mode of GPU {part.parent} is pending a GPU reset")
        if not part.mode_changed:
            part = dataclasses.replace(part, mode_changed=True)
            write(part)  # before the mode changes: an unprepare (or a rollback) turns it off again
        self._marks.mark(part.parent)  # and whichever claim leaves the GPU last
        try:
            status = nv.nvmlDeviceSetMigMode(handle, _ENABLE)
        except pynvml.NVMLError as exc:
            raise MigModeUnavailable(f"device {part.device}: MIG mode of GPU {part.parent} cannot be turned on: "
                                     f"{exc}") from exc
        current, pending = self._mode(nv, handle, part.device)
        if status != pynvml.NVML_SUCCESS or current != _ENABLE:
            # Left pending it would take effect at the next reset behind everyone's back: undo the request.
            try:
                nv.nvmlDeviceSetMigMode(handle, _DISABLE)
            except pynvml.NVMLError as exc:
                log.warning("GPU %s: could not withdraw the pending MIG mode change: %s", part.parent, exc)
            raise MigModeUnavailable(f"device {part.device}: turning MIG mode on for GPU {part.parent} needs a GPU "
                                     f"reset (activation status {status}), which the agent does not do; enable MIG "
                                     "on this GPU beforehand (nvidia-smi -i <gpu> -mig 1)")
        return part

    def _make_gi(self, nv: Nvml, handle: NvmlHandle, profile: migs.MigProfile, part: DevicePartition) -> int:
        found = gi_at(nv, handle, profile.id, part.start)
        if found is not None:
            return found  # made before a crash: adopted
        placement = pynvml.c_nvmlGpuInstancePlacement_t(part.start, profile.size)
        try:
            gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile.id, ctypes.byref(placement))
            return int(nv.nvmlGpuInstanceGetInfo(gi).id)
        except pynvml.NVMLError as exc:
            cls = PlacementTaken if exc.value == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES else MigFailure
            raise cls(f"device {part.device}: NVML did not create GPU instance {part.profile} at {part.start} on "
                      f"GPU {part.parent}: {exc}") from exc

    def _make_ci(self, nv: Nvml, handle: NvmlHandle, part: DevicePartition) -> int:
        gi = self._gi_by_id(nv, handle, part)
        if gi is None:
            raise MigFailure(f"device {part.device}: GPU instance {part.gpu_instance} of GPU {part.parent} is gone")
        existing = ci_ids(nv, gi)
        if existing:
            return existing[0]  # made before a crash: adopted
        for ci_profile in CI_PROFILES:
            try:
                info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, ci_profile, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            except pynvml.NVMLError:
                continue  # not offered by this GPU instance
            try:
                ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, int(info.id))
                return int(nv.nvmlComputeInstanceGetInfo(ci).id)
            except pynvml.NVMLError as exc:
                raise MigFailure(f"device {part.device}: NVML did not create the compute instance of GPU instance "
                                 f"{part.gpu_instance}: {exc}") from exc
        raise MigFailure(f"device {part.device}: GPU instance {part.gpu_instance} offers no compute instance profile")

    def _mig_uuid(self, nv: Nvml, handle: NvmlHandle, part: DevicePartition) -> str:
        try:
            for i in range(int(nv.nvmlDeviceGetMaxMigDeviceCount(handle))):
                try:
                    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
                except pynvml.NVMLError as exc:
                    if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
                        continue
                    raise
                if (int(nv.nvmlDeviceGetGpuInstanceId(mig)), int(nv.nvmlDeviceGetComputeInstanceId(mig))) == \
                        (part.gpu_instance, part.compute_instance):
                    return str(nv.nvmlDeviceGetUUID(mig))
        except pynvml.NVMLError as exc:
            raise MigFailure(f"device {part.device}: the MIG device of GPU instance {part.gpu_instance} is not "
                             f"readable: {exc}") from exc
        raise MigFailure(f"device {part.device}: NVML lists no MIG device for GPU instance {part.gpu_instance}, "
                         f"compute instance {part.compute_instance}")

    # -- unprepare and recovery --------------------------------------------------------------------

    def destroy(self, part: DevicePartition, write: WritePartition | None) -> None:
        with self._using():
            self._destroy(part, write)

    def _destroy(self, part: DevicePartition, write: WritePartition | None) -> None:
        found = self._parent_or_none(part)
        if found is None:
            return  # the GPU left NVML (a reset, a rebind to vfio-pci): its instances went with it
        nv, handle = found
        gi = self._owned_gi(nv, handle, part)
        if gi is not None:
            try:
                for ci in ci_handles(nv, gi):
                    nv.nvmlComputeInstanceDestroy(ci)
                failpoints.hit("mig-destroy-after-ci")
                nv.nvmlGpuInstanceDestroy(gi)
            except pynvml.NVMLError as exc:
                raise MigFailure(f"device {part.device}: GPU instance {part.gpu_instance} of GPU {part.parent} cannot "
                                 f"be destroyed now: {exc} (retried at the next operation or start)") from exc
            failpoints.hit("mig-destroy-after-gi")
        part = dataclasses.replace(part, step=STEP_MODE, gpu_instance=-1, compute_instance=-1, uuid="")
        if write is not None and gi is not None:
            write(part)  # so a later pass never takes another claim's GPU instance with a reused id for ours
        if (part.mode_changed or self._marks.marked(part.parent)) and not gpu_instances(nv, handle):
            try:
                if self._mode(nv, handle, part.device)[0] == _ENABLE:
                    nv.nvmlDeviceSetMigMode(handle, _DISABLE)
            except pynvml.NVMLError as exc:
                log.warning("GPU %s: MIG mode stays on (%s)", part.parent, exc)
            else:
                self._marks.clear(part.parent)

    def exists(self, part: DevicePartition) -> bool:
        with self._using():
            return self._exists(part)

    def _exists(self, part: DevicePartition) -> bool:
        if part.step != DONE:
            return False  # made again after a reboot and stopped halfway: made again, adopting what is there
        found = self._parent_or_none(part)
        if found is None:
            return False
        nv, handle = found
        gi = self._gi_by_id(nv, handle, part)
        return gi is not None and part.compute_instance in ci_ids(nv, gi)

    def remake(self, part: DevicePartition) -> DevicePartition:
        """From step 0 at the recorded placement: new GPU and compute instances, and so a new MIG UUID."""
        return dataclasses.replace(part, step=STEP_MODE, gpu_instance=-1, compute_instance=-1, uuid="",
                                   boot_id=self._boot_id())

    def device(self, part: DevicePartition, allocated: AllocatedDevice) -> AllocatedDevice:
        with self._using():
            return self._device(part, allocated)

    def _device(self, part: DevicePartition, allocated: AllocatedDevice) -> AllocatedDevice:
        access = self._nvml(part.device)
        nv, handle = self._parent(part.parent, part.device)
        minor = int(nv.nvmlDeviceGetMinorNumber(handle))
        where = caps_dir(access.proc_root, minor) / f"gi{part.gpu_instance}"
        nodes = [DeviceNode(f"/dev/nvidia{minor}", str(access.dev_root / f"nvidia{minor}"))]
        nodes += [DeviceNode(f"/dev/{name}", str(access.dev_root / name)) for name in SHARED_NODES]
        for cap in (where / "access", where / f"ci{part.compute_instance}" / "access"):
            try:
                host = ensure_node(access.dev_root, access.proc_root, cap, placeholder=access.node_placeholders)
            except CapError as exc:
                raise MigFailure(f"device {part.device}: {exc}") from exc
            nodes.append(DeviceNode(f"/dev/nvidia-caps/{host.name}", str(host)))
        return dataclasses.replace(allocated, device=dataclasses.replace(allocated.device, device_nodes=tuple(nodes)),
                                   made=part)

    # -- NVML ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """NVML for one operation, through the GPU source's gate (never while a GPU changes drivers)."""
        access = self._access()
        if access is None or access.gate is None:
            yield
            return
        with access.gate.use():
            yield

    def _nvml(self, device: str) -> NvmlAccess:
        access = self._access()
        if access is None:
            raise MigFailure(f"device {device}: NVML is not open on this node")
        return access

    def _parent(self, uuid: str, device: str) -> tuple[Nvml, NvmlHandle]:
        nv = self._nvml(device).nvml
        try:
            return nv, nv.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError as exc:
            raise MigFailure(f"device {device}: GPU {uuid} is not available in NVML: {exc}") from exc

    def _parent_or_none(self, part: DevicePartition) -> tuple[Nvml, NvmlHandle] | None:
        nv = self._nvml(part.device).nvml
        try:
            return nv, nv.nvmlDeviceGetHandleByUUID(part.parent)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
                return None
            raise MigFailure(f"device {part.device}: GPU {part.parent} does not answer NVML: {exc}") from exc

    @staticmethod
    def _profile(nv: Nvml, handle: NvmlHandle, name: str, device: str) -> migs.MigProfile:
        try:
            profile = migs.find_profile(nv, handle, name)
        except (migs.MigReadError, pynvml.NVMLError) as exc:
            raise MigFailure(f"device {device}: MIG profiles not readable: {exc}") from exc
        if profile is None:
            raise MigFailure(f"device {device}: the GPU does not offer MIG profile {name}")
        return profile

    @staticmethod
    def _mode(nv: Nvml, handle: NvmlHandle, device: str) -> tuple[int, int]:
        try:
            current, pending = nv.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError as exc:
            raise MigModeUnavailable(f"device {device}: the GPU has no MIG mode: {exc}") from exc
        return int(current), int(pending)

    def _gi_by_id(self, nv: Nvml, handle: NvmlHandle, part: DevicePartition) -> NvmlHandle | None:
        """The partition's GPU instance when it is there with its profile and placement, else None."""
        if part.gpu_instance < 0:
            return None
        try:
            gi = nv.nvmlDeviceGetGpuInstanceById(handle, part.gpu_instance)
            info = nv.nvmlGpuInstanceGetInfo(gi)
        except pynvml.NVMLError as exc:
            if exc.value in _GONE:
                return None
            raise MigFailure(f"device {part.device}: GPU instance {part.gpu_instance} not readable: {exc}") from exc
        profile = self._profile(nv, handle, part.profile, part.device)
        return gi if (int(info.profileId), int(info.placement.start)) == (profile.id, part.start) else None

    def _owned_gi(self, nv: Nvml, handle: NvmlHandle, part: DevicePartition) -> NvmlHandle | None:
        """The GPU instance the partition made, at whatever step it stopped."""
        if part.gpu_instance >= 0:
            return self._gi_by_id(nv, handle, part)
        if part.step != STEP_GI:
            return None  # step 0: none made yet
        profile = self._profile(nv, handle, part.profile, part.device)
        found = gi_at(nv, handle, profile.id, part.start)  # made, its id not yet recorded
        return None if found is None else nv.nvmlDeviceGetGpuInstanceById(handle, found)

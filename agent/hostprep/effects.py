"""The engine's side of claims with host side effects: PCI functions bound to vfio-pci
(`agent.hostprep.vfio`) and GPU partitions created for the claim (`agent.hostprep.partitions`: MIG in
`agent.hostprep.mig`, vGPU mediated devices in `agent.hostprep.vgpu`).

The same discipline for both: an intent record (state `binding`) before the first effect, each step
recorded before it happens, and then the claim's files and its final record. Unprepare writes a
`restoring` record first, removes the files, undoes the effects (partitions first, then bindings:
a partition may live on a function the claim bound), then removes the record. A failure or a crash
anywhere leaves a record that the next operation on the claim, or the next start, settles: `binding`
rolled back, `restoring` finished.

The partitioners are kept by the partition kind they make; a device's kind says which it needs
(`Kind.partition_kind`): adding a partition kind is one partitioner in the list the engine builds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence

from agent import failpoints
from agent.claims.allocation import Allocation
from agent.claims.book import ClaimBook
from agent.claims.files import ClaimFiles
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import (
    ClaimRecord,
    DeviceBinding,
    DevicePartition,
    PreparedDevice,
    RecordState,
)
from agent.errors import ClaimFailure
from agent.hostprep.partitions import GpuForms, Partitioner, check_gpu_forms, gpu_lock_key
from agent.hostprep.vfio import Passthrough, lock_key
from agent.inventory import Inventory
from agent.kinds import PartitionKind
from agent.model import Device

log = logging.getLogger(__name__)

WriteRecord = Callable[[ClaimRecord], None]
PlanRecord = Callable[[Allocation, list[DeviceBinding]], ClaimRecord]


class PartitionUnknown(ClaimFailure):
    """A record names a partition kind this agent has no partitioner for (written by a newer agent), or a
    device needs one."""


class HostEffects:
    """Bindings and partitions of claims. Blocking: call from the claim's worker thread, with its locks."""

    def __init__(self, book: ClaimBook, passthrough: Passthrough, inventory: Inventory,
                 partitioners: Iterable[Partitioner]) -> None:
        self.book = book
        self.passthrough = passthrough
        self.inventory = inventory
        self.by_kind: dict[PartitionKind, Partitioner] = {p.kind: p for p in partitioners}
        self.forms = GpuForms(inventory)

    # -- locks and checks ---------------------------------------------------------------------------

    @staticmethod
    def lock_key(device: Device) -> str:
        """A partition by its GPU (`pci/<bus>`, as the GPU's whole forms), any other device as before."""
        return gpu_lock_key(device) or lock_key(device)

    def record_lock_keys(self, record: ClaimRecord) -> list[str]:
        keys = set(self.passthrough.record_lock_keys(record))
        for part in record.partitions:
            device = self.inventory.get(part.device)
            if device is not None and (key := gpu_lock_key(device)) is not None:
                keys.add(key)
        return sorted(keys)

    def check(self, uid: str, allocated: Sequence[AllocatedDevice]) -> None:
        self.passthrough.check_forms(uid, allocated)
        check_gpu_forms(uid, allocated, self.forms, self.book)

    def plan(self, alloc: Allocation) -> list[DevicePartition]:
        """A partition per partition device of the claim, checked, nothing created."""
        out: list[DevicePartition] = []
        seen: set[str] = set()
        for a in alloc.devices:
            kind = a.device.kind.partition_kind
            if kind is not None and a.device.name not in seen:
                seen.add(a.device.name)
                out.append(self._partitioner_of(kind, a.device.name).plan(alloc.ref.uid, a))
        return out

    # -- prepare ------------------------------------------------------------------------------------

    def make(self, alloc: Allocation, bindings: list[DeviceBinding], parts: list[DevicePartition],
             plan: PlanRecord, files: ClaimFiles) -> ClaimRecord:
        """The intent record, then every binding and partition, each step recorded first; returns the
        claim's final record (not yet written: its files go first). On failure everything is undone."""
        ref = alloc.ref
        latest = ClaimRecord(uid=ref.uid, namespace=ref.namespace, name=ref.name,
                             pod_claim_name=alloc.pod_claim_name,
                             devices=[PreparedDevice(a.request, a.pool, a.device.name, ()) for a in alloc.devices],
                             state=RecordState.BINDING, bindings=bindings, partitions=parts)
        self.book.write(latest)
        failpoints.hit("after-bind-intent")

        def write(record: ClaimRecord) -> None:
            nonlocal latest
            self.book.write(record)
            latest = record

        try:
            devices = list(alloc.devices)
            if bindings:
                latest = self.passthrough.bind(latest, write)
                devices = self.passthrough.bound_devices(devices, latest.bindings)
            if parts:
                latest = self._create(latest, write)
                devices = self._devices(devices, latest.partitions)
            record = plan(dataclasses.replace(alloc, devices=devices), latest.bindings)
            return dataclasses.replace(record, partitions=latest.partitions)
        except BaseException:
            self.roll_back(latest, files)
            raise

    def _create(self, record: ClaimRecord, write: WriteRecord) -> ClaimRecord:
        for i, part in enumerate(record.partitions):
            def write_part(p: DevicePartition, i: int = i, base: ClaimRecord = record) -> None:
                write(_with_partition(base, i, p))
            done = self._partitioner(part).create(part, write_part)
            record = _with_partition(record, i, done)
        return record

    def _devices(self, allocated: Iterable[AllocatedDevice], parts: Sequence[DevicePartition]) -> list[AllocatedDevice]:
        by_name = {p.device: p for p in parts}
        return [self._partitioner(by_name[a.device.name]).device(by_name[a.device.name], a)
                if a.device.name in by_name else a for a in allocated]

    def roll_back(self, record: ClaimRecord, files: ClaimFiles) -> None:
        """A prepare with side effects failed: undo them, then drop the record (its files are removed
        here). When they cannot be undone now, the `binding` record stays for the next operation or start."""
        record = dataclasses.replace(record, state=RecordState.BINDING, files=[], dirs=[])
        try:
            self.book.write(record)  # the disk says `binding` (not `prepared`) while this runs
            files.remove_claim_files(record.uid)
            self._destroy(record, None)
            self.passthrough.restore(record, None)
        except (ClaimFailure, OSError) as exc:
            log.error("claim %s/%s: could not undo its host changes after a failed prepare (%s); its record stays "
                      "in state binding, to be rolled back by the next operation or start",
                      record.namespace, record.name, exc)
            return
        with contextlib.suppress(OSError):
            self.book.store.delete(record.uid)
        self.book.forget(record.uid)

    # -- unprepare, settle, recovery ------------------------------------------------------------------

    def unprepare(self, record: ClaimRecord, files: ClaimFiles) -> None:
        """The restore intent first (no files: from here on they are orphans the next start removes), then
        the files, the partitions destroyed and the functions put back, each recorded; the record last."""
        if not record.partitions:
            self.passthrough.unprepare_bound(record, files)
            return
        restoring = dataclasses.replace(record, state=RecordState.RESTORING, files=[], dirs=[],
                                        bindings=[dataclasses.replace(b, step=0) for b in record.bindings])
        self.book.write(restoring)
        failpoints.hit("unprepare-after-restore-intent")
        files.remove_files(record)
        restoring = self._destroy(restoring, self.book.write)
        self.passthrough.restore(restoring, self.book.write)
        self.book.store.delete(record.uid)
        self.book.forget(record.uid)
        failpoints.hit("unprepare-after-record")

    def settle(self, record: ClaimRecord, files: ClaimFiles) -> None:
        """Finish an operation that stopped halfway: `binding` rolled back, `restoring` finished; the
        claim's files and record go. Raises (record kept) when that cannot be done now."""
        if not record.partitions:
            self.passthrough.settle(record, files)
            return
        files.remove_claim_files(record.uid)
        write = None if record.state is RecordState.BINDING else self.book.write
        record = self._destroy(record, write)
        self.passthrough.restore(record, write)
        self.book.store.delete(record.uid)
        self.book.forget(record.uid)
        log.info("claim %s/%s: an interrupted %s settled: its partitions are destroyed and its functions back on "
                 "their drivers", record.namespace, record.name, "prepare" if write is None else "unprepare")

    def missing(self, record: ClaimRecord) -> list[str]:
        """The partitions of a prepared record that are not on the host any more (after a reboot: all)."""
        return [p.device for p in record.partitions if not self._partitioner(p).exists(p)]

    def _destroy(self, record: ClaimRecord, write: WriteRecord | None) -> ClaimRecord:
        """Every partition destroyed, last made first; with `write`, each one's progress recorded."""
        for i in reversed(range(len(record.partitions))):
            part = record.partitions[i]
            write_part = None
            if write is not None:
                def write_part(p: DevicePartition, i: int = i) -> None:
                    nonlocal record
                    record = _with_partition(record, i, p)
                    write(record)
            self._partitioner(part).destroy(part, write_part)
        return record

    def _partitioner(self, part: DevicePartition) -> Partitioner:
        return self._partitioner_of(part.kind, part.device)

    def _partitioner_of(self, kind: PartitionKind, device: str) -> Partitioner:
        found = self.by_kind.get(kind)
        if found is None:
            raise PartitionUnknown(f"device {device}: this agent cannot handle {kind} partitions")
        return found


def _with_partition(record: ClaimRecord, i: int, part: DevicePartition) -> ClaimRecord:
    parts = list(record.partitions)
    parts[i] = part
    return dataclasses.replace(record, partitions=parts)

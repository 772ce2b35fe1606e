"""The engine's side of claims with host side effects (`agent.hostprep.hosteffect`): PCI functions bound
to vfio-pci (`agent.hostprep.vfio`) and GPU partitions created for the claim (`agent.hostprep.partitions`:
MIG in `agent.hostprep.mig`, vGPU mediated devices in `agent.hostprep.vgpu`).

One discipline for every kind, each run here once: an intent record (state `binding`) before the first
effect, each step recorded before it happens, and then the claim's files and its final record. The
kinds are applied in the order `HostEffects.kinds` holds them (bindings, then partitions: a partition
may live on a function the claim bound) and undone in the reverse. Unprepare writes a `restoring`
record first, removes the files, undoes the effects, then removes the record. A failure or a crash
anywhere leaves a record that the next operation on the claim, or the next start, settles: `binding`
rolled back, `restoring` finished.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from agent import failpoints
from agent.claims.allocation import Allocation
from agent.claims.book import ClaimBook
from agent.claims.files import ClaimFiles
from agent.claims.leftovers import Leftover, Leftovers
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import ClaimRecord, DeviceBinding, DevicePartition, PreparedDevice, RecordState
from agent.errors import ClaimFailure
from agent.hostprep.hosteffect import HostEffect, WriteRecord
from agent.hostprep.mig import nvml_of
from agent.hostprep.partitions import GpuForms, Partitioner, Partitions, check_gpu_forms, gpu_lock_key
from agent.hostprep.vfio import Passthrough, lock_key
from agent.hostprep.wholegpu import check_not_in_mig_mode
from agent.inventory import Inventory
from agent.kinds import PartitionKind
from agent.model import Device

log = logging.getLogger(__name__)

PlanRecord = Callable[[Allocation, list[DeviceBinding]], ClaimRecord]


class UndoPending(ClaimFailure):
    """A device still holds host changes an earlier claim's unprepare could not undo."""


class HostEffects:
    """Bindings and partitions of claims. Blocking: call from the claim's worker thread, with its locks."""

    def __init__(self, book: ClaimBook, passthrough: Passthrough, inventory: Inventory,
                 partitioners: Iterable[Partitioner], leftovers: Leftovers) -> None:
        self.book = book
        self.leftovers = leftovers  # host changes an unprepare could not undo (`agent.claims.leftovers`)
        self.passthrough = passthrough
        self.partitions = Partitions(partitioners)
        self.kinds: tuple[HostEffect, ...] = (passthrough, self.partitions)  # in order of application
        self.inventory = inventory
        self.forms = GpuForms(inventory)

    def held(self, record: ClaimRecord) -> bool:
        """Whether the record holds any host side effect."""
        return any(kind.held(record) for kind in self.kinds)

    # -- locks and checks ---------------------------------------------------------------------------

    @staticmethod
    def lock_key(device: Device) -> str:
        """Every form of a GPU by its GPU (`pci/<bus>`), any other device by its function or name."""
        return gpu_lock_key(device) or lock_key(device)

    def record_lock_keys(self, record: ClaimRecord) -> list[str]:
        """The device locks of a recorded claim, the ones its prepare took: every form of a GPU by its GPU,
        also when the device has left the inventory (a partition by its recorded parent)."""
        keys = set(self.passthrough.record_lock_keys(record))
        for d in record.devices:
            device = self.inventory.get(d.device)
            if device is not None and (key := gpu_lock_key(device)) is not None:
                keys.discard(f"device/{d.device}")
                keys.add(key)
        for part in record.partitions:
            if (bus := self._parent_bus(part)) is not None:
                keys.discard(f"device/{part.device}")
                keys.add(f"pci/{bus}")
        return sorted(keys)

    def _parent_bus(self, part: DevicePartition) -> str | None:
        """The PCI function of a partition's GPU: recorded for a mediated device; a MIG partition records
        its GPU's UUID, found among the inventory's GPUs."""
        if part.kind is PartitionKind.MDEV:
            return part.parent
        for d in self.inventory.devices():
            if (gpu := d.gpu) is not None and gpu.uuid == part.parent:
                return gpu.pci_bus_id
        return None

    def check(self, uid: str, allocated: Sequence[AllocatedDevice]) -> None:
        """The forms checks, against the records on disk (call holding the devices' locks: another agent
        that prepares a form of the same GPU holds the same lock, across processes, until its record is
        written)."""
        if any(a.device.kind.function or a.device.kind.gpu_form is not None for a in allocated):
            self.book.sync()
        self._check_leftovers({self.lock_key(a.device) for a in allocated})
        self.passthrough.check_forms(uid, allocated)
        check_gpu_forms(uid, allocated, self.forms, self.book)
        check_not_in_mig_mode(allocated, nvml_of(self.inventory))

    def _check_leftovers(self, held: set[str]) -> None:
        """UndoPending when an earlier claim left host changes on these devices that cannot be undone yet
        (tried again here, under the devices' locks: after a reset there is mostly nothing left)."""
        for lo in self.leftovers.holding(held):
            if set(lo.locks) <= held and self.retry(lo):
                continue
            raise UndoPending(f"device(s) {', '.join(lo.devices)}: claim {lo.claim} ({lo.uid}) left host changes "
                              f"that could not be undone: {lo.reason}; retry once the hardware is back (a reset, a "
                              f"reboot), or clear it after fixing it by hand: dra-agent taints clear <device>")

    def retry(self, lo: Leftover) -> bool:
        """Undo a leftover's host changes again (call holding its devices' locks); True when they are
        undone (the leftover removed)."""
        try:
            self._undo(lo.record, None)
        except (ClaimFailure, OSError) as exc:
            log.info("claim %s (%s): its host changes on %s still cannot be undone: %s", lo.claim, lo.uid,
                     ", ".join(lo.devices), exc)
            return False
        self.leftovers.remove(lo.uid)
        log.warning("claim %s (%s): its host changes on %s are undone now; the devices' undo-failed taint goes",
                    lo.claim, lo.uid, ", ".join(lo.devices))
        return True

    # -- prepare ------------------------------------------------------------------------------------

    def intent(self, alloc: Allocation) -> ClaimRecord | None:
        """The intent record (state `binding`) of the claim's host side effects, every one checked and at
        step 0, nothing written or changed; None when the claim needs none."""
        ref = alloc.ref
        intent = ClaimRecord(uid=ref.uid, namespace=ref.namespace, name=ref.name,
                             pod_claim_name=alloc.pod_claim_name,
                             devices=[PreparedDevice(a.request, a.pool, a.device.name, ()) for a in alloc.devices],
                             state=RecordState.BINDING)
        for kind in self.kinds:
            intent = kind.planned(alloc, intent)
        return intent if self.held(intent) else None

    def make(self, alloc: Allocation, intent: ClaimRecord, plan: PlanRecord, files: ClaimFiles) -> ClaimRecord:
        """The intent record, then every kind's effects, each step recorded first; returns the claim's final
        record (not yet written: its files go first). On failure everything is undone."""
        latest = intent
        self.book.write(latest)
        failpoints.hit("after-bind-intent")

        def write(record: ClaimRecord) -> None:
            nonlocal latest
            self.book.write(record)
            latest = record

        try:
            devices = list(alloc.devices)
            for kind in self.kinds:
                if kind.held(latest):
                    latest = kind.apply(latest, write)
                    devices = kind.devices(devices, latest)
            record = plan(dataclasses.replace(alloc, devices=devices), latest.bindings)
            return dataclasses.replace(record, partitions=latest.partitions)
        except BaseException:
            self.roll_back(latest, files)
            raise

    def roll_back(self, record: ClaimRecord, files: ClaimFiles) -> None:
        """A prepare with side effects failed: undo them, then drop the record (its files are removed
        here). When they cannot be undone now, the `binding` record stays for the next operation or start."""
        record = dataclasses.replace(record, state=RecordState.BINDING, files=[], dirs=[])
        try:
            self.book.write(record)  # the disk says `binding` (not `prepared`) while this runs
            files.remove_claim_files(record.uid)
            self._undo(record, None)
        except (ClaimFailure, OSError) as exc:
            log.error("claim %s/%s: could not undo its host changes after a failed prepare (%s); its record stays "
                      "in state binding, to be rolled back by the next operation or start",
                      record.namespace, record.name, exc)
            return
        self.book.delete(record.uid, best_effort=True)

    # -- unprepare, settle, recovery ------------------------------------------------------------------

    def unprepare_with_effects(self, record: ClaimRecord, files: ClaimFiles) -> None:
        """The restore intent first (no files: from here on they are orphans the next start removes), then
        the files, then every effect undone, each step recorded first; the record last. Effects that cannot
        be undone (the hardware is gone or refuses) are kept as a leftover, and the unprepare ends all the
        same: the kubelet would retry it forever, its pods Terminating."""
        restoring = dataclasses.replace(record, state=RecordState.RESTORING, files=[], dirs=[])
        for kind in self.kinds:
            restoring = kind.undo_intent(restoring)
        self.book.write(restoring)
        failpoints.hit("unprepare-after-restore-intent")
        files.remove_files(record)
        self._undo_or_leave(restoring, self.book.write)
        self.book.delete(record.uid)
        failpoints.hit("unprepare-after-record")

    def settle(self, record: ClaimRecord, files: ClaimFiles) -> None:
        """Finish an operation that stopped halfway: `binding` rolled back, `restoring` finished; the
        claim's files and record go, what cannot be undone kept as a leftover. Raises (record kept) only
        when the claim's files cannot be removed."""
        files.remove_claim_files(record.uid)
        write = None if record.state is RecordState.BINDING else self.book.write
        undone = " and ".join(kind.name for kind in self.kinds if kind.held(record)) or "nothing"
        self._undo_or_leave(record, write)
        self.book.delete(record.uid)
        log.info("claim %s/%s: an interrupted %s settled: its host side effects are undone (%s)", record.namespace,
                 record.name, "prepare" if write is None else "unprepare", undone)

    def _undo_or_leave(self, record: ClaimRecord, write: WriteRecord | None) -> None:
        """Undo the record's effects (`_undo`); when that fails, keep what remains as a leftover (durable,
        before the caller removes the record), log it naming the devices, and return."""
        latest = record

        def tracked(r: ClaimRecord) -> None:
            nonlocal latest
            assert write is not None
            write(r)
            latest = r
        try:
            self._undo(record, tracked if write is not None else None)
        except (ClaimFailure, OSError) as exc:
            self._leave(latest, str(exc))
            return
        self.leftovers.remove(record.uid)  # kept by an earlier attempt that a crash cut short

    def _leave(self, record: ClaimRecord, reason: str) -> None:
        devices = tuple(dict.fromkeys([*(b.device for b in record.bindings), *(p.device for p in record.partitions)]))
        functions = {f.bdf for b in record.bindings for f in b.plan.functions}
        functions |= {bus for p in record.partitions if (bus := self._parent_bus(p)) is not None}
        # The locks of the changed hardware only: the claim's other devices (a NIC next to a MIG device)
        # are as they were, and a prepare of them must not wait for a lost GPU.
        changed = dataclasses.replace(record, devices=[d for d in record.devices if d.device in devices])
        self.leftovers.keep(Leftover(record.uid, record.namespace, record.name, devices, tuple(sorted(functions)),
                                     tuple(self.record_lock_keys(changed)), reason, time.time(),
                                     self.passthrough.host.boot_id(), record))
        failpoints.hit("unprepare-after-leftover")
        log.error("claim %s/%s (%s): its host changes on %s could not be undone: %s; the claim's files and record go "
                  "all the same, the device stays tainted (undo-failed) and is not prepared again until they are "
                  "undone (tried again at start, by garbage collection and by a prepare of the device) or an "
                  "operator clears it (dra-agent taints clear)", record.namespace, record.name, record.uid,
                  ", ".join(devices) or "its devices", reason, extra={"devices": list(devices)})

    def reassert(self, record: ClaimRecord) -> ClaimRecord:
        """A prepared record's effects made true again for this boot (`HostEffect.reassert`), in the order
        of their application (a partition may live on a function the claim bound); raises when they
        cannot be. Every change is recorded before it is made."""
        for kind in self.kinds:
            if kind.held(record):
                record = kind.reassert(record, self.book.write)
        return record

    def devices(self, allocated: Iterable[AllocatedDevice], record: ClaimRecord) -> list[AllocatedDevice]:
        """The allocation with what the record's effects give its devices now (VFIO nodes, a partition's
        UUID and nodes): what the claim's files must say."""
        devices = list(allocated)
        for kind in self.kinds:
            if kind.held(record):
                devices = kind.devices(devices, record)
        return devices

    def _undo(self, record: ClaimRecord, write: WriteRecord | None) -> ClaimRecord:
        """Every kind's effects undone, in the reverse of the order they were applied in."""
        for kind in reversed(self.kinds):
            if kind.held(record):
                record = kind.undo(record, write)
        return record

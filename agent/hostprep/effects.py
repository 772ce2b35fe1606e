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
from collections.abc import Callable, Iterable, Sequence

from agent import failpoints
from agent.claims.allocation import Allocation
from agent.claims.book import ClaimBook
from agent.claims.files import ClaimFiles
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import ClaimRecord, DeviceBinding, PreparedDevice, RecordState
from agent.errors import ClaimFailure
from agent.hostprep.hosteffect import HostEffect, WriteRecord
from agent.hostprep.mig import nvml_of
from agent.hostprep.partitions import GpuForms, Partitioner, Partitions, check_gpu_forms, gpu_lock_key
from agent.hostprep.vfio import Passthrough, lock_key
from agent.hostprep.wholegpu import check_not_in_mig_mode
from agent.inventory import Inventory
from agent.model import Device

log = logging.getLogger(__name__)

PlanRecord = Callable[[Allocation, list[DeviceBinding]], ClaimRecord]


class HostEffects:
    """Bindings and partitions of claims. Blocking: call from the claim's worker thread, with its locks."""

    def __init__(self, book: ClaimBook, passthrough: Passthrough, inventory: Inventory,
                 partitioners: Iterable[Partitioner]) -> None:
        self.book = book
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
        check_not_in_mig_mode(allocated, nvml_of(self.inventory))

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
        the files, then every effect undone, each step recorded first; the record last."""
        restoring = dataclasses.replace(record, state=RecordState.RESTORING, files=[], dirs=[])
        for kind in self.kinds:
            restoring = kind.undo_intent(restoring)
        self.book.write(restoring)
        failpoints.hit("unprepare-after-restore-intent")
        files.remove_files(record)
        self._undo(restoring, self.book.write)
        self.book.delete(record.uid)
        failpoints.hit("unprepare-after-record")

    def settle(self, record: ClaimRecord, files: ClaimFiles) -> None:
        """Finish an operation that stopped halfway: `binding` rolled back, `restoring` finished; the
        claim's files and record go. Raises (record kept) when that cannot be done now."""
        files.remove_claim_files(record.uid)
        write = None if record.state is RecordState.BINDING else self.book.write
        undone = " and ".join(kind.name for kind in self.kinds if kind.held(record)) or "nothing"
        self._undo(record, write)
        self.book.delete(record.uid)
        log.info("claim %s/%s: an interrupted %s settled: its host side effects are undone (%s)", record.namespace,
                 record.name, "prepare" if write is None else "unprepare", undone)

    def reassert(self, record: ClaimRecord) -> ClaimRecord:
        """A prepared record's effects made true again (`HostEffect.reassert`); raises when they cannot be.
        The last kind applied goes first: a partition that is gone cannot be made again, and is found so
        before any function is bound again."""
        for kind in reversed(self.kinds):
            if kind.held(record):
                record = kind.reassert(record, self.book.write)
        return record

    def _undo(self, record: ClaimRecord, write: WriteRecord | None) -> ClaimRecord:
        """Every kind's effects undone, in the reverse of the order they were applied in."""
        for kind in reversed(self.kinds):
            if kind.held(record):
                record = kind.undo(record, write)
        return record

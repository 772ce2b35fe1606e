"""GPU partitions created on the host at prepare (MIG instances, vGPU mediated devices): the
interface each kind's module implements, the `HostEffect` of a record's partitions (`Partitions`),
and the checks every kind shares.

A partition is a side effect outside the agent's files, like a passthrough binding, and follows the
same discipline (`agent.hostprep.vfio`): the record (`agent.claims.records.DevicePartition`, format version 3)
says what is about to happen before it happens, each step is idempotent and judged against what
the host shows now, and `destroy` converges from any prefix of `create`, so recovery can roll back
a prepare that stopped anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from agent.claims.allocation import Allocation
from agent.claims.book import ClaimBook
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import ClaimRecord, DevicePartition
from agent.errors import ClaimFailure
from agent.hostprep.hosteffect import WriteRecord
from agent.inventory import Inventory
from agent.kinds import GpuForm, PartitionKind
from agent.model import Device

WritePartition = Callable[[DevicePartition], None]


class Partitioner(Protocol):
    """One kind of partition (agent/hostprep/mig.py: MIG; agent/hostprep/vgpu.py: mediated devices). Blocking:
    called from the claim's worker thread, holding the claim's and its parent GPU's locks."""

    kind: PartitionKind

    def plan(self, uid: str, allocated: AllocatedDevice) -> DevicePartition:
        """Every check, no side effect (profile offered, placement free, parent not passed through,
        ...): the partition at step 0. Raises a ClaimFailure subclass naming the cause."""
        ...

    def create(self, part: DevicePartition, write: WritePartition) -> DevicePartition:
        """Apply the steps from `part.step` on: `write(part with step=k)` BEFORE step k; each step
        idempotent (judged against what the host shows now). Returns the finished partition (ids,
        uuid), not yet written."""
        ...

    def destroy(self, part: DevicePartition, write: WritePartition | None) -> None:
        """Remove what any prefix of `create` made (a crash at any step), idempotent. With `write`,
        progress is recorded as it goes; without, the caller's record stays until it returns."""
        ...

    def exists(self, part: DevicePartition) -> bool:
        """Recovery: is the finished partition still on the host? (After a reboot: no.)"""
        ...

    def device(self, part: DevicePartition, allocated: AllocatedDevice) -> AllocatedDevice:
        """The allocated device as the container or VM gets it: the partition (`made`: its UUID) and its
        device nodes (MIG: the GPU's and the /dev/nvidia-caps nodes; mdev: its VFIO group), so
        `agent.claims.plan` writes the CDI spec and metadata from it."""
        ...


class PartitionUnknown(ClaimFailure):
    """A record names a partition kind this agent has no partitioner for (written by a newer agent), or a
    device needs one."""


class PartitionGone(ClaimFailure):
    """A prepared claim's partition is not on the host (a reboot): the claim cannot stay prepared."""


class Partitions:
    """The `HostEffect` of a record's `partitions`: each one made and destroyed by the partitioner of its
    kind. The partitioners are kept by the partition kind they make; a device's kind says which it needs
    (`Kind.partition_kind`): adding a partition kind is one partitioner in the list the engine builds."""

    name = "GPU partitions"

    def __init__(self, partitioners: Iterable[Partitioner]) -> None:
        self.by_kind: dict[PartitionKind, Partitioner] = {p.kind: p for p in partitioners}

    def held(self, record: ClaimRecord) -> bool:
        return bool(record.partitions)

    def planned(self, alloc: Allocation, intent: ClaimRecord) -> ClaimRecord:
        """A partition per partition device of the claim, checked, nothing created."""
        out: list[DevicePartition] = []
        seen: set[str] = set()
        for a in alloc.devices:
            kind = a.device.kind.partition_kind
            if kind is not None and a.device.name not in seen:
                seen.add(a.device.name)
                out.append(self._partitioner_of(kind, a.device.name).plan(alloc.ref.uid, a))
        return dataclasses.replace(intent, partitions=out)

    def apply(self, record: ClaimRecord, write: WriteRecord) -> ClaimRecord:
        for i, part in enumerate(record.partitions):
            def write_part(p: DevicePartition, i: int = i, base: ClaimRecord = record) -> None:
                write(_with_partition(base, i, p))
            done = self._partitioner(part).create(part, write_part)
            record = _with_partition(record, i, done)
        return record

    def devices(self, allocated: Iterable[AllocatedDevice], record: ClaimRecord) -> list[AllocatedDevice]:
        by_name = {p.device: p for p in record.partitions}
        return [self._partitioner(by_name[a.device.name]).device(by_name[a.device.name], a)
                if a.device.name in by_name else a for a in allocated]

    def undo_intent(self, record: ClaimRecord) -> ClaimRecord:
        """As they are: each partitioner's `destroy` starts from what the host shows."""
        return record

    def undo(self, record: ClaimRecord, write: WriteRecord | None) -> ClaimRecord:
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

    def reassert(self, record: ClaimRecord, write: WriteRecord) -> ClaimRecord:
        """PartitionGone when a partition is not on the host any more (after a reboot: all): one made again
        would have another UUID than the claim's files name."""
        if missing := [p.device for p in record.partitions if not self._partitioner(p).exists(p)]:
            raise PartitionGone(f"partition(s) {', '.join(missing)} are not on the host any more")
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


# -- the checks every kind shares ----------------------------------------------------------------------


class GpuFormConflict(ClaimFailure):
    """Two forms of one GPU that cannot coexist (a MIG partition and its full GPU, passthrough variant or
    a vGPU of it) are asked for together or one is prepared: the scheduler's counters or compatibility
    groups would have kept them apart, but those may be off."""


def gpu_form(device: Device) -> tuple[str, GpuForm] | None:
    """(the GPU's PCI bus ID, the form the device takes it in), or None for a device of no GPU."""
    form, bus = device.kind.gpu_form, device.gpu_function
    return (bus, form) if form is not None and bus else None


def gpu_lock_key(device: Device) -> str | None:
    """One lock per GPU for its partitions (`pci/<bus>`, the key its whole forms take), so a MIG mode change
    and another claim's instance on the same GPU, or a partition and the full GPU, never run at once."""
    found = gpu_form(device) if device.kind.partition_kind is not None else None
    return f"pci/{found[0]}" if found else None


class GpuForms:
    """The forms of each GPU on the node by bus ID, from the inventory, rebuilt when it changes."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self._version = -1
        self._by_bus: dict[str, dict[str, GpuForm]] = {}

    def on_bus(self, bus: str) -> dict[str, GpuForm]:
        """Device name -> form, of every device of the GPU at `bus`."""
        if self._version != self.inventory.version:
            by_bus: dict[str, dict[str, GpuForm]] = {}
            for d in self.inventory.devices():
                if (found := gpu_form(d)) is not None:
                    by_bus.setdefault(found[0], {})[d.name] = found[1]
            self._by_bus, self._version = by_bus, self.inventory.version
        return self._by_bus.get(bus, {})


def check_gpu_forms(uid: str, allocated: Sequence[AllocatedDevice], forms_of: GpuForms, book: ClaimBook) -> None:
    """GpuFormConflict when the claim asks for clashing forms of one GPU, or another claim holds a form that
    clashes with one the claim asks for."""
    wanted: dict[str, dict[str, GpuForm]] = {}  # bus -> device name -> form
    for a in allocated:
        if (found := gpu_form(a.device)) is not None:
            wanted.setdefault(found[0], {})[a.device.name] = found[1]
    for bus, forms in wanted.items():
        for (first, fa), (second, fb) in ((x, y) for x in forms.items() for y in forms.items()):
            if fa.clashes(fb):
                raise GpuFormConflict(f"devices {first} ({fa}) and {second} ({fb}) are forms of GPU {bus} that "
                                      "cannot be used together: a claim can have only one")
        on_bus = forms_of.on_bus(bus)
        for name, form in forms.items():
            clashing = {n for n, f in on_bus.items() if form.clashes(f)}
            for other in book.claims_holding(clashing, exclusive=True):
                if other == uid:
                    continue
                summary = book.record_of(other)
                held = sorted(d.device for d in summary.devices if d.device in clashing) if summary else []
                who = f"claim {summary.namespace}/{summary.name} ({other})" if summary else f"claim {other}"
                raise GpuFormConflict(f"device {name} ({form}): GPU {bus} is prepared as {', '.join(held) or '?'} "
                                      f"for {who}, a form it cannot share the GPU with (retry once that claim is "
                                      "unprepared)")

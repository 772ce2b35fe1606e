"""GPU partitions created on the host at prepare (MIG instances, vGPU mediated devices): the
interface each kind's module implements, and the checks every kind shares.

A partition is a side effect outside the agent's files, like a passthrough binding, and follows the
same discipline (`agent.hostprep.vfio`): the record (`agent.claims.records.DevicePartition`, format version 3)
says what is about to happen before it happens, each step is idempotent and judged against what
the host shows now, and `destroy` converges from any prefix of `create`, so recovery can roll back
a prepare that stopped anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from agent.claims.book import ClaimBook
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import DevicePartition
from agent.errors import ClaimFailure
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
            for other in book.claims_holding(clashing):
                if other == uid:
                    continue
                summary = book.record_of(other)
                held = sorted(d.device for d in summary.devices if d.device in clashing) if summary else []
                who = f"claim {summary.namespace}/{summary.name} ({other})" if summary else f"claim {other}"
                raise GpuFormConflict(f"device {name} ({form}): GPU {bus} is prepared as {', '.join(held) or '?'} "
                                      f"for {who}, a form it cannot share the GPU with (retry once that claim is "
                                      "unprepared)")

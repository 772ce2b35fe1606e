"""One kind of host side effect a claim's record holds, and what the engine does with every kind.

Two kinds implement it: PCI functions bound to vfio-pci (`agent.hostprep.vfio.Passthrough`, the record's
`bindings`) and GPU partitions made for the claim (`agent.hostprep.partitions.Partitions`, its
`partitions`: MIG instances, vGPU mediated devices). `agent.hostprep.effects.HostEffects` runs them in one
order: planned and applied in the order it holds them, undone in the reverse.

The record is the truth throughout: an operation that changes the host writes the record saying so
(`write`) before the change, and every step is idempotent and judged against what the host shows now,
so a crash anywhere leaves a record from which the rest of the operation, or its undoing, converges.
Blocking: call from the claim's worker thread, holding its locks and its devices' locks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from agent.claims.allocation import Allocation
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import ClaimRecord

WriteRecord = Callable[[ClaimRecord], None]


class HostEffect(Protocol):
    """One kind of host side effect, kept in the claim's record."""

    name: str  # what the kind's effects are, for logs ("PCI functions bound to vfio-pci")

    def held(self, record: ClaimRecord) -> bool:
        """Whether the record holds effects of this kind."""
        ...

    def planned(self, alloc: Allocation, intent: ClaimRecord) -> ClaimRecord:
        """Every check, no side effect: the intent record with this kind's effects for the claim, each at
        step 0 (none when the claim needs none). Raises a ClaimFailure subclass naming the cause."""
        ...

    def apply(self, record: ClaimRecord, write: WriteRecord) -> ClaimRecord:
        """Make the record's effects of this kind from their recorded steps on, writing the record that
        names each step before the step. Returns the record as made (perhaps not yet written)."""
        ...

    def devices(self, allocated: Iterable[AllocatedDevice], record: ClaimRecord) -> list[AllocatedDevice]:
        """The allocation with what the made effects give its devices (VFIO nodes, a partition's UUID and
        nodes), from which the claim's files are planned."""
        ...

    def undo_intent(self, record: ClaimRecord) -> ClaimRecord:
        """The record with this kind's effects as an unprepare's `restoring` intent names them: where
        each one's undoing starts."""
        ...

    def undo(self, record: ClaimRecord, write: WriteRecord | None) -> ClaimRecord:
        """Undo the record's effects of this kind from whatever any prefix of `apply` left. With `write`
        (a `restoring` record), each step recorded first; without (a `binding` record rolled back, which
        is rolled back again from the start after a crash), every step, nothing recorded. Returns the
        record as last written."""
        ...

    def reassert(self, record: ClaimRecord, write: WriteRecord) -> ClaimRecord:
        """Recovery of a prepared record: its effects of this kind made true again where the host lost
        them (a reboot forgets bindings), each change recorded; raises a ClaimFailure or OSError when
        they cannot be (a partition made again would have another UUID than the claim's files name)."""
        ...

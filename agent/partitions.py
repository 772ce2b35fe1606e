"""GPU partitions created on the host at prepare (MIG instances, vGPU mediated devices): the
interface each kind's module implements, and the checks every kind shares.

A partition is a side effect outside the agent's files, like a passthrough binding, and follows the
same discipline (`agent.vfioprep`): the record (`agent.state.DevicePartition`, format version 3)
says what is about to happen before it happens, each step is idempotent and judged against what
the host shows now, and `destroy` converges from any prefix of `create`, so recovery can roll back
a prepare that stopped anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from agent.metadata import AllocatedDevice
from agent.state import DevicePartition, PartitionKind

WritePartition = Callable[[DevicePartition], None]


class Partitioner(Protocol):
    """One kind of partition (agent/migprep.py: MIG; agent/vgpuprep.py: mediated devices). Blocking:
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
        """The allocated device with the partition's facts (MIG: its UUID as the GPU UUID and the
        /dev/nvidia-caps nodes; mdev: its UUID), so claimplan writes the CDI spec and metadata from it."""
        ...

"""`dra-agent vfio status`: what this node's agent has bound to vfio-pci, from the claim records, and
what each function is bound to now (read-only); and what unprepared claims left that could not be
undone (`agent.claims.leftovers`: a function left on vfio-pci, a MIG instance or mediated device left
on a lost GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.claims.leftovers import Leftover
from agent.claims.records import ClaimRecord, RecordState
from agent.host.vfio.pci import current_driver, iommu_group


@dataclass(frozen=True, slots=True)
class BoundFunction:
    claim: str  # namespace/name
    uid: str
    state: RecordState  # prepared, or an operation that stopped halfway (binding, restoring)
    device: str
    function: str  # bus ID
    role: str  # target | companion
    original: str  # the driver it goes back to ("none": it was unbound)
    expected: str  # the driver the record says it has now (vfio-pci once prepared)
    now: str  # the driver sysfs shows ("none": unbound)
    group: int | None
    iommu: str  # the VFIO interface its CDI spec gives (legacy | iommufd)

    @property
    def consistent(self) -> bool:
        # Mid-bind or mid-restore either driver may be right: the next start settles it.
        return self.state is not RecordState.PREPARED or self.now == self.expected

    def wire(self) -> dict[str, object]:
        return {"claim": self.claim, "uid": self.uid, "state": str(self.state), "device": self.device,
                "function": self.function, "role": self.role, "originalDriver": self.original,
                "expectedDriver": self.expected, "driver": self.now, "iommuGroup": self.group,
                "iommu": self.iommu, "consistent": self.consistent}


def bound_functions(sysfs: Path, records: list[ClaimRecord]) -> list[BoundFunction]:
    out = []
    for r in sorted(records, key=lambda r: (r.namespace, r.name)):
        for b in r.bindings:
            for i, f in enumerate(b.plan.functions):
                out.append(BoundFunction(
                    claim=f"{r.namespace}/{r.name}", uid=r.uid, state=r.state, device=b.device, function=f.bdf,
                    role="target" if i == 0 else "companion", original=f.driver or "none",
                    expected=b.plan.driver if r.state is RecordState.PREPARED else "-",
                    now=current_driver(sysfs, f.bdf) or "none", group=iommu_group(sysfs, f.bdf), iommu=b.iommu))
    return out


@dataclass(frozen=True, slots=True)
class LeftUndone:
    """A host change an unprepared claim left: a function (or a partition on it) and why."""

    claim: str
    uid: str
    device: str
    function: str  # bus ID ("" when its hardware is not known)
    role: str  # target | companion | partition
    original: str  # the driver a function goes back to ("-" for a partition)
    now: str  # the driver sysfs shows ("gone": the function left the bus)
    why: str  # the leftover, described

    def wire(self) -> dict[str, object]:
        return {"claim": self.claim, "uid": self.uid, "state": "left undone", "device": self.device,
                "function": self.function, "role": self.role, "originalDriver": self.original, "driver": self.now,
                "reason": self.why}


def left_undone(sysfs: Path, leftovers: list[Leftover]) -> list[LeftUndone]:
    out = []
    for lo in leftovers:
        for b in lo.record.bindings:
            for i, f in enumerate(b.plan.functions):
                now = current_driver(sysfs, f.bdf) or ("none" if (sysfs / "bus" / "pci" / "devices" / f.bdf).exists()
                                                       else "gone")
                out.append(LeftUndone(lo.claim, lo.uid, b.device, f.bdf, "target" if i == 0 else "companion",
                                      f.driver or "none", now, lo.describe()))
        for p in lo.record.partitions:
            out.append(LeftUndone(lo.claim, lo.uid, p.device, p.parent if ":" in p.parent else "",
                                  f"{p.kind} partition", "-", "-", lo.describe()))
    return out

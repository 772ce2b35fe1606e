"""What sysfs says about a PCI function for passthrough, and whether its IOMMU group can go to a VM.

VFIO hands a VM whole IOMMU groups: every function in the group must be bound to a VFIO driver,
be unbound, or be a bridge, or VFIO refuses to open the group. A GPU's companion functions in the
same slot (HD audio, USB, its USB-C controller) go with it; anything else the host drives is a
precise error naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from agent.host.pci import read_text
from agent.host.vfio.errors import GroupNotViable, NoSuchFunction, VfioError

VFIO_PCI = "vfio-pci"
# How sysfs shows "no override": "(null)" (the kernel formats a NULL string), or nothing at all.
_NO_OVERRIDE = ("", "(null)")
_BRIDGE_BASE_CLASS = 0x06
# Class and subclass (class >> 8) of functions that travel with the function in their slot:
# HD audio, USB, and "other serial bus" (a GPU's USB-C/UCSI controller).
COMPANION_CLASSES = frozenset({0x0403, 0x0C03, 0x0C80})


@dataclass(frozen=True, slots=True)
class FunctionState:
    """One PCI function as sysfs shows it now."""

    bdf: str
    device_class: int  # 0x030200
    vendor: str  # "0x10de"
    device: str
    driver: str | None  # None: unbound
    override: str | None  # driver_override; None: none set
    iommu_group: int | None  # None: no IOMMU (or it is off)

    @property
    def slot(self) -> str:
        """`domain:bus:device`, shared by the functions of one card."""
        return self.bdf.rsplit(".", 1)[0]

    @property
    def is_bridge(self) -> bool:
        return self.device_class >> 16 == _BRIDGE_BASE_CLASS

    @property
    def is_companion_class(self) -> bool:
        return self.device_class >> 8 in COMPANION_CLASSES

    def describe(self) -> str:
        return f"{self.bdf} (class 0x{self.device_class:06x}, {self.vendor}:{self.device.removeprefix('0x')})"


def function_dir(sysfs: Path, bdf: str) -> Path:
    return sysfs / "bus" / "pci" / "devices" / bdf


def current_driver(sysfs: Path, bdf: str) -> str | None:
    link = function_dir(sysfs, bdf) / "driver"
    try:
        return os.path.basename(os.readlink(link))
    except OSError:
        return None


def current_override(sysfs: Path, bdf: str) -> str | None:
    text = read_text(function_dir(sysfs, bdf) / "driver_override")
    return None if text is None or text in _NO_OVERRIDE else text


def iommu_group(sysfs: Path, bdf: str) -> int | None:
    try:
        return int(os.path.basename(os.readlink(function_dir(sysfs, bdf) / "iommu_group")))
    except (OSError, ValueError):
        return None


def group_members(sysfs: Path, group: int) -> list[str]:
    try:
        return sorted(os.listdir(sysfs / "kernel" / "iommu_groups" / str(group) / "devices"))
    except OSError:
        return []


def sriov_numvfs(sysfs: Path, bdf: str) -> int:
    """Enabled SR-IOV virtual functions (0 where the function has no SR-IOV)."""
    text = read_text(function_dir(sysfs, bdf) / "sriov_numvfs")
    try:
        return int(text) if text else 0
    except ValueError:
        return 0


def virtual_functions(sysfs: Path, bdf: str) -> list[str]:
    """The bus IDs of a PF's enabled VFs, in VF order (`virtfn0`, `virtfn1`, ...)."""
    base = function_dir(sysfs, bdf)
    try:
        names = [n for n in os.listdir(base) if n.startswith("virtfn") and n[6:].isdigit()]
    except OSError:
        return []
    return [os.path.basename(os.readlink(base / n)) for n in sorted(names, key=lambda n: int(n[6:]))]


def physical_function(sysfs: Path, bdf: str) -> str | None:
    """A VF's PF, or None for a function that is not a VF."""
    try:
        return os.path.basename(os.readlink(function_dir(sysfs, bdf) / "physfn"))
    except OSError:
        return None


def read_function(sysfs: Path, bdf: str) -> FunctionState:
    base = function_dir(sysfs, bdf)
    if not base.exists():
        raise NoSuchFunction(f"PCI function {bdf} is not in {sysfs / 'bus' / 'pci' / 'devices'}")
    try:
        device_class = int(read_text(base / "class") or "0", 16)
    except ValueError:
        device_class = 0
    return FunctionState(
        bdf=bdf, device_class=device_class, vendor=read_text(base / "vendor") or "",
        device=read_text(base / "device") or "", driver=current_driver(sysfs, bdf),
        override=current_override(sysfs, bdf), iommu_group=iommu_group(sysfs, bdf))


class Role(StrEnum):
    TARGET = "target"  # the function asked for
    COMPANION = "companion"  # same slot, audio/USB/serial: moves to vfio-pci with the target
    BRIDGE = "bridge"  # stays on its driver; VFIO accepts bridges in a group
    VFIO = "vfio"  # already bound to vfio-pci
    UNBOUND = "unbound"  # no driver: nothing on the host uses it


@dataclass(frozen=True, slots=True)
class GroupMember:
    function: FunctionState
    role: Role


@dataclass(frozen=True, slots=True)
class PassthroughSet:
    """A function's IOMMU group, each member with its role; `moving` go to vfio-pci together."""

    group: int
    members: tuple[GroupMember, ...]

    @property
    def target(self) -> FunctionState:
        return next(m.function for m in self.members if m.role is Role.TARGET)

    @property
    def moving(self) -> tuple[FunctionState, ...]:
        """The target first, then its companions, in bus-ID order."""
        return (self.target, *(m.function for m in self.members if m.role is Role.COMPANION))


def passthrough_set(sysfs: Path, bdf: str) -> PassthroughSet:
    """The group `bdf` would take with it to a VM; GroupNotViable when another member is held by a host
    driver and is neither a bridge nor a companion of `bdf`."""
    target = read_function(sysfs, bdf)
    if target.iommu_group is None:
        raise VfioError(f"PCI function {bdf} is in no IOMMU group: the IOMMU is off or absent (enable VT-d / "
                        "AMD-Vi in the firmware, boot with intel_iommu=on iommu=pt)")
    members = [GroupMember(target, Role.TARGET)]
    blocking: list[str] = []
    for other in group_members(sysfs, target.iommu_group):
        if other == bdf:
            continue
        fn = read_function(sysfs, other)
        if fn.slot == target.slot and fn.is_companion_class:
            role = Role.COMPANION
        elif fn.is_bridge:
            role = Role.BRIDGE
        elif fn.driver == VFIO_PCI:
            role = Role.VFIO
        elif fn.driver is None:
            role = Role.UNBOUND
        else:
            blocking.append(f"{fn.describe()} bound to {fn.driver}")
            continue
        members.append(GroupMember(fn, role))
    if blocking:
        raise GroupNotViable(
            f"PCI function {bdf} cannot be passed through: its IOMMU group {target.iommu_group} also holds "
            f"{'; '.join(blocking)}, which the host uses and VFIO would have to take too")
    return PassthroughSet(target.iommu_group, tuple(members))

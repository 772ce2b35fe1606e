"""Passthrough (VFIO) variants of GPUs and NIC functions, and the counter sets they share with the
native devices.

A function that can go to a VM whole is published twice: as its native device (`gpu-3`,
`nic-0000-4b-00-2`) and as a passthrough variant (`gpu-0000-18-00-0-vfio`, `nic-0000-4b-00-2-vfio`,
`counters.passthrough_name`), both consuming all of the function's counter set, so the scheduler
never hands out both. Its facts (`agent.facts.PassthroughFacts`) are what prepare needs: the native
kind, bus ID, IOMMU group, current and host driver, a NIC's MAC. It carries `type=vfio`, `nativeType`
(`gpu` | `nic`), `iommuGroup` (and a NIC's `macAddress`) from them (`agent.inventory.published`), and the
native device's standard PCI attributes, `vendorID` and `deviceID`.

Variants are found in sysfs, not from the native devices: a function bound to vfio-pci leaves NVML
and loses its netdev, and its variant must stay published (under the same name) while a VM has it.

No variant, said once in the log with why:
- the host has no IOMMU groups (`/sys/kernel/iommu_groups` empty: the IOMMU is off), said only when a
  function would otherwise be looked at (an NVIDIA GPU, an SR-IOV VF, a PF `--nic-passthrough` names):
  a node without one has nothing to pass through, and a warning there would only contradict
  `dra-agent doctor`'s IOMMU line (with simulated GPUs, the simulated machine's groups);
- the function's IOMMU group holds another endpoint that is neither a bridge nor a companion in the
  function's own slot (a GPU's audio or USB function): VFIO takes whole groups, so passing the
  function through would take its neighbour (another GPU, a NIC) away from the host too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from agent import counters
from agent.facts import NicFacts, PassthroughFacts
from agent.host.pci import normalize_bus_id, nvidia_display_functions, pci_function, read_text
from agent.host.vfio.errors import VfioError
from agent.host.vfio.pci import (
    VFIO_PCI,
    FunctionState,
    group_members,
    physical_function,
    read_function,
    sriov_numvfs,
)
from agent.inventory.published import attributes
from agent.kinds import Kind
from agent.model import PCI_BUS_ID, CounterConsumption, CounterSet, Device

log = logging.getLogger(__name__)

_NETWORK_CLASS = 0x02


def iommu_groups_present(sysfs: Path) -> bool:
    """Whether the kernel shows any IOMMU group (none: the IOMMU is off or absent)."""
    try:
        return any(True for _ in os.scandir(sysfs / "kernel" / "iommu_groups"))
    except OSError:
        return False


def blocking_members(sysfs: Path, fn: FunctionState) -> list[str]:
    """The other endpoints in `fn`'s IOMMU group that passing it through would take along: anything
    that is neither a bridge nor a companion (audio, USB, serial bus) in `fn`'s own slot.

    Structural on purpose (classes and slots, not current drivers): whether a variant exists must
    not change while functions move between drivers."""
    out = []
    for other in group_members(sysfs, fn.iommu_group) if fn.iommu_group is not None else []:
        if other == fn.bdf:
            continue
        try:
            member = read_function(sysfs, other)
        except VfioError:
            continue  # listed in the group but gone from the bus: nothing to take along
        if member.is_bridge or (member.slot == fn.slot and member.is_companion_class):
            continue
        out.append(member.describe())
    return out


@dataclass(slots=True)
class Variants:
    """One source's passthrough bookkeeping, kept across scans: what was logged, and the facts a
    function loses while it is bound to vfio-pci (its host driver, a NIC's MAC and port names)."""

    what: str  # "GPU" | "NIC function", for the log
    _said: dict[str, str] = field(default_factory=dict)
    host_drivers: dict[str, str] = field(default_factory=dict)

    def note(self, key: str, message: str, level: int = logging.INFO) -> None:
        """Log `message` once for `key` (again only when it changes)."""
        if self._said.get(key) != message:
            self._said[key] = message
            log.log(level, "%s", message)

    def passable(self, sysfs: Path, bus_id: str) -> FunctionState | None:
        """The function when it may have a variant; None (logged once, with why) otherwise."""
        try:
            fn = read_function(sysfs, bus_id)
        except VfioError:
            return None
        if fn.iommu_group is None:
            self.note(bus_id, f"{self.what} {bus_id}: no passthrough variant: it is in no IOMMU group")
            return None
        if blocking := blocking_members(sysfs, fn):
            self.note(bus_id, f"{self.what} {bus_id}: no passthrough variant: its IOMMU group {fn.iommu_group} "
                      f"also holds {', '.join(blocking)}, which passing it through would take from the host",
                      logging.WARNING)
            return None
        self._said.pop(bus_id, None)
        if fn.driver and fn.driver != VFIO_PCI:
            self.host_drivers[bus_id] = fn.driver
        return fn

    def variant(self, sysfs: Path, fn: FunctionState, native: Kind, counter_set: CounterSet,
                mac: str = "") -> Device:
        assert fn.iommu_group is not None  # passable() said so
        facts = PassthroughFacts(native, fn.bdf, fn.iommu_group, driver=fn.driver or "",
                                 host_driver=self.host_drivers.get(fn.bdf, ""), mac=mac)
        attrs = attributes(facts)
        pci = pci_function(sysfs, fn.bdf)
        attrs.update(pci.standard_attributes() if pci is not None else {PCI_BUS_ID: fn.bdf})
        if fn.vendor:
            attrs["vendorID"] = fn.vendor
        if fn.device:
            attrs["deviceID"] = fn.device
        return Device(
            name=counters.passthrough_name(native, fn.bdf), kind=Kind.VFIO, attributes=attrs, node=facts,
            consumes_counters=(CounterConsumption.all_of(counter_set),))

    def groups_present(self, sysfs: Path, functions: Sequence[str]) -> bool:
        """Whether `functions` (those that would get a variant with an IOMMU) can be looked at: a warning
        naming them when the host has no IOMMU groups, nothing when there are none to miss out."""
        if not functions:
            return False
        if iommu_groups_present(sysfs):
            self._said.pop("<iommu>", None)
            return True
        self.note("<iommu>", f"no IOMMU groups in {sysfs / 'kernel' / 'iommu_groups'} (the IOMMU is off or "
                  f"absent): no passthrough variant for {self.what} {', '.join(functions)}", logging.WARNING)
        return False


def _bus_of(dev: Device) -> str | None:
    return dev.pci_bus_id or None


# -- GPUs ------------------------------------------------------------------------------------------

@dataclass(slots=True)
class GpuVariants:
    """Counter sets for NVML's GPUs, and a variant for each passable NVIDIA display function."""

    variants: Variants = field(default_factory=lambda: Variants("GPU"))
    _memory: dict[str, str] = field(default_factory=dict)  # bus ID -> memory quantity NVML said

    def apply(self, sysfs: Path, natives: Sequence[Device]) -> list[Device]:
        out: list[Device] = []
        sets: dict[str, CounterSet] = {}
        for dev in natives:
            bus = _bus_of(dev)
            if bus is None:
                out.append(dev)
                continue
            if (memory := dev.capacity.get("memory")) is not None:
                self._memory[bus] = memory.value
            sets[bus] = cs = self._counter_set(bus)
            out.append(dataclasses.replace(dev, consumes_counters=(CounterConsumption.all_of(cs),)))
        functions = sorted(set(nvidia_display_functions(sysfs)) | {b for b in sets if _in_sysfs(sysfs, b)})
        if not self.variants.groups_present(sysfs, functions):
            return out
        for bus in functions:
            fn = self.variants.passable(sysfs, bus)
            if fn is not None:
                out.append(self.variants.variant(sysfs, fn, Kind.GPU, sets.get(bus) or self._counter_set(bus)))
        return out

    def _counter_set(self, bus: str) -> CounterSet:
        cs = counters.gpu_counter_set(bus, None)
        if (memory := self._memory.get(bus)) is not None:
            cs = CounterSet(cs.name, {**cs.counters, counters.MEMORY_COUNTER: memory})
        return cs


def _in_sysfs(sysfs: Path, bus: str) -> bool:
    return (sysfs / "bus" / "pci" / "devices" / bus).exists()


# -- NIC functions ---------------------------------------------------------------------------------

@dataclass(slots=True)
class NicVariants:
    """Counter sets for PCI NIC functions; a variant for each passable SR-IOV VF, and for each PF
    without enabled VFs whose interface matches `passthrough` (`--nic-passthrough`). Functions
    whose interfaces match `exclude` get none."""

    passthrough: Sequence[str] = ()
    exclude: Sequence[str] = ()
    variants: Variants = field(default_factory=lambda: Variants("NIC function"))
    _ports: dict[str, int] = field(default_factory=dict)  # bus ID -> most ports seen at once
    _names: dict[str, tuple[str, ...]] = field(default_factory=dict)  # bus ID -> interface names seen
    _macs: dict[str, str] = field(default_factory=dict)  # bus ID -> the MAC last seen

    def apply(self, sysfs: Path, natives: Sequence[Device]) -> list[Device]:
        by_bus: dict[str, list[Device]] = {}
        for dev in natives:
            if (bus := _bus_of(dev)) is not None:
                by_bus.setdefault(bus, []).append(dev)
        uplinks: dict[str, str] = {}  # functions with a port that is the node's uplink, and why: never passed through
        for bus, devs in by_bus.items():
            self._ports[bus] = max(self._ports.get(bus, 0), len(devs))
            ports = [d.node for d in sorted(devs, key=lambda d: d.name) if isinstance(d.node, NicFacts)]
            self._learn(bus, [p.interface for p in ports if p.interface], ports[0].mac if ports else "")
            if why := next((p.uplink_reason for p in ports if p.uplink), ""):
                uplinks[bus] = why
        out = [d if (bus := _bus_of(d)) is None
               else dataclasses.replace(d, consumes_counters=(counters.one_port(self._counter_set(bus)),))
               for d in natives]
        functions = []
        for bus in self._candidates(sysfs):
            if bus in uplinks:
                log.debug("NIC function %s is the node's uplink (%s): no passthrough variant", bus, uplinks[bus])
            else:
                functions.append(bus)
        if not self.variants.groups_present(sysfs, functions):
            return out
        for bus in functions:
            fn = self.variants.passable(sysfs, bus)
            if fn is None:
                continue
            out.append(self.variants.variant(sysfs, fn, Kind.NIC, self._counter_set(bus), self._macs.get(bus, "")))
        return out

    def _counter_set(self, bus: str) -> CounterSet:
        return counters.nic_counter_set(bus, self._ports.get(bus, 1))

    def _learn(self, bus: str, names: Iterable[str], mac: str) -> None:
        if names := tuple(sorted(names)):
            self._names[bus] = tuple(sorted(set(self._names.get(bus, ())) | set(names)))
        if mac:
            self._macs[bus] = mac

    def _candidates(self, sysfs: Path) -> list[str]:
        """Network functions in sysfs that may get a variant: VFs, and PFs without enabled VFs named
        by `passthrough`; never one whose interface `exclude` names."""
        base = sysfs / "bus" / "pci" / "devices"
        try:
            entries = sorted(os.listdir(base))
        except OSError:
            return []
        out = []
        for entry in entries:
            try:
                bus = normalize_bus_id(entry)
            except ValueError:
                continue
            if not (read_text(base / entry / "class") or "").startswith(f"0x{_NETWORK_CLASS:02x}"):
                continue
            found = netdevs(sysfs, entry)
            self._learn(bus, found, _mac(base / entry, found))
            names = self._names.get(bus, ())
            if any(fnmatchcase(n, g) for n in names for g in self.exclude):
                continue
            is_vf = physical_function(sysfs, bus) is not None
            named = any(fnmatchcase(n, g) for n in names for g in self.passthrough)
            if is_vf or (named and sriov_numvfs(sysfs, bus) == 0):
                out.append(bus)
        return out


def netdevs(sysfs: Path, bus: str) -> list[str]:
    """The network interfaces of PCI function `bus` now."""
    try:
        return sorted(os.listdir(sysfs / "bus" / "pci" / "devices" / bus / "net"))
    except OSError:
        return []  # no netdev: bound to vfio-pci, or to no driver


def _mac(function: Path, netdevs: Sequence[str]) -> str:
    for name in netdevs:
        if address := read_text(function / "net" / name / "address"):
            return address
    return ""

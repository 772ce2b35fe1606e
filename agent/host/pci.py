"""PCI facts from sysfs: bus ID, PCIe root, NUMA node, vendor, driver.

Every function takes the sysfs root as a setting, so tests run on a tree of
their own and the real `/sys` alike.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from agent.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, AttrValue

BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\Z")
_ROOT = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}\Z")


def normalize_bus_id(text: str) -> str:
    """`00000000:18:00.0` (NVML) or `0000:18:00.0` -> `0000:18:00.0`, lower case."""
    text = text.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep:
        raise ValueError(f"not a PCI bus ID: {text!r}")
    out = f"{int(domain, 16):04x}:{rest}"
    if not BDF.match(out):
        raise ValueError(f"not a PCI bus ID: {text!r}")
    return out


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class PciFunction:
    bus_id: str
    pcie_root: str | None
    numa_node: int | None
    vendor: str | None
    device: str | None
    device_class: str | None
    driver: str | None
    sysfs_path: Path

    def standard_attributes(self) -> dict[str, AttrValue]:
        attrs: dict[str, AttrValue] = {PCI_BUS_ID: self.bus_id}
        if self.pcie_root:
            attrs[PCIE_ROOT] = self.pcie_root
        if self.numa_node is not None:
            attrs[NUMA_NODE] = self.numa_node
        return attrs


def pci_function(sysfs_root: Path, bus_id: str) -> PciFunction | None:
    """Facts for `/sys/bus/pci/devices/<bus_id>`; None when sysfs does not know the function."""
    link = sysfs_root / "bus" / "pci" / "devices" / bus_id
    try:
        real = Path(os.path.realpath(link, strict=True))
    except OSError:
        return None
    return _describe(bus_id, real)


def pci_function_of(device_dir: Path) -> PciFunction | None:
    """The PCI function a sysfs device belongs to (e.g. `class/net/eth0/device`), if any.

    The device may sit below its PCI function (virtio: `.../0000:00:03.0/virtio2`),
    so walk up to the nearest path component that is a bus ID.
    """
    try:
        real = Path(os.path.realpath(device_dir, strict=True))
    except OSError:
        return None
    for candidate in (real, *real.parents):
        if BDF.match(candidate.name):
            return _describe(candidate.name, candidate)
        if _ROOT.match(candidate.name) or candidate.name == "devices":
            break
    return None


def _describe(bus_id: str, real: Path) -> PciFunction:
    # The PCIe root is the first path component of the resolved device path below devices/.
    root = next((p.name for p in (real, *real.parents) if _ROOT.match(p.name)), None)
    numa_text = read_text(real / "numa_node")
    numa: int | None = None
    if numa_text is not None:
        try:
            numa = int(numa_text)
        except ValueError:
            numa = None
        if numa is not None and numa < 0:
            numa = None  # sysfs says -1: no NUMA affinity, the attribute is omitted
    driver_link = real / "driver"
    driver = os.path.basename(os.path.realpath(driver_link)) if driver_link.exists() else None
    return PciFunction(
        bus_id=bus_id,
        pcie_root=root,
        numa_node=numa,
        vendor=read_text(real / "vendor"),
        device=read_text(real / "device"),
        device_class=read_text(real / "class"),
        driver=driver,
        sysfs_path=real,
    )


def nvidia_display_functions(sysfs_root: Path) -> list[str]:
    """Bus IDs of NVIDIA (vendor 0x10de) display-class functions (class 0x03xxxx), GPUs only: an SR-IOV VF
    of a GPU (`physfn`: what a vGPU manager enables to host one vGPU each) is no GPU of its own."""
    out: list[str] = []
    base = sysfs_root / "bus" / "pci" / "devices"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return out
    for name in entries:
        is_display = (read_text(base / name / "class") or "").startswith("0x03")
        if is_display and read_text(base / name / "vendor") == "0x10de" \
                and not os.path.lexists(base / name / "physfn"):
            out.append(name)
    return out

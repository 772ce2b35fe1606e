"""The simulated machine on disk: its sysfs PCI tree, the kernel driver's GPU list in procfs and its
/dev nodes, as the driver would show them.

Discovery in sim mode reads PCI facts from this tree exactly as it reads the real
`/sys` (and `/proc/driver/nvidia/gpus`), and CDI specs point at these device nodes.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from pathlib import Path

from agent.inventory.nvml_profiles import SimProfile

log = logging.getLogger(__name__)

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
UVM_MAJOR = 235  # dynamically assigned on real hosts; a typical value


def materialize(profile: SimProfile, root: Path) -> None:
    """Write the profile's sysfs (`root/sys`), the driver's GPU list (`root/proc`) and device nodes
    (`root/dev`); safe to repeat."""
    sys_root = root / "sys"
    devices = sys_root / "bus" / "pci" / "devices"
    drivers = sys_root / "bus" / "pci" / "drivers" / "nvidia"
    groups = sys_root / "kernel" / "iommu_groups"
    for d in (devices, drivers, groups):
        d.mkdir(parents=True, exist_ok=True)
    wanted_links: set[str] = set()
    ports: dict[str, int] = {}
    for position, gpu in enumerate(profile.gpus):
        if not gpu.in_sysfs:
            continue
        domain = gpu.bus_id.split(":")[0]
        port_no = ports[gpu.pcie_root] = ports.get(gpu.pcie_root, 0) + 1
        port_bdf = f"{domain}:{gpu.pcie_root.split(':')[1]}:{port_no:02x}.0"
        port_dir = sys_root / "devices" / gpu.pcie_root / port_bdf
        _function_dir(port_dir, {"vendor": "0x8086", "device": "0x352a", "class": "0x060400",
                                 "numa_node": str(gpu.numa_node)})
        gpu_dir = port_dir / gpu.bus_id
        vendor = gpu.pci_device_id & 0xFFFF
        _function_dir(gpu_dir, {
            "vendor": f"0x{vendor:04x}", "device": f"0x{gpu.pci_device_id >> 16:04x}",
            "subsystem_vendor": f"0x{gpu.pci_subsystem_id & 0xFFFF:04x}",
            "subsystem_device": f"0x{gpu.pci_subsystem_id >> 16:04x}",
            "class": "0x030200", "numa_node": str(gpu.numa_node),
        })
        for bdf, target in ((port_bdf, port_dir), (gpu.bus_id, gpu_dir)):
            _link(devices / bdf, target)
            wanted_links.add(bdf)
        _link(drivers / gpu.bus_id, gpu_dir)
        _link(gpu_dir / "driver", drivers)
        group = groups / str(100 + position)
        (group / "devices").mkdir(parents=True, exist_ok=True)
        _link(group / "devices" / gpu.bus_id, gpu_dir)
        _link(gpu_dir / "iommu_group", group)
    # A profile that changed since the last run must not leave functions it no longer has.
    for stale in set(os.listdir(devices)) - wanted_links:
        (devices / stale).unlink(missing_ok=True)
    for stale in set(os.listdir(drivers)) - {g.bus_id for g in profile.gpus if g.in_sysfs}:
        (drivers / stale).unlink(missing_ok=True)
    _driver_gpus(profile, root / "proc" / "driver" / "nvidia" / "gpus")
    _device_nodes(profile, root / "dev")


def _driver_gpus(profile: SimProfile, top: Path) -> None:
    # /proc/driver/nvidia/gpus/<bus id>/information, the lines of it discovery reads.
    top.mkdir(parents=True, exist_ok=True)
    for gpu in profile.gpus:
        _function_dir(top / gpu.bus_id, {"information": (
            f"Model: \t\t {gpu.name}\nGPU UUID: \t {gpu.uuid}\nBus Location: \t {gpu.bus_id}\n"
            f"Device Minor: \t {gpu.minor}")})
    for stale in set(os.listdir(top)) - {g.bus_id for g in profile.gpus}:
        shutil.rmtree(top / stale, ignore_errors=True)


def _function_dir(path: Path, files: dict[str, str]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        target = path / name
        if not target.is_file() or target.read_text() != text + "\n":
            target.write_text(text + "\n")


def _link(link: Path, target: Path) -> None:
    # Relative, like the kernel's, so the tree can be moved or bind-mounted elsewhere.
    relative = os.path.relpath(target, link.parent)
    if link.is_symlink() and os.readlink(link) == relative:
        return
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(relative)


def _device_nodes(profile: SimProfile, dev: Path) -> None:
    dev.mkdir(parents=True, exist_ok=True)
    nodes = {f"nvidia{g.minor}": (NVIDIA_MAJOR, g.minor) for g in profile.gpus}
    nodes |= {"nvidiactl": (NVIDIA_MAJOR, NVIDIACTL_MINOR), "nvidia-uvm": (UVM_MAJOR, 0),
              "nvidia-uvm-tools": (UVM_MAJOR, 1)}
    for name, (major, minor) in nodes.items():
        _device_node(dev / name, major, minor)
    for stale in os.listdir(dev):
        if re.fullmatch(r"nvidia\d+", stale) and stale not in nodes:
            (dev / stale).unlink(missing_ok=True)


def _device_node(path: Path, major: int, minor: int) -> None:
    want = os.makedev(major, minor)
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    if os.geteuid() == 0:
        if st is not None and stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
            return
        if st is not None:
            path.unlink()
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, want)
            os.chmod(path, 0o666)  # as the driver makes them; mknod's mode is cut by the umask
            return
        except PermissionError:
            log.debug("cannot create character device %s; writing a placeholder file", path)
    elif st is not None and stat.S_ISREG(st.st_mode):
        return
    elif st is not None:
        path.unlink()
    # Unprivileged: a placeholder that still lets CDI specs and tests name the path.
    if not path.exists():
        path.touch()

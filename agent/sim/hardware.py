"""The simulated machine on disk: its sysfs PCI tree, the kernel driver's GPU list in procfs and its
/dev nodes, as the driver would show them.

Discovery in sim mode reads PCI facts from this tree exactly as it reads the real
`/sys` (and `/proc/driver/nvidia/gpus`), and CDI specs point at these device nodes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agent.fsutil import makedirs
from agent.sim.driver import Driver, read_driver, write_driver
from agent.sim.events import RECOVERY_ACTIONS
from agent.sim.kernel import mdev as simmdev
from agent.sim.kernel.tree import (
    COMMAND_FILES,
    DRIVER_MODULES,
    IOMMUFD_MISC,
    VFIO_GROUP_MAJOR,
    VFIO_MISC,
    SimTree,
    device_node,
    function_dir,
    link,
)
from agent.sim.profiles import SimNic, SimProfile
from agent.sim.vflinks import SimVfLinks

log = logging.getLogger(__name__)

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
UVM_MAJOR = 235  # dynamically assigned on real hosts; a typical value
CAPS_MAJOR = 508  # nvidia-caps: dynamic on real hosts too (a line of /proc/devices)

_PORT = {"vendor": "0x8086", "device": "0x352a", "class": "0x060400"}  # an Intel PCIe root port


@dataclass
class SimFunction:
    """One PCI function to write: where, what its files say, its native driver and IOMMU group."""

    bdf: str
    parent: Path  # the directory it sits in, below sys/devices
    files: dict[str, str]
    driver: str
    group: int | None
    links: dict[str, str] = field(default_factory=dict)  # name in the function's directory -> target BDF
    net: tuple[str, str] | None = None  # (interface, MAC) while bound to its native driver

    @property
    def path(self) -> Path:
        return self.parent / self.bdf


def materialize(profile: SimProfile, root: Path, *, boot: bool = False, missing: Iterable[str] = ()) -> None:
    """Write the profile's sysfs (`root/sys`), the driver's GPU list (`root/proc`) and device nodes
    (`root/dev`); safe to repeat.

    A repeat keeps what the simulated kernel changed since (drivers bound and unbound, overrides, VFIO
    nodes), as a real host keeps it across an agent restart. `boot=True` is a simulated reboot:
    every function back on its native driver, no overrides, no VFIO nodes, a new boot ID, every GPU
    back (healthy: a reboot resets it) except those whose bus IDs are in `missing`, which did not come
    back in this boot (`machine_profile`: the GPUs after them get new minors)."""
    # Its device nodes carry the real NVIDIA and VFIO numbers: only the agent's user may reach them, whoever
    # writes the machine first (the agent, or a command such as `dra-agent devices`), as with the state
    # directory the machine lives in (created 0700 here too when it is not there yet).
    makedirs(root, 0o700)
    tree = SimTree(root)
    if boot:
        _write_missing(tree, missing)
    profile = machine_profile(profile, root)
    for d in (tree.devices, tree.drivers, tree.groups):
        d.mkdir(parents=True, exist_ok=True)
    functions = sim_functions(profile, tree)
    _drivers(tree, {f.driver for f in functions} | set(DRIVER_MODULES))
    wanted = {f.bdf for f in functions}
    # A profile that changed since the last run must not leave functions or groups it no longer has.
    for stale in set(os.listdir(tree.devices)) - wanted:
        (tree.devices / stale).unlink(missing_ok=True)
    for driver in os.listdir(tree.drivers):
        for entry in os.listdir(tree.drivers / driver):
            if re.fullmatch(r"[0-9a-f]{4,8}:.*", entry) and entry not in wanted:
                (tree.drivers / driver / entry).unlink(missing_ok=True)
    groups: dict[int, list[str]] = {}
    for f in functions:
        if f.group is not None:
            groups.setdefault(f.group, []).append(f.bdf)
    for name in os.listdir(tree.groups):
        if not name.isdigit() or int(name) not in groups:
            shutil.rmtree(tree.groups / name, ignore_errors=True)
            (tree.dev / "vfio" / name).unlink(missing_ok=True)
    for f in functions:
        _write_function(tree, f, boot)
    for group, members in groups.items():
        where = tree.groups / str(group) / "devices"
        where.mkdir(parents=True, exist_ok=True)
        for entry in set(os.listdir(where)) - set(members):
            (where / entry).unlink()
    nvidia = read_driver(root)
    if boot and not nvidia.loaded:  # a boot loads the driver
        nvidia = Driver(True, nvidia.load + 1)
        write_driver(root, nvidia)
    if nvidia.loaded:  # (unloaded: `load_driver` writes them)
        _driver_gpus(profile, root / "proc" / "driver" / "nvidia" / "gpus")
    _proc_devices(root / "proc")
    _device_nodes(profile, tree.dev, boot, nvidia=nvidia.loaded)
    simmdev.materialize(profile, root, boot=boot)
    if boot:
        SimVfLinks(root).forget()  # the PF's driver starts with no VF settings
    if boot or not tree.boot_id.is_file():
        tree.boot_id.parent.mkdir(parents=True, exist_ok=True)
        tree.boot_id.write_text(f"{uuid.uuid4()}\n")


def reboot(profile: SimProfile, root: Path, *, missing: Iterable[str] = ()) -> None:
    """The simulated machine's reboot: the kernel forgets every binding, mediated device and VFIO node,
    MIG instances are gone (`agent.sim.migstate` drops those of another boot), a new boot ID; the GPUs
    in `missing` (bus IDs) do not come back, and the minors of the others are renumbered."""
    materialize(profile, root, boot=True, missing=missing)


def machine_profile(profile: SimProfile, root: Path) -> SimProfile:
    """The profile as the machine at `root` has it in this boot: without the GPUs that did not come back
    (`reboot(missing=...)`), the others numbered again in the order of their minors. The NVIDIA driver
    numbers the GPUs it brings up in probe order, so a GPU that does not come up shifts the minor of
    every GPU probed after it: `/dev/nvidia<N>` is another GPU than before the reboot."""
    gone = _read_missing(SimTree(root))
    if not gone or not any(g.bus_id in gone for g in profile.gpus):
        return profile
    kept = [g for g in profile.gpus if g.bus_id not in gone]
    minors = {g.bus_id: n for n, g in enumerate(sorted(kept, key=lambda g: g.minor))}
    return dataclasses.replace(profile, gpus=tuple(dataclasses.replace(g, minor=minors[g.bus_id]) for g in kept))


def _write_missing(tree: SimTree, missing: Iterable[str]) -> None:
    gone = sorted(set(missing))
    tree.root.mkdir(parents=True, exist_ok=True)
    if gone:
        tree.missing_gpus.write_text("".join(f"{bus}\n" for bus in gone))
    else:
        tree.missing_gpus.unlink(missing_ok=True)


def _read_missing(tree: SimTree) -> set[str]:
    try:
        return set(tree.missing_gpus.read_text().split())
    except FileNotFoundError:
        return set()


def sim_functions(profile: SimProfile, tree: SimTree) -> list[SimFunction]:
    """Every PCI function of the machine (root ports, GPUs and their audio, NIC PFs and VFs), each with
    its native driver: what a fresh boot binds, and what `drivers_probe` picks without an override."""
    out: list[SimFunction] = []
    ports: dict[str, int] = {}

    def port(pcie_root: str, domain: str, numa: int, group: int | None) -> Path:
        port_no = ports[pcie_root] = ports.get(pcie_root, 0) + 1
        bdf = f"{domain}:{pcie_root.split(':')[1]}:{port_no:02x}.0"
        parent = tree.sys / "devices" / pcie_root
        out.append(SimFunction(bdf, parent, {**_PORT, "numa_node": str(numa)}, "pcieport", group))
        return parent / bdf

    for gpu in profile.gpus:
        if not gpu.in_sysfs:
            continue
        domain = gpu.bus_id.split(":")[0]
        # Without ACS above it, the root port shares the GPU's group; with it, the port is in none of
        # ours (a real host gives it a group of its own; nothing here passes ports through).
        parent = port(gpu.pcie_root, domain, gpu.numa_node, gpu.iommu_group if gpu.bridge_in_group else None)
        out.append(SimFunction(gpu.bus_id, parent, {
            "vendor": f"0x{gpu.pci_device_id & 0xFFFF:04x}", "device": f"0x{gpu.pci_device_id >> 16:04x}",
            "subsystem_vendor": f"0x{gpu.pci_subsystem_id & 0xFFFF:04x}",
            "subsystem_device": f"0x{gpu.pci_subsystem_id >> 16:04x}",
            "class": "0x030200", "numa_node": str(gpu.numa_node),
        }, "nvidia", gpu.iommu_group))
        if gpu.vgpu_vfs:
            # SR-IOV on (`sriov-manage -e`): the VFs beside the GPU, each on the nvidia driver.
            pf = out[-1]
            pf.files |= {"sriov_totalvfs": str(gpu.vgpu_vfs), "sriov_numvfs": str(gpu.vgpu_vfs)}
            for n in range(gpu.vgpu_vfs):
                pf.links[f"virtfn{n}"] = gpu.vf_bus_id(n)
                out.append(SimFunction(gpu.vf_bus_id(n), parent, {
                    "vendor": "0x10de", "device": f"0x{gpu.pci_device_id >> 16:04x}", "class": "0x030200",
                    "numa_node": str(gpu.numa_node)}, "nvidia", None, links={"physfn": gpu.bus_id}))
        if gpu.audio:
            out.append(SimFunction(gpu.audio_bus_id, parent, {
                "vendor": "0x10de", "device": "0x22ba", "class": "0x040300", "numa_node": str(gpu.numa_node),
            }, "snd_hda_intel", gpu.iommu_group))
    for nic in profile.nics:
        out.extend(_nic_functions(nic, port(nic.pcie_root, nic.bus_id.split(":")[0], nic.numa_node, None)))
    return out


def _nic_functions(nic: SimNic, parent: Path) -> list[SimFunction]:
    common = {"vendor": f"0x{nic.vendor:04x}", "class": "0x020000", "numa_node": str(nic.numa_node)}
    vfs = [nic.vf_bus_id(n) for n in range(nic.num_vfs)]
    pf_files = {**common, "device": f"0x{nic.device:04x}"}
    if nic.total_vfs:
        pf_files |= {"sriov_totalvfs": str(nic.total_vfs), "sriov_numvfs": str(nic.num_vfs)}
    out = [SimFunction(nic.bus_id, parent, pf_files, nic.driver, nic.iommu_group,
                     links={f"virtfn{n}": vf for n, vf in enumerate(vfs)}, net=(nic.interface, nic.mac()))]
    # VFs sit on the PF's bus, beside it.
    for n, vf in enumerate(vfs):
        out.append(SimFunction(vf, parent, {**common, "device": f"0x{nic.vf_device:04x}"}, nic.driver,
                             nic.iommu_group + 1 + n, links={"physfn": nic.bus_id},
                             net=(f"{nic.interface}v{n}", nic.mac(n))))
    return out


def _write_function(tree: SimTree, f: SimFunction, boot: bool) -> None:
    new = not f.path.is_dir()
    function_dir(f.path, f.files)
    link(tree.devices / f.bdf, f.path)
    for name, target in f.links.items():
        link(f.path / name, f.path.parent / target)
    for stale in os.listdir(f.path):
        if re.fullmatch(r"virtfn\d+", stale) and stale not in f.links:
            (f.path / stale).unlink()
    if f.group is not None:
        link(tree.groups / str(f.group) / "devices" / f.bdf, f.path)
        link(f.path / "iommu_group", tree.groups / str(f.group))
    else:
        (f.path / "iommu_group").unlink(missing_ok=True)
    override = f.path / "driver_override"
    if new or boot or not override.is_file():
        # A fresh function (or a fresh boot): on its native driver, with no override.
        tree.unbind(f.bdf)
        if boot:
            tree.remove_vfio_nodes(f.bdf, None)
        tree.bind(f.bdf, f.driver)
        tree.set_override(f.bdf, None)
    else:
        bound = tree.driver_of(f.bdf)
        if bound is not None:
            link(tree.drivers / bound / f.bdf, f.path)
    sync_net(tree, f, tree.driver_of(f.bdf))


def sync_net(tree: SimTree, f: SimFunction, driver: str | None) -> None:
    """The function's netdev (`net/<ifname>/address`) exists while its NIC driver (`driver`, what it is
    or is about to be bound to) drives it, as on a real host: bound to vfio-pci, a VF has none."""
    if f.net is None:
        return
    netdir = f.path / "net"
    if driver == f.driver:
        function_dir(netdir / f.net[0], {"address": f.net[1]})
    else:
        shutil.rmtree(netdir, ignore_errors=True)


def _drivers(tree: SimTree, names: set[str]) -> None:
    """`bus/pci/drivers/<name>` with its command files (empty, as the kernel's read), `drivers_probe`,
    and the modules (`/sys/module/<module>`, which doctor's vfio-pci check looks for)."""
    for name in sorted(names):
        where = tree.drivers / name
        where.mkdir(parents=True, exist_ok=True)
        for command in COMMAND_FILES:
            if not (where / command).is_file():
                (where / command).touch()
        module = DRIVER_MODULES.get(name, "")
        if module:
            (tree.sys / "module" / module / "drivers").mkdir(parents=True, exist_ok=True)
            link(tree.sys / "module" / module / "drivers" / f"pci:{name}", where)
            link(where / "module", tree.sys / "module" / module)
    for command in ("drivers_probe",):
        if not (tree.pci / command).is_file():
            (tree.pci / command).touch()
    function_dir(tree.pci, {"drivers_autoprobe": "1"})
    (tree.sys / "module" / "vfio").mkdir(parents=True, exist_ok=True)


def _driver_gpus(profile: SimProfile, top: Path) -> None:
    # /proc/driver/nvidia/gpus/<bus id>/information, the lines of it discovery reads.
    top.mkdir(parents=True, exist_ok=True)
    for gpu in profile.gpus:
        function_dir(top / gpu.bus_id, {"information": (
            f"Model: \t\t {gpu.name}\nGPU UUID: \t {gpu.uuid}\nBus Location: \t {gpu.bus_id}\n"
            f"Device Minor: \t {gpu.minor}")})
    for stale in set(os.listdir(top)) - {g.bus_id for g in profile.gpus}:
        shutil.rmtree(top / stale, ignore_errors=True)


def _proc_devices(proc: Path) -> None:
    # /proc/devices: the character and block majors the kernel's drivers registered, as the kernel
    # prints them. The agent reads the dynamic one of nvidia-caps there to make MIG capability nodes.
    chars = [(1, "mem"), (5, "/dev/tty"), (10, "misc"), (NVIDIA_MAJOR, "nvidia-frontend"), (UVM_MAJOR, "nvidia-uvm"),
             (VFIO_GROUP_MAJOR, "vfio"), (CAPS_MAJOR, "nvidia-caps")]
    text = "Character devices:\n" + "".join(f"{n:3d} {name}\n" for n, name in sorted(chars))
    text += "\nBlock devices:\n  7 loop\n  8 sd\n"
    proc.mkdir(parents=True, exist_ok=True)
    function_dir(proc, {"devices": text.rstrip("\n")})


def _device_nodes(profile: SimProfile, dev: Path, boot: bool, *, nvidia: bool = True) -> None:
    dev.mkdir(parents=True, exist_ok=True)
    if nvidia:
        _nvidia_nodes(profile, dev)
    else:
        _remove_nvidia_nodes(dev)
    device_node(dev / "vfio" / "vfio", *VFIO_MISC)
    if profile.iommufd:
        device_node(dev / "iommu", *IOMMUFD_MISC)
    else:
        (dev / "iommu").unlink(missing_ok=True)
        shutil.rmtree(dev / "vfio" / "devices", ignore_errors=True)
    if boot:
        # The kernel forgot every VFIO binding: no group or device nodes survive.
        for name in os.listdir(dev / "vfio"):
            if name.isdigit():
                (dev / "vfio" / name).unlink()
        shutil.rmtree(dev / "vfio" / "devices", ignore_errors=True)


def _nvidia_nodes(profile: SimProfile, dev: Path) -> None:
    """The NVIDIA driver's device nodes: one per GPU, its control node and UVM's."""
    nodes = {f"nvidia{g.minor}": (NVIDIA_MAJOR, g.minor) for g in profile.gpus}
    nodes |= {"nvidiactl": (NVIDIA_MAJOR, NVIDIACTL_MINOR), "nvidia-uvm": (UVM_MAJOR, 0),
              "nvidia-uvm-tools": (UVM_MAJOR, 1)}
    for name, (major, minor) in nodes.items():
        device_node(dev / name, major, minor)
    for stale in os.listdir(dev):
        if re.fullmatch(r"nvidia\d+", stale) and stale not in nodes:
            (dev / stale).unlink(missing_ok=True)


def _remove_nvidia_nodes(dev: Path) -> None:
    """Every node the NVIDIA driver made (`nvidia*`, and the MIG capability nodes in `nvidia-caps/`)."""
    for name in os.listdir(dev):
        path = dev / name
        if not name.startswith("nvidia"):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def unload_driver(root: Path) -> bool:
    """The NVIDIA driver unloaded, as its container does when it stops (`agent.sim.driver`): every simulated
    NVML on the machine stops answering, its device nodes and its GPU list in procfs go. False: it was not
    loaded."""
    driver = read_driver(root)
    if not driver.loaded:
        return False
    write_driver(root, Driver(False, driver.load))  # first: NVML fails before a node is seen missing
    tree = SimTree(root)
    if tree.dev.is_dir():
        _remove_nvidia_nodes(tree.dev)
    shutil.rmtree(root / "proc" / "driver" / "nvidia", ignore_errors=True)
    return True


def load_driver(profile: SimProfile, root: Path) -> bool:
    """The NVIDIA driver loaded again (a new load): its GPU list and device nodes back, then NVML answers
    (a session opened before the unload is over: it must be initialized again). False: it was loaded."""
    driver = read_driver(root)
    if driver.loaded:
        return False
    profile = machine_profile(profile, root)
    tree = SimTree(root)
    # A load initializes every GPU, as a reset does: none needs a recovery action (`agent.sim.events`).
    (root / RECOVERY_ACTIONS).unlink(missing_ok=True)
    _driver_gpus(profile, root / "proc" / "driver" / "nvidia" / "gpus")
    tree.dev.mkdir(parents=True, exist_ok=True)
    _nvidia_nodes(profile, tree.dev)
    write_driver(root, Driver(True, driver.load + 1))
    return True

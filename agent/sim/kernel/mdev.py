"""The simulated machine's mediated devices (vGPU): the types its NVIDIA host driver offers, and the
kernel's side of `create` and `remove`.

On a host with NVIDIA's vGPU manager, each supported GPU lists its vGPU types under
`<GPU>/mdev_supported_types/<type id>/` (also reachable as `/sys/class/mdev_bus/<bus id>/...`): `name`
(`GRID H100-4C`), `description` (framebuffer and instance limit, as the driver writes it),
`device_api` (`vfio-pci`), `available_instances`, and `create`, which makes a mediated device from a
UUID written to it. The device is `<GPU>/<uuid>/` (`/sys/bus/mdev/devices/<uuid>` links to it) with
`mdev_type` (a link to its type), `remove` (write 1) and its own IOMMU group, whose
`/dev/vfio/<group>` node QEMU opens.

The driver's rule, which this emulates: one GPU hosts vGPUs of one type at a time (time-sliced vGPU;
every type here has its own framebuffer size). With none created, each type offers its limit; once
one exists, its type offers the limit minus those created and every other type 0.

Which GPUs offer types: those whose PCI device ID has a table here (`VGPU_TABLES`: the H100 SXM5
80GB, 10de:2330, as in the builtin profiles). The type IDs and the framebuffer of each type are
plausible values for the simulation, not a copy of any driver's list.

Where the types are listed: on a GPU with SR-IOV VFs (Ampere and later: the vGPU manager's
`sriov-manage -e` enables them, profile key `vgpuVfs`), on each VF, never on the GPU itself: each VF
lists every type under its own `mdev_supported_types`, hosts at most one vGPU (its
`available_instances` is 0 or 1), and is the parent of the mediated device made on it; the rule of
one type per GPU and each type's limit hold across all VFs of the GPU. On a GPU without VFs (older
GPUs), on the GPU. That is the mdev interface of NVIDIA's vGPU managers up to their move to a
vendor-specific VFIO interface (`<VF>/nvidia/creatable_vgpu_types` and `current_vgpu_type`), which is
not modelled.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from agent.sim.kernel.tree import VFIO_GROUP_MAJOR, SimTree, device_node, function_dir, link
from agent.sim.profiles import SimProfile

NVIDIA_HOST_DRIVER = "nvidia"  # the parent must be bound to it: its types go when it is unbound
MDEV_DRIVER = "vfio_mdev"
TYPES_DIR = "mdev_supported_types"
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


@dataclass(frozen=True, slots=True)
class SimVgpuType:
    """A row of the simulated vGPU manager's type table: what it lists under `mdev_supported_types`.
    (Discovery reads such a listing as `agent.host.mdev.sysfs.MdevType` and publishes the type as
    `agent.facts.VgpuType`.)"""

    id: str  # the directory name: nvidia-1021
    name: str  # GRID H100-4C
    framebuffer_mib: int
    max_instances: int

    def description(self) -> str:
        # The fields NVIDIA's driver lists, in its form.
        return (f"num_heads=1, frl_config=60, framebuffer={self.framebuffer_mib}M, "
                f"max_resolution=4096x2160, max_instance={self.max_instances}")


def _h100_80gb() -> tuple[SimVgpuType, ...]:
    sizes = (4, 8, 10, 20, 40, 80)  # GiB of framebuffer; the limit is what fits in 80 GB
    return tuple(SimVgpuType(f"nvidia-{1021 + i}", f"GRID H100-{gb}C", gb * 1024, 80 // gb)
                 for i, gb in enumerate(sizes))


# PCI device ID (vendor 10de) -> the vGPU types the host driver offers on it.
VGPU_TABLES: dict[int, tuple[SimVgpuType, ...]] = {0x2330: _h100_80gb()}


def types_for(files: dict[str, str]) -> tuple[SimVgpuType, ...]:
    """The types a function with these sysfs `vendor`/`device` values offers (none for others)."""
    try:
        vendor, device = int(files.get("vendor", "0"), 16), int(files.get("device", "0"), 16)
    except ValueError:
        return ()
    return VGPU_TABLES.get(device, ()) if vendor == 0x10DE else ()


def mdev_devices(tree: SimTree) -> Path:
    return tree.sys / "bus" / "mdev" / "devices"


def mdev_bus(tree: SimTree) -> Path:
    return tree.sys / "class" / "mdev_bus"


def mdevs_of(tree: SimTree, bdf: str) -> dict[str, str]:
    """UUID -> type id of each mediated device of the parent `bdf`."""
    out = {}
    parent = tree.function(bdf)
    try:
        entries = os.listdir(parent)
    except OSError:
        return {}
    for name in entries:
        if UUID_RE.match(name):
            try:
                out[name] = os.path.basename(os.readlink(parent / name / "mdev_type"))
            except OSError:
                continue
    return out


def vgpu_parents(tree: SimTree, gpu: str) -> list[str]:
    """The functions that list GPU `gpu`'s vGPU types: its SR-IOV VFs when it has any, else itself."""
    where = tree.function(gpu)
    try:
        vfs = sorted((n for n in os.listdir(where) if n.startswith("virtfn") and n[6:].isdigit()),
                     key=lambda n: int(n[6:]))
    except OSError:
        return [gpu]
    return [os.path.basename(os.readlink(where / n)) for n in vfs] or [gpu]


def gpu_of(tree: SimTree, bdf: str) -> str:
    """The GPU a parent belongs to: a VF's PF, or the function itself."""
    try:
        return os.path.basename(os.readlink(tree.function(bdf) / "physfn"))
    except OSError:
        return bdf


def available(kinds: tuple[SimVgpuType, ...], existing: dict[str, str], type_id: str,
              own: int | None = None) -> int:
    """The driver's rule: one type per GPU at a time, up to its limit (`existing`: the GPU's mediated
    devices, on all of its VFs); a VF (`own`: how many it hosts) hosts one."""
    t = next((k for k in kinds if k.id == type_id), None)
    if t is None:
        return 0
    if any(other != type_id for other in existing.values()):
        return 0
    left = max(t.max_instances - sum(1 for other in existing.values() if other == type_id), 0)
    return left if own is None else min(left, 1 - min(own, 1))


def gpu_mdevs(tree: SimTree, bdf: str) -> dict[str, str]:
    """UUID -> type id of each mediated device of the GPU parent `bdf` belongs to (all its VFs)."""
    out: dict[str, str] = {}
    for parent in vgpu_parents(tree, gpu_of(tree, bdf)):
        out |= mdevs_of(tree, parent)
    return out


def sync_types(tree: SimTree, bdf: str, kinds: tuple[SimVgpuType, ...], *,
               without: frozenset[str] = frozenset()) -> None:
    """Write the type directories of every parent of `bdf`'s GPU (each VF, or the GPU), each
    `available_instances` as the driver would show it (`without`: devices being removed)."""
    gpu = gpu_of(tree, bdf)
    parents = vgpu_parents(tree, gpu)
    existing = {u: t for u, t in gpu_mdevs(tree, gpu).items() if u not in without}
    for name in parents:
        parent = tree.function(name)
        own = len(set(mdevs_of(tree, name)) - without) if name != gpu else None
        for t in kinds:
            where = parent / TYPES_DIR / t.id
            function_dir(where, {"name": t.name, "description": t.description(), "device_api": "vfio-pci"})
            _show(where / "available_instances", str(available(kinds, existing, t.id, own)))
            (where / "devices").mkdir(exist_ok=True)
            if not (where / "create").is_file():
                (where / "create").touch()
        link(mdev_bus(tree) / name, parent)
    if parents != [gpu]:  # a GPU whose VFs list the types lists none itself
        shutil.rmtree(tree.function(gpu) / TYPES_DIR, ignore_errors=True)
        (mdev_bus(tree) / gpu).unlink(missing_ok=True)


def materialize(profile: SimProfile, root: Path, *, boot: bool = False) -> None:
    """The mdev side of the simulated machine (after `nvml_hardware.materialize`): every GPU with a
    type table offers its types; existing mediated devices are kept (their IOMMU groups made again,
    which the PCI tree's rewrite drops as unknown to the profile), and with `boot` forgotten."""
    tree = SimTree(root)
    mdev_devices(tree).mkdir(parents=True, exist_ok=True)
    (tree.sys / "bus" / "mdev" / "drivers" / MDEV_DRIVER).mkdir(parents=True, exist_ok=True)
    mdev_bus(tree).mkdir(parents=True, exist_ok=True)
    ungrouped: list[Path] = []  # finished cut-short creates: a new group once every kept one is back
    for gpu in profile.gpus:
        if not gpu.in_sysfs or not (tree.devices / gpu.bus_id).exists():
            continue
        files = {"vendor": f"0x{gpu.pci_device_id & 0xFFFF:04x}", "device": f"0x{gpu.pci_device_id >> 16:04x}"}
        kinds = types_for(files)
        for parent in vgpu_parents(tree, gpu.bus_id):
            _finish_cut_creates(tree, parent)
            for u in list(mdevs_of(tree, parent)):
                where = tree.function(parent) / u
                if boot or not kinds:
                    remove(tree, where)
                elif _group_of(where) is None:
                    ungrouped.append(where)
                else:
                    _give_group(tree, u, where)
        if kinds:
            sync_types(tree, gpu.bus_id, kinds)
    # Only now is every kept device's group back in iommu_groups/: the lowest free number is free.
    for where in ungrouped:
        _give_group(tree, where.name, where)
    # Links to devices of a GPU the profile no longer has.
    for name in os.listdir(mdev_devices(tree)):
        if not (mdev_devices(tree) / name).exists():
            (mdev_devices(tree) / name).unlink()


def check_create(tree: SimTree, bdf: str, kinds: tuple[SimVgpuType, ...], type_id: str, text: str) -> str:
    """Why the kernel refuses writing `text` to the type's `create` ("" when it accepts it)."""
    if tree.driver_of(bdf) != NVIDIA_HOST_DRIVER:
        return f"the parent is bound to {tree.driver_of(bdf) or 'no driver'}, not {NVIDIA_HOST_DRIVER}"
    if not UUID_RE.match(text):
        return f"{text!r} is not a UUID (EINVAL)"
    if (mdev_devices(tree) / text).exists():
        return f"mdev {text} already exists (EEXIST)"
    if not any(k.id == type_id for k in kinds):
        return f"type {type_id} is not offered"
    if gpu_of(tree, bdf) == bdf and vgpu_parents(tree, bdf) != [bdf]:
        return "the GPU lists no vGPU types itself: they are on its SR-IOV VFs"
    own = len(mdevs_of(tree, bdf)) if gpu_of(tree, bdf) != bdf else None  # a VF hosts one
    if available(kinds, gpu_mdevs(tree, bdf), type_id, own) <= 0:
        return f"no instance of {type_id} is available (another type is in use, or its limit is reached)"
    return ""


def create(tree: SimTree, bdf: str, kinds: tuple[SimVgpuType, ...], type_id: str, u: str) -> None:
    """Make mediated device `u` of `type_id` on `bdf` (already checked): the device, its type's entry,
    its own IOMMU group and VFIO group node; `bus/mdev/devices/<u>` last, as the kernel registers it."""
    parent = tree.function(bdf)
    where = parent / u
    where.mkdir()
    link(where / "mdev_type", parent / TYPES_DIR / type_id)
    (where / "remove").touch()
    link(where / "driver", tree.sys / "bus" / "mdev" / "drivers" / MDEV_DRIVER)
    link(parent / TYPES_DIR / type_id / "devices" / u, where)
    _give_group(tree, u, where)
    sync_types(tree, bdf, kinds)
    link(mdev_devices(tree) / u, where)


def remove(tree: SimTree, where: Path) -> None:
    """Remove the mediated device whose directory is `where` (below its parent's); its registration
    goes last, so an agent that sees it gone sees everything else done (as after the kernel's write)."""
    u = where.name
    group = _group_of(where)
    if group is not None:
        (tree.dev / "vfio" / str(group)).unlink(missing_ok=True)
        shutil.rmtree(tree.groups / str(group), ignore_errors=True)
    try:
        type_dir: Path | None = Path(os.path.realpath(where / "mdev_type"))
    except OSError:
        type_dir = None
    if type_dir is not None:
        (type_dir / "devices" / u).unlink(missing_ok=True)
    # The types' availability first, the device directory after: the registration dangles once it is gone,
    # and an agent that sees it gone must see the instance free again.
    bdf = where.parent.name
    if (tree.devices / bdf).exists():
        kinds = types_for({name: _read(tree.devices / bdf / name) for name in ("vendor", "device")})
        if kinds:
            sync_types(tree, bdf, kinds, without=frozenset({u}))
    shutil.rmtree(where, ignore_errors=True)
    (mdev_devices(tree) / u).unlink(missing_ok=True)


def _show(path: Path, text: str) -> None:
    """A value that changes while the agent reads it, replaced whole: a reader never sees it empty or
    half written, as a sysfs read never is."""
    if _read(path) == text and path.is_file():
        return
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(text + "\n")
    os.replace(staged, path)


def _finish_cut_creates(tree: SimTree, bdf: str) -> None:
    """Creates the emulator began and a kill cut short (it runs in the agent's process; a kernel
    never leaves one half done): one that got its type is finished, one that did not is undone."""
    parent = tree.function(bdf)
    try:
        names = [n for n in os.listdir(parent) if UUID_RE.match(n)]
    except OSError:
        return
    for u in names:
        where = parent / u
        try:
            type_dir = parent / TYPES_DIR / os.path.basename(os.readlink(where / "mdev_type"))
        except OSError:
            shutil.rmtree(where, ignore_errors=True)
            continue
        (where / "remove").touch()
        link(where / "driver", tree.sys / "bus" / "mdev" / "drivers" / MDEV_DRIVER)
        if type_dir.is_dir():
            (type_dir / "devices").mkdir(exist_ok=True)
            link(type_dir / "devices" / u, where)
        link(mdev_devices(tree) / u, where)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _group_of(where: Path) -> int | None:
    try:
        return int(os.path.basename(os.readlink(where / "iommu_group")))
    except (OSError, ValueError):
        return None


def _give_group(tree: SimTree, u: str, where: Path) -> None:
    """The mdev's IOMMU group (its own, the lowest free number, as the kernel's IDA hands them out)
    and `/dev/vfio/<group>`; an existing one is made whole again."""
    group = _group_of(where)
    if group is None:
        tree.groups.mkdir(parents=True, exist_ok=True)
        taken = {int(n) for n in os.listdir(tree.groups) if n.isdigit()}
        group = next(i for i in range(len(taken) + 1) if i not in taken)
    link(tree.groups / str(group) / "devices" / u, where)
    link(where / "iommu_group", tree.groups / str(group))
    device_node(tree.dev / "vfio" / str(group), VFIO_GROUP_MAJOR, group)


__all__ = ["UUID_RE", "VGPU_TABLES", "SimVgpuType", "available", "check_create", "create", "gpu_mdevs", "gpu_of",
           "materialize", "mdevs_of", "remove", "types_for", "vgpu_parents"]

"""Mediated devices through sysfs: the types a parent offers, and creating, finding and removing a
device. The same code runs on a host and on the simulated machine (whose kernel emulator applies
the writes a moment later: every write is followed by a bounded wait for its effect).

Paths below the sysfs root (`/sys` on a host):

- `class/mdev_bus/<bus id>`: each parent device (a link to its directory), as the vendor driver
  registers it;
- `bus/pci/devices/<bus id>/mdev_supported_types/<type id>/`: `name`, `description`, `device_api`,
  `available_instances`, `create` (write a UUID), `devices/` (links to that type's devices);
- `bus/mdev/devices/<uuid>`: each mediated device (a link into its parent's directory), with
  `mdev_type` (a link to its type), `remove` (write 1) and `iommu_group`.

A GPU's vGPU types are listed on the GPU itself (GPUs without SR-IOV), or, on a GPU whose vGPU manager
enabled SR-IOV (Ampere and later: `sriov-manage -e`), on each of its VFs (`virtfn<n>`), never on the
GPU: each VF lists every type and hosts one vGPU, which is made on it (the VF is the mediated device's
parent). `vgpu_parents`, `gpu_types`, `gpu_mdevs` and `parent_for` answer for a GPU either way; the
vendor-specific VFIO interface of later vGPU managers (`<VF>/nvidia/creatable_vgpu_types`) is not read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.host.mdev.errors import MdevStepFailed
from agent.host.vfio.pci import virtual_functions
from agent.model import DeviceNode
from agent.workslots import take, wait_until

DEFAULT_TIMEOUT = 10.0  # seconds for a create or remove to show
_POLL = 0.01
MIB = 1 << 20
TYPES_DIR = "mdev_supported_types"
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_FRAMEBUFFER = re.compile(r"\bframebuffer=(\d+)M\b")
_MAX_INSTANCE = re.compile(r"\bmax_instance=(\d+)\b")
# One create or remove at a time in this process: a type's `create` file is shared by every claim
# asking for that type, and the simulated kernel reads a write back from the file. Held while the
# effect is waited for, which lets the claim's slot go (`agent.workslots`): so must a wait for the lock.
_WRITES = threading.Lock()


@contextlib.contextmanager
def _writing() -> Iterator[None]:
    take(_WRITES)
    try:
        yield
    finally:
        _WRITES.release()


@dataclass(frozen=True, slots=True)
class MdevType:
    """One type a parent offers, as sysfs shows it now."""

    id: str  # nvidia-1021
    name: str  # GRID H100-4C ("" when the driver gives none)
    device_api: str  # vfio-pci
    available: int  # available_instances now
    framebuffer: int | None  # bytes, from NVIDIA's description (None: not said)
    max_instances: int | None  # from NVIDIA's description (None: not said)


def types_dir(sysfs: Path, parent: str) -> Path:
    return sysfs / "bus" / "pci" / "devices" / parent / TYPES_DIR


def device_dir(sysfs: Path, uuid: str) -> Path:
    return sysfs / "bus" / "mdev" / "devices" / uuid


def parents(sysfs: Path) -> list[str]:
    """The bus IDs of every device whose driver offers mediated devices."""
    try:
        return sorted(os.listdir(sysfs / "class" / "mdev_bus"))
    except OSError:
        return []


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def read_type(sysfs: Path, parent: str, type_id: str) -> MdevType | None:
    """The type as the parent offers it now; None when it does not (or offers no types now)."""
    where = types_dir(sysfs, parent) / type_id
    try:
        available = int(_read(where / "available_instances"))
    except ValueError:
        return None
    description = _read(where / "description")
    fb, most = _FRAMEBUFFER.search(description), _MAX_INSTANCE.search(description)
    return MdevType(type_id, _read(where / "name"), _read(where / "device_api"), available,
                    int(fb.group(1)) * MIB if fb else None, int(most.group(1)) if most else None)


def list_types(sysfs: Path, parent: str) -> list[MdevType]:
    """Every type the parent offers now, by id (empty when it offers none)."""
    try:
        names = sorted(os.listdir(types_dir(sysfs, parent)))
    except OSError:
        return []
    return [t for t in (read_type(sysfs, parent, n) for n in names) if t is not None]


def vgpu_parents(sysfs: Path, gpu: str) -> list[str]:
    """The functions that list GPU `gpu`'s vGPU types: its SR-IOV VFs that list them, else the GPU."""
    return [vf for vf in virtual_functions(sysfs, gpu) if types_dir(sysfs, vf).is_dir()] or [gpu]


def gpu_types(sysfs: Path, gpu: str) -> list[MdevType]:
    """Every type GPU `gpu` offers now, by id; where its VFs list them, each type's `available` is the sum
    over the VFs (each hosts one vGPU)."""
    parents = vgpu_parents(sysfs, gpu)
    if parents == [gpu]:
        return list_types(sysfs, gpu)
    by_id: dict[str, MdevType] = {}
    for vf in parents:
        for t in list_types(sysfs, vf):
            seen = by_id.get(t.id)
            by_id[t.id] = t if seen is None else dataclasses.replace(seen, available=seen.available + t.available)
    return [by_id[k] for k in sorted(by_id)]


def gpu_mdevs(sysfs: Path, gpu: str) -> dict[str, str]:
    """UUID -> type id of each mediated device GPU `gpu` hosts now (on itself or on its VFs)."""
    out: dict[str, str] = {}
    for parent in vgpu_parents(sysfs, gpu):
        out |= mdevs_of(sysfs, parent)
    return out


def parent_for(sysfs: Path, gpu: str, type_id: str) -> str | None:
    """Where a new vGPU of `type_id` on GPU `gpu` is made: the GPU, or its first VF with an instance of the
    type available; None when none has one."""
    for parent in vgpu_parents(sysfs, gpu):
        t = read_type(sysfs, parent, type_id)
        if t is not None and t.available > 0:
            return parent
    return None


def exists(sysfs: Path, uuid: str) -> bool:
    return device_dir(sysfs, uuid).exists()  # the link, and the device directory it leads to


def parent_of(sysfs: Path, uuid: str) -> str | None:
    """The bus ID of the device's parent (None: no such device)."""
    if not exists(sysfs, uuid):
        return None
    return Path(os.path.realpath(device_dir(sysfs, uuid))).parent.name


def type_of(sysfs: Path, uuid: str) -> str | None:
    try:
        return os.path.basename(os.readlink(device_dir(sysfs, uuid) / "mdev_type"))
    except OSError:
        return None


def iommu_group(sysfs: Path, uuid: str) -> int | None:
    try:
        return int(os.path.basename(os.readlink(device_dir(sysfs, uuid) / "iommu_group")))
    except (OSError, ValueError):
        return None


def mdevs_of(sysfs: Path, parent: str) -> dict[str, str]:
    """UUID -> type id of each mediated device the parent has now."""
    out: dict[str, str] = {}
    for t in list_types(sysfs, parent):
        try:
            names = os.listdir(types_dir(sysfs, parent) / t.id / "devices")
        except OSError:
            continue
        out |= {n: t.id for n in names if UUID_RE.match(n)}
    return out


def create(sysfs: Path, parent: str, type_id: str, uuid: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Make mediated device `uuid` of `type_id` on `parent`; nothing is written when it exists already
    (as that type, on that parent). MdevStepFailed when the kernel refuses or it does not show."""
    with _writing():
        if _is(sysfs, uuid, parent, type_id):
            return
        if exists(sysfs, uuid):
            raise MdevStepFailed(f"mdev {uuid} exists as {type_of(sysfs, uuid)} on {parent_of(sysfs, uuid)}, "
                                 f"not as {type_id} on {parent}")
        command = types_dir(sysfs, parent) / type_id / "create"
        try:
            with command.open("w") as f:  # one write call, as the kernel takes it
                f.write(uuid)
        except OSError as exc:
            raise MdevStepFailed(f"{parent}: writing {uuid} to {type_id}/create was refused: "
                                 f"{errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror})") from exc
        _wait(lambda: _is(sysfs, uuid, parent, type_id), timeout,
              lambda: f"{parent}: mdev {uuid} of {type_id} did not appear within {timeout:g}s "
                      f"({_availability(sysfs, parent, type_id)}; the kernel log says why it refused)")


def remove(sysfs: Path, uuid: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Remove mediated device `uuid`; nothing to do when it is not there. MdevStepFailed when it stays
    (a VM still holds it open: the kernel refuses with EBUSY)."""
    with _writing():
        if not exists(sysfs, uuid):
            return
        try:
            with (device_dir(sysfs, uuid) / "remove").open("w") as f:
                f.write("1")
        except FileNotFoundError:
            return  # removed meanwhile
        except OSError as exc:
            raise MdevStepFailed(f"mdev {uuid}: remove was refused: {errno.errorcode.get(exc.errno or 0, exc.errno)} "
                                 f"({exc.strerror}); is a VM still using it?") from exc
        _wait(lambda: not exists(sysfs, uuid), timeout,
              lambda: f"mdev {uuid} is still there {timeout:g}s after its remove (the kernel log says why)")


def pending_create(sysfs: Path, parent: str, type_id: str, uuid: str) -> bool:
    """Whether the type's `create` file still holds `uuid`: a write the simulated kernel has not taken
    yet (a host's kernel acts inside the write, and its file reads back empty)."""
    return _read(types_dir(sysfs, parent) / type_id / "create") == uuid


def wait_created(sysfs: Path, parent: str, type_id: str, uuid: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Wait (bounded) while a write of `uuid` to the type's `create` is pending, so that a removal after
    a crash does not miss a device that appears a moment later."""
    deadline = time.monotonic() + timeout
    wait_until(lambda: not pending_create(sysfs, parent, type_id, uuid) or exists(sysfs, uuid), deadline, _POLL)


def vfio_nodes(sysfs: Path, dev_root: Path, uuid: str) -> tuple[DeviceNode, ...]:
    """The VFIO nodes QEMU needs for the device: the container and its own IOMMU group's node.
    MdevStepFailed naming what is missing."""
    group = iommu_group(sysfs, uuid)
    if group is None:
        raise MdevStepFailed(f"mdev {uuid} has no IOMMU group (is it there, and bound to vfio_mdev?)")
    nodes = (DeviceNode("/dev/vfio/vfio", str(dev_root / "vfio" / "vfio")),
             DeviceNode(f"/dev/vfio/{group}", str(dev_root / "vfio" / str(group))))
    missing = [n.host_path for n in nodes if not os.path.exists(n.host_path)]
    if missing:
        raise MdevStepFailed(f"mdev {uuid}: VFIO device nodes missing on the host: {', '.join(missing)}")
    return nodes


def _is(sysfs: Path, uuid: str, parent: str, type_id: str) -> bool:
    return exists(sysfs, uuid) and parent_of(sysfs, uuid) == parent and type_of(sysfs, uuid) == type_id


def _availability(sysfs: Path, parent: str, type_id: str) -> str:
    t = read_type(sysfs, parent, type_id)
    return "the type is not offered now" if t is None else f"available_instances is {t.available}"


def _wait(done: Callable[[], bool], timeout: float, why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    if not wait_until(done, deadline, _POLL):
        raise MdevStepFailed(why())

"""A small kernel for the simulated machine: applies driver-binding writes to its sysfs as Linux does.

The agent binds a PCI function to vfio-pci by writing sysfs files (`driver_override`,
`drivers/<drv>/unbind`, `drivers/<drv>/bind`, `drivers_probe`); on a real host the kernel acts
inside the write. Here an inotify watch (`agent.inotify.WatchThread`) sees each write when the file
is closed and applies it on its own thread, so the effect shows a moment later: the agent's code waits (bounded) for the
`driver` link either way, and runs unchanged on both.

What it does, per write (the content is a bus ID, except for `driver_override` and `new_id`):

- `driver_override`: set (shown with a newline) or cleared (shown as `(null)`, as the kernel shows a
  PCI function without one). Binding is not touched.
- `drivers/<drv>/unbind`: the function's `driver` link and the driver's entry go; leaving vfio-pci
  also removes its `vfio-dev/vfioN` and `/dev/vfio/devices/vfioN`, and `/dev/vfio/<group>` once no
  function of the group is bound to vfio-pci. The override stays, as in the kernel.
- `drivers/<drv>/bind`: binds when the function is unbound and the driver matches it: with an
  override only that driver matches; without one, its native driver (the profile's) or a driver
  given its vendor and device through `new_id`. vfio-pci makes `/dev/vfio/<group>` and, when the
  profile has iommufd, `vfio-dev/vfioN` and `/dev/vfio/devices/vfioN`.
- `drivers_probe`: binds an unbound function to its override, or else its native driver.
- `drivers/<drv>/new_id` (`"vvvv dddd"`): the driver now matches that ID, and unbound functions with
  it are probed, as the kernel does; `remove_id` forgets it.

Mediated devices (vGPU, `agent.sim.kernel.mdev`), per write:

- `<GPU>/mdev_supported_types/<type>/create` (a UUID): the mediated device appears, with its own IOMMU
  group and `/dev/vfio/<group>`; the types' `available_instances` follow the driver's rule (one type
  per GPU at a time). Refused: a parent not on its NVIDIA driver, a malformed or taken UUID, a type
  with no instance available.
- `<GPU>/<uuid>/remove` (`1`): the mediated device and its group go.

A write the kernel would refuse with an errno cannot fail here (the file write already succeeded),
so a refusal is reported the way an operator sees it on a real host besides the errno: nothing
changes (the function stays unbound, or on its driver), and a line saying why goes to the simulated
kernel log (`<root>/kmsg.log`, see `SimTree.kernel_log`) and to `KernelEmulator.refusals`. The
agent detects it as it detects any refusal: reading the `driver` link back, which never shows the
target. Refused: bind of a function that is bound, or that the driver does not match; unbind from a
driver the function is not bound to; bind to vfio-pci while another function of its IOMMU group is
held by a host driver (not vfio-pci, not a bridge); unbind of a GPU from nvidia while it has mediated
devices. That last refusal is stricter than Linux, which
lets the bind succeed and makes the group unusable (not viable) when QEMU opens it: the emulator
surfaces the same mistake at the step that caused it.

An unbind of a GPU from nvidia waits while the GPU is open, as the NVIDIA driver's does
(`agent.sim.kernel.opengpus`).

A driver whose remove is slow (a GPU's driver tearing down its state takes seconds) is `unbind_hold`:
called with the function's bus ID on a thread of its own for each unbind the emulator accepts, the
unbind takes effect once it returns. Only that function waits: the kernel's device lock is the
function's, so other functions' writes go on meanwhile. `DRA_SIM_UNBIND_DELAY=SECONDS` in the
running agent's environment holds every unbind that long (`unbind_hold_from_env`; `make bench`'s
slow-device figure).

Every command file is emptied after its write is applied (the kernel's read back empty). Tests make
it slow (`delay` seconds before each write) or make a given write fail (`fail`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from agent.inotify import IN_CLOSE_WRITE, Event, WatchThread
from agent.sim.hardware import SimFunction, machine_profile, sim_functions, sync_net
from agent.sim.kernel import mdev
from agent.sim.kernel.opengpus import OpenGpus
from agent.sim.kernel.tree import COMMAND_FILES, NO_OVERRIDE, VFIO_PCI, SimTree
from agent.sim.profiles import SimProfile

log = logging.getLogger(__name__)

UNBIND_DELAY_ENV = "DRA_SIM_UNBIND_DELAY"
UnbindHold = Callable[[str], None]  # returns once the driver has let go of the function (its bus ID)


class WriteKind(StrEnum):
    OVERRIDE = "driver_override"
    BIND = "bind"
    UNBIND = "unbind"
    PROBE = "drivers_probe"
    NEW_ID = "new_id"
    REMOVE_ID = "remove_id"
    MDEV_CREATE = "create"  # a type's create: a new mediated device of the parent `bdf`
    MDEV_REMOVE = "remove"  # a mediated device's remove


@dataclass(frozen=True)
class Refusal:
    """A write the simulated kernel refused, and why (what a real kernel's errno and dmesg would say)."""

    kind: WriteKind
    bdf: str
    driver: str | None
    reason: str

    def __str__(self) -> str:
        target = f" {self.driver}" if self.driver else ""
        return f"{self.kind}{target} {self.bdf}: {self.reason}"


@dataclass
class _Fault:
    kind: WriteKind
    bdf: str | None
    times: int
    reason: str


@dataclass(frozen=True)
class _Write:
    kind: WriteKind
    path: Path
    driver: str | None  # the driver directory written in (bind, unbind, new_id, remove_id)
    bdf: str | None  # the function whose driver_override was written; a mediated device's parent


class KernelEmulator:
    """Watches the simulated machine under `root` and applies binding writes; `start` before the agent
    writes, `stop` at the end (also a context manager)."""

    def __init__(self, profile: SimProfile, root: Path, *, delay: float = 0.0,
                 unbind_hold: UnbindHold | None = None) -> None:
        self.tree = SimTree(root)
        self.delay = delay  # seconds before each write takes effect: a slow kernel
        self.unbind_hold = unbind_hold  # a slow driver remove, per function (the module's docstring)
        self._held: dict[str, threading.Thread] = {}  # bus ID -> the thread carrying its held unbind out
        profile = machine_profile(profile, root)  # (without the GPUs that did not come back in this boot)
        self._native: dict[str, SimFunction] = {f.bdf: f for f in sim_functions(profile, self.tree)}
        self._cdevs = profile.iommufd
        self._dynamic_ids: dict[str, set[tuple[str, str]]] = {}
        # Each function's override as last applied, to put back when a write of it is refused.
        self._overrides: dict[str, str | None] = {b: self.tree.override_of(b) for b in self._native}
        self._faults: list[_Fault] = []
        self._refusals: list[Refusal] = []
        self._lock = threading.Lock()  # one write at a time, as the kernel's device lock makes them
        self._watch: WatchThread | None = None
        self._open_gpus = OpenGpus(self.tree, {g.bus_id: g.minor for g in profile.gpus}, self._lock,
                                   lambda bdf: self._detach(bdf, mdev.NVIDIA_HOST_DRIVER))

    # -- control ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Arm the watches (writes from here on are seen), then apply writes left in command files
        while no emulator ran."""
        watch = WatchThread(self._on_event, "sim-kernel")
        watch.add(str(self.tree.sys / "devices"), recursive=True)
        # Not recursive: drivers/<drv>/ holds links to function directories, which the watch above
        # already covers; watching through them too would deliver each write twice.
        watch.add(str(self.tree.pci))
        for driver in sorted(p for p in self.tree.drivers.iterdir() if p.is_dir()):
            watch.add(str(driver))
        watch.start()  # the inotify watches exist already
        self._watch = watch
        for driver in self.tree.drivers.iterdir():
            for command in COMMAND_FILES:
                self._on_write(driver / command)
        self._on_write(self.tree.pci / WriteKind.PROBE)
        for bdf in sorted(self._native):
            parent = self.tree.devices / bdf
            for pending in (*parent.glob(f"{mdev.TYPES_DIR}/*/create"), *parent.glob("*-*-*-*-*/remove")):
                self._on_write(Path(os.path.realpath(pending)))
        log.info("simulated kernel: applying binding writes under %s", self.tree.sys)

    def stop(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        self._open_gpus.stop()
        with self._lock:
            held = list(self._held.values())
        for thread in held:
            thread.join(5.0)

    def __enter__(self) -> KernelEmulator:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def fail(self, kind: WriteKind, bdf: str | None = None, *, times: int = 1,
             reason: str = "injected failure") -> None:
        """Refuse the next `times` writes of `kind` (about `bdf`, or any function)."""
        with self._lock:
            self._faults.append(_Fault(kind, bdf, times, reason))

    @property
    def refusals(self) -> list[Refusal]:
        with self._lock:
            return list(self._refusals)

    # -- writes ----------------------------------------------------------------------------------

    def _classify(self, path: Path) -> _Write | None:
        if path.name == WriteKind.OVERRIDE and path.parent.name in self._native:
            return _Write(WriteKind.OVERRIDE, path, None, path.parent.name)
        if path == self.tree.pci / WriteKind.PROBE:
            return _Write(WriteKind.PROBE, path, None, None)
        if path.parent.parent == self.tree.drivers and path.name in COMMAND_FILES:
            return _Write(WriteKind(path.name), path, path.parent.name, None)
        if path.name == WriteKind.MDEV_CREATE and path.parent.parent.name == mdev.TYPES_DIR \
                and path.parent.parent.parent.name in self._native:
            return _Write(WriteKind.MDEV_CREATE, path, None, path.parent.parent.parent.name)
        if path.name == WriteKind.MDEV_REMOVE and mdev.UUID_RE.match(path.parent.name) \
                and path.parent.parent.name in self._native:
            return _Write(WriteKind.MDEV_REMOVE, path, None, path.parent.parent.name)
        return None

    def _on_event(self, event: Event) -> None:  # the watch's thread
        # A write is complete when its file is closed; reads (closed without writing) are not writes.
        if event.mask & IN_CLOSE_WRITE and not event.is_dir:
            try:
                self._on_write(Path(event.path))
            except OSError:
                # A tree changed under the write (a test removing the machine): this write is lost, as
                # it would be on a host whose device went away; the watch must keep running.
                log.exception("simulated kernel: could not apply the write to %s", event.path)

    def _on_write(self, path: Path) -> None:  # the watch's thread
        write = self._classify(path)
        if write is None:
            return
        with self._lock:
            try:
                raw = path.read_text()
            except OSError:
                return
            text = raw.strip()
            if write.kind is WriteKind.OVERRIDE:
                assert write.bdf is not None
                if raw == "":
                    # Truncated by a writer whose bytes have not landed yet (the kernel takes a write in one
                    # call; a file is opened, emptied, then written): its own event follows. Taking the
                    # empty file for a clear and rewriting it would swallow that write.
                    return
                override = None if text in ("", NO_OVERRIDE) else text
                # Judged on the one read above: reading again could see the agent's next write, and
                # rewriting the file after it would swallow that write.
                if raw == f"{override or NO_OVERRIDE}\n":
                    self._overrides[write.bdf] = override
                    return  # already as the kernel shows it (our own rewrite's event)
                self._pause()
                if self._injected(write.kind, write.bdf, None):
                    override = self._overrides.get(write.bdf)  # a refused write leaves the old value
                self._overrides[write.bdf] = override
                self.tree.set_override(write.bdf, override, written=raw)
                return
            if not text:
                return  # emptied after the last write: nothing new
            # Emptied before the write takes effect: a writer that waits for the effect and then writes
            # the next command to the same file must not see it wiped.
            path.write_text("")
            self._pause()
            self._command(write, text)

    def _pause(self) -> None:
        if self.delay > 0:
            time.sleep(self.delay)

    def _command(self, write: _Write, text: str) -> None:
        if write.kind in (WriteKind.MDEV_CREATE, WriteKind.MDEV_REMOVE):
            self._mdev(write, text)
            return
        driver = write.driver
        if write.kind in (WriteKind.NEW_ID, WriteKind.REMOVE_ID):
            assert driver is not None
            self._ids(write.kind, driver, text)
            return
        bdf = text
        if self._injected(write.kind, bdf, driver):
            return
        if bdf not in self._native or not (self.tree.devices / bdf).is_symlink():
            self._refuse(write.kind, bdf, driver, "no such PCI function")
        elif write.kind is WriteKind.UNBIND:
            assert driver is not None
            self._unbind(bdf, driver)
        elif write.kind is WriteKind.BIND:
            assert driver is not None
            self._bind(WriteKind.BIND, bdf, driver)
        elif self.tree.driver_of(bdf) is None:  # drivers_probe of a bound function changes nothing
            self._bind(WriteKind.PROBE, bdf, self.tree.override_of(bdf) or self._native[bdf].driver)

    def _mdev(self, write: _Write, text: str) -> None:
        assert write.bdf is not None
        bdf, where = write.bdf, write.path.parent
        if self._injected(write.kind, bdf, None):
            return
        if write.kind is WriteKind.MDEV_REMOVE:
            if text != "1":
                self._refuse(write.kind, bdf, None, f"mdev {where.name}: remove takes 1, not {text!r} (EINVAL)")
            elif where.is_dir():
                mdev.remove(self.tree, where)
            return
        kinds = mdev.types_for(self._native[bdf].files)
        type_id = where.name
        reason = mdev.check_create(self.tree, bdf, kinds, type_id, text)
        if reason:
            self._refuse(write.kind, bdf, None, f"{type_id}: {reason}")
        else:
            mdev.create(self.tree, bdf, kinds, type_id, text)

    def _unbind(self, bdf: str, driver: str) -> None:
        bound = self.tree.driver_of(bdf)
        if bound != driver:
            self._refuse(WriteKind.UNBIND, bdf, driver, f"not bound to {driver} (bound: {bound or 'none'})")
            return
        if driver == mdev.NVIDIA_HOST_DRIVER and (children := mdev.gpu_mdevs(self.tree, bdf)):
            # Stricter than Linux, whose driver removal waits for (or tears down) the mediated devices: the
            # emulator shows the mistake at the write that makes it.
            self._refuse(WriteKind.UNBIND, bdf, driver, f"it has mediated devices {', '.join(sorted(children))}")
            return
        if driver == mdev.NVIDIA_HOST_DRIVER and self._open_gpus.wait_for_close(bdf):
            return  # carried out by the waiter, once the GPU is closed
        if self.unbind_hold is not None:
            self._hold_unbind(bdf, driver, self.unbind_hold)
            return
        self._detach(bdf, driver)

    def _hold_unbind(self, bdf: str, driver: str, hold: UnbindHold) -> None:  # the emulator's lock held
        if bdf in self._held:
            return  # the driver is letting go of it already
        self.tree.log(f"unbind {driver} {bdf}: the driver's remove is slow")

        def remove() -> None:
            try:
                hold(bdf)
                with self._lock:
                    if self.tree.driver_of(bdf) == driver:  # else gone another way meanwhile
                        self._detach(bdf, driver)
            except OSError:
                log.exception("simulated kernel: the held unbind of %s failed", bdf)
            finally:
                with self._lock:
                    self._held.pop(bdf, None)

        thread = threading.Thread(target=remove, daemon=True, name=f"simulated slow unbind {bdf}")
        self._held[bdf] = thread
        thread.start()

    def _detach(self, bdf: str, driver: str) -> None:
        # The driver's remove runs before the link goes: once the agent sees the link gone, all is done.
        if driver == VFIO_PCI:
            self.tree.remove_vfio_nodes(bdf, self.tree.group_of(bdf))
        sync_net(self.tree, self._native[bdf], None)
        self.tree.unbind(bdf)

    def _bind(self, kind: WriteKind, bdf: str, driver: str) -> None:
        bound = self.tree.driver_of(bdf)
        override = self.tree.override_of(bdf)
        if bound is not None:
            self._refuse(kind, bdf, driver, f"already bound to {bound}")
        elif not (self.tree.drivers / driver).is_dir():
            self._refuse(kind, bdf, driver, f"no driver {driver} is loaded")
        elif override is not None and override != driver:
            self._refuse(kind, bdf, driver, f"driver_override is {override}: only that driver may bind")
        elif override is None and not self._matches(bdf, driver):
            self._refuse(kind, bdf, driver, f"{driver} does not match the function's vendor and device")
        elif driver == VFIO_PCI and (holder := self._host_held_neighbour(bdf)):
            self._refuse(kind, bdf, driver, holder)
        else:
            # The probe makes the driver's nodes before the link shows the binding, as in the kernel.
            group = self.tree.group_of(bdf)
            if driver == VFIO_PCI and group is not None:
                self.tree.add_vfio_nodes(bdf, group, self._cdevs)
            sync_net(self.tree, self._native[bdf], driver)
            self.tree.bind(bdf, driver)

    def _host_held_neighbour(self, bdf: str) -> str:
        group = self.tree.group_of(bdf)
        if group is None:
            return "the function is in no IOMMU group"
        for member in self.tree.group_members(group):
            holder = self.tree.driver_of(member)
            if member == bdf or holder in (None, VFIO_PCI) or self.tree.device_class(member) >> 16 == 0x06:
                continue
            return f"IOMMU group {group} member {member} is bound to host driver {holder}"
        return ""

    def _matches(self, bdf: str, driver: str) -> bool:
        if self._native[bdf].driver == driver:
            return True
        files = self._native[bdf].files
        pci_id = (files.get("vendor", "")[2:], files.get("device", "")[2:])
        return pci_id in self._dynamic_ids.get(driver, set())

    def _ids(self, kind: WriteKind, driver: str, text: str) -> None:
        fields = text.lower().split()
        if len(fields) < 2:
            self._refuse(kind, "", driver, f"{text!r} is not 'vendor device' in hex")
            return
        pci_id = (fields[0].removeprefix("0x").zfill(4), fields[1].removeprefix("0x").zfill(4))
        ids = self._dynamic_ids.setdefault(driver, set())
        if kind is WriteKind.REMOVE_ID:
            ids.discard(pci_id)
            return
        ids.add(pci_id)
        for bdf in sorted(self._native):
            override = self.tree.override_of(bdf)
            if (self.tree.driver_of(bdf) is None and override in (None, driver) and self._matches(bdf, driver)
                    and (self.tree.devices / bdf).is_symlink()):
                self._bind(kind, bdf, driver)

    def _injected(self, kind: WriteKind, bdf: str, driver: str | None) -> bool:
        for fault in self._faults:
            if fault.kind is kind and fault.bdf in (None, bdf) and fault.times > 0:
                fault.times -= 1
                self._refuse(kind, bdf, driver, fault.reason)
                return True
        return False

    def _refuse(self, kind: WriteKind, bdf: str, driver: str | None, reason: str) -> None:
        refusal = Refusal(kind, bdf, driver, reason)
        self._refusals.append(refusal)
        self.tree.log(f"refused {refusal}")


def unbind_hold_from_env(env: dict[str, str] | None = None) -> UnbindHold | None:
    """Every unbind held `DRA_SIM_UNBIND_DELAY` seconds; None when it is unset or 0."""
    raw = (os.environ if env is None else env).get(UNBIND_DELAY_ENV, "").strip()
    try:
        seconds = float(raw or 0)
    except ValueError:
        raise ValueError(f"{UNBIND_DELAY_ENV}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        return None
    return lambda _bdf: time.sleep(seconds)


__all__ = ["UNBIND_DELAY_ENV", "KernelEmulator", "Refusal", "UnbindHold", "WriteKind", "unbind_hold_from_env"]

"""The simulated machine's sysfs and /dev layout, and the file operations that build and change it.

`agent.sim.hardware.materialize` writes the tree; `agent.sim.kernel.emulator` changes
it the way the kernel would. Both go through these helpers, so a function's driver binding and its
VFIO nodes look the same whoever made them.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Character device numbers. VFIO's group and device majors are dynamic on a real host: typical values.
VFIO_MISC = (10, 196)  # /dev/vfio/vfio, the legacy container (VFIO_MINOR, fixed)
IOMMUFD_MISC = (10, 123)  # /dev/iommu (a dynamic misc minor on a real host)
VFIO_GROUP_MAJOR = 243  # /dev/vfio/<group>
VFIO_CDEV_MAJOR = 242  # /dev/vfio/devices/vfio<N>

VFIO_PCI = "vfio-pci"
NO_OVERRIDE = "(null)"  # what a PCI function's driver_override shows when none is set
# The drivers the simulated kernel has, and their modules (pcieport is built in).
DRIVER_MODULES = {"nvidia": "nvidia", VFIO_PCI: "vfio_pci", "snd_hda_intel": "snd_hda_intel",
                  "mlx5_core": "mlx5_core", "pcieport": ""}
COMMAND_FILES = ("bind", "unbind", "new_id", "remove_id")


@dataclass(frozen=True)
class SimTree:
    """Paths of one simulated machine rooted at `root` (`root/sys`, `root/dev`, `root/proc`)."""

    root: Path

    @property
    def sys(self) -> Path:
        return self.root / "sys"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def pci(self) -> Path:
        return self.sys / "bus" / "pci"

    @property
    def devices(self) -> Path:
        return self.pci / "devices"

    @property
    def drivers(self) -> Path:
        return self.pci / "drivers"

    @property
    def groups(self) -> Path:
        return self.sys / "kernel" / "iommu_groups"

    @property
    def boot_id(self) -> Path:
        """The simulated kernel's boot ID (`proc/sys/kernel/random/boot_id`): new at each simulated boot."""
        return self.root / "proc" / "sys" / "kernel" / "random" / "boot_id"

    def read_boot_id(self) -> str:
        """The boot ID ("" before the machine's first boot is written)."""
        try:
            return self.boot_id.read_text().strip()
        except FileNotFoundError:
            return ""

    @property
    def kernel_log(self) -> Path:
        """Where the emulator writes what the kernel would print (refusals, with why): a dmesg."""
        return self.root / "kmsg.log"

    def function(self, bdf: str) -> Path:
        """The function's real directory (below `sys/devices`), through its `bus/pci/devices` link."""
        return Path(os.path.realpath(self.devices / bdf))

    def driver_of(self, bdf: str) -> str | None:
        try:  # read once: the link may go between a look and a read (an unbind applied meanwhile)
            return os.path.basename(os.readlink(self.devices / bdf / "driver"))
        except OSError:  # no link (unbound), or not a link
            return None

    def group_of(self, bdf: str) -> int | None:
        link = self.devices / bdf / "iommu_group"
        return int(os.path.basename(os.readlink(link))) if link.is_symlink() else None

    def group_members(self, group: int) -> list[str]:
        try:
            return sorted(os.listdir(self.groups / str(group) / "devices"))
        except OSError:
            return []

    def device_class(self, bdf: str) -> int:
        try:
            return int((self.devices / bdf / "class").read_text().strip(), 16)
        except (OSError, ValueError):
            return 0

    def override_of(self, bdf: str) -> str | None:
        try:
            text = (self.devices / bdf / "driver_override").read_text().strip()
        except OSError:
            return None
        return None if text in ("", NO_OVERRIDE) else text

    # -- changes ---------------------------------------------------------------------------------

    def bind(self, bdf: str, driver: str) -> None:
        """Record `bdf` as bound to `driver`: its `driver` link and the driver's entry for it."""
        fn = self.function(bdf)
        link(fn / "driver", self.drivers / driver)
        link(self.drivers / driver / bdf, fn)

    def unbind(self, bdf: str) -> str | None:
        """Drop the function's binding; returns the driver it had."""
        driver = self.driver_of(bdf)
        if driver is not None:
            (self.drivers / driver / bdf).unlink(missing_ok=True)
        (self.function(bdf) / "driver").unlink(missing_ok=True)
        return driver

    def set_override(self, bdf: str, driver: str | None, *, written: str | None = None) -> None:
        """Show `driver` (None: none) as the function's override. `written`: the content this answers;
        when the file holds something else by now, a newer write came, and it is left alone (its own
        event follows)."""
        # Replaced whole: a reader (the agent waiting for "(null)") never sees it half written or empty,
        # which the kernel's file never is.
        path = self.function(bdf) / "driver_override"
        try:
            now = path.read_text()
        except OSError:
            now = None
        if now == f"{driver or NO_OVERRIDE}\n" or (written is not None and now != written):
            return
        staged = path.with_name(".driver_override.new")
        staged.write_text(f"{driver or NO_OVERRIDE}\n")
        os.replace(staged, path)

    def vfio_cdev_of(self, bdf: str) -> str | None:
        try:
            names = os.listdir(self.function(bdf) / "vfio-dev")
        except OSError:
            return None
        return names[0] if names else None

    def add_vfio_nodes(self, bdf: str, group: int, cdevs: bool) -> None:
        """What vfio-pci's probe makes: the group's node, and with device cdevs `vfio-dev/vfioN` and its
        `/dev/vfio/devices/vfioN` (N the lowest free number, as the kernel's IDA hands them out)."""
        device_node(self.dev / "vfio" / str(group), VFIO_GROUP_MAJOR, group)
        if not cdevs or self.vfio_cdev_of(bdf) is not None:
            return
        taken = set()
        with_cdev = self.dev / "vfio" / "devices"
        with_cdev.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(with_cdev):
            if name.startswith("vfio") and name[4:].isdigit():
                taken.add(int(name[4:]))
        n = next(i for i in range(len(taken) + 1) if i not in taken)
        function_dir(self.function(bdf) / "vfio-dev" / f"vfio{n}", {"dev": f"{VFIO_CDEV_MAJOR}:{n}"})
        device_node(with_cdev / f"vfio{n}", VFIO_CDEV_MAJOR, n)

    def remove_vfio_nodes(self, bdf: str, group: int | None) -> None:
        """Undo `add_vfio_nodes` for `bdf`, which is leaving vfio-pci; the group's node goes with the
        group's last function bound to vfio-pci."""
        cdev = self.vfio_cdev_of(bdf)
        if cdev is not None:
            (self.dev / "vfio" / "devices" / cdev).unlink(missing_ok=True)
            node_dir = self.function(bdf) / "vfio-dev" / cdev
            (node_dir / "dev").unlink(missing_ok=True)
            node_dir.rmdir()
            (self.function(bdf) / "vfio-dev").rmdir()
        others = [m for m in self.group_members(group) if m != bdf] if group is not None else []
        if group is not None and not any(self.driver_of(m) == VFIO_PCI for m in others):
            (self.dev / "vfio" / str(group)).unlink(missing_ok=True)

    def log(self, line: str) -> None:
        """One line to the simulated kernel log (and the agent's log)."""
        log.warning("simulated kernel: %s", line)
        with self.kernel_log.open("a") as f:
            f.write(line + "\n")


def function_dir(path: Path, files: dict[str, str]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_if_changed(path / name, text)


def write_if_changed(path: Path, text: str) -> None:
    """`text` and a newline, as sysfs shows a value; untouched when it already says that (so a watcher
    of the tree sees no event for a no-op)."""
    try:
        if path.read_text() == text + "\n":
            return
    except OSError:
        pass
    path.write_text(text + "\n")


def link(link: Path, target: Path) -> None:
    # Relative, like the kernel's, so the tree can be moved or bind-mounted elsewhere.
    link.parent.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(target, link.parent)
    if link.is_symlink() and os.readlink(link) == relative:
        return
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(relative)


def device_node(path: Path, major: int, minor: int) -> None:
    """A character device node, or (unprivileged, where mknod is refused) an empty regular file standing
    in for it so CDI specs and tests can still name the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
            os.chmod(path, 0o666)  # as the drivers make them; mknod's mode is cut by the umask
            return
        except PermissionError:
            log.debug("cannot create character device %s; writing a placeholder file", path)
    elif st is not None and stat.S_ISREG(st.st_mode):
        return
    elif st is not None:
        path.unlink()
    if not path.exists():
        path.touch()

"""Whether a GPU is free to leave its host driver.

Unbinding the NVIDIA driver from a GPU that a process still has open blocks in the driver until the
process lets go; a GPU with SR-IOV VFs enabled has functions hanging off it. Both are checked
first and reported as DeviceBusy (retryable), naming who holds the device, so a prepare never hangs.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from agent.host.vfio.errors import DeviceBusy
from agent.host.vfio.pci import sriov_numvfs

NVIDIA_MAJOR = 195


@dataclass(frozen=True, slots=True)
class Holder:
    """A process with a device open."""

    pid: int
    command: str  # /proc/<pid>/comm
    fd: int
    path: str  # what its fd link names

    def __str__(self) -> str:
        who = "this agent" if self.pid == os.getpid() else self.command or "?"
        return f"pid {self.pid} ({who}) fd {self.fd} on {self.path}"


def open_holders(proc_root: Path, paths: Collection[str], rdev: int | None = None) -> list[Holder]:
    """Processes under `proc_root` with an fd on one of `paths`, or on the character device `rdev`.

    The link text is the path in the holder's own mount namespace (a container's /dev/nvidia0 reads
    `/dev/nvidia0`), so the device number, where given, also catches a node under another name.
    Processes that end or that this user may not inspect during the scan are skipped."""
    wanted = set(paths)
    found: list[Holder] = []
    try:
        pids = [int(n) for n in os.listdir(proc_root) if n.isdigit()]
    except OSError:
        return found
    for pid in sorted(pids):
        fd_dir = proc_root / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for name in fds:
            try:
                target = os.readlink(fd_dir / name)
            except OSError:
                continue
            hit = target in wanted
            if not hit and rdev is not None and target.startswith("/"):
                try:
                    st = os.stat(fd_dir / name)
                    hit = stat.S_ISCHR(st.st_mode) and st.st_rdev == rdev
                except OSError:
                    hit = False
            if hit:
                try:
                    command = (proc_root / str(pid) / "comm").read_text().strip()
                except OSError:
                    command = ""
                found.append(Holder(pid, command, int(name) if name.isdigit() else -1, target))
    return found


def check_no_vfs(sysfs: Path, bdf: str) -> None:
    """DeviceBusy when GPU `bdf` has SR-IOV VFs enabled (they hang off the function; no minor needed)."""
    vfs = sriov_numvfs(sysfs, bdf)
    if vfs > 0:
        raise DeviceBusy(f"GPU {bdf} has {vfs} SR-IOV virtual functions enabled: disable them (write 0 to "
                         f"{sysfs / 'bus' / 'pci' / 'devices' / bdf / 'sriov_numvfs'}) before passing it through")


def check_not_open(proc_root: Path, dev_root: Path, bdf: str, minor: int, *, but_self: bool = False) -> None:
    """DeviceBusy when a process has GPU `bdf` (`/dev/nvidia<minor>`) open. `but_self`: this process's own
    descriptors do not count (its NVML's handles, which it lets go of before the unbind, and checks again then)."""
    node = dev_root / f"nvidia{minor}"
    rdev: int | None = None
    try:
        st = os.stat(node)
        if stat.S_ISCHR(st.st_mode):
            rdev = st.st_rdev
    except OSError:
        pass
    holders = [h for h in open_holders(proc_root, {f"/dev/nvidia{minor}", str(node)}, rdev)
               if not (but_self and h.pid == os.getpid())]
    if holders:
        shown = "; ".join(str(h) for h in holders[:5]) + (f"; and {len(holders) - 5} more" if len(holders) > 5 else "")
        raise DeviceBusy(f"GPU {bdf} is in use on the host: {shown}; it can leave the NVIDIA driver once they "
                         "close it")


def check_gpu_idle(sysfs: Path, proc_root: Path, dev_root: Path, bdf: str, minor: int) -> None:
    """DeviceBusy unless GPU `bdf` (`/dev/nvidia<minor>`) has no SR-IOV VFs enabled and no open handle.

    Not checked here, for the caller: that no container claim has the GPU prepared, and that NVML
    persistence mode is off (`agent.host.vfio.persistence`)."""
    check_no_vfs(sysfs, bdf)
    check_not_open(proc_root, dev_root, bdf, minor)

"""The NVIDIA driver's capability files and device nodes (`/proc/driver/nvidia/capabilities`,
`/dev/nvidia-caps`): what a MIG device's container needs beside the GPU's own nodes. The same layout
on a real host and in the simulated machine's tree, so MIG prepare and the simulator share it.

The driver publishes each capability as a procfs file (`.../gpu<minor>/mig/gi<id>/[ci<id>/]access`:
`DeviceFileMinor`, `DeviceFileMode`, `DeviceFileModify`) and registers the character device
`nvidia-caps` under a dynamic major (a line of `/proc/devices`), but makes no device nodes: those
appear only when someone creates them (nvidia-modprobe, run by the driver's user-space tools, usually
does). The agent does the same as nvidia-modprobe for the nodes a MIG device's container needs:
`/dev/nvidia-caps/nvidia-cap<minor>`, a character device `nvidia-caps major:minor`, with the access
file's mode. A node that is there with other numbers (left from before a driver reload, whose major
may differ) is replaced. Blocking.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

CAPS_DEVICE = "nvidia-caps"  # its name in /proc/devices, and the directory of its nodes under /dev
DEFAULT_MODE = 0o444


class CapError(Exception):
    """A capability's node cannot be made: its access file or the driver's major is not readable, or
    the node cannot be created (the message says which)."""


@dataclass(frozen=True, slots=True)
class CapAccess:
    """What a capability's `access` file says."""

    minor: int
    mode: int = DEFAULT_MODE


def caps_dir(proc: Path, gpu_minor: int) -> Path:
    """The GPU's MIG capabilities directory under the (simulated or real) /proc."""
    return proc / "driver" / "nvidia" / "capabilities" / f"gpu{gpu_minor}" / "mig"


def read_access(access: Path) -> CapAccess:
    """The minor (and mode) of a capability (`.../gi<id>/[ci<id>/]access`)."""
    fields: dict[str, str] = {}
    try:
        for line in access.read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        if "DeviceFileMinor" not in fields:
            raise CapError(f"{access} names no DeviceFileMinor")
        mode = int(fields["DeviceFileMode"]) if "DeviceFileMode" in fields else DEFAULT_MODE
        return CapAccess(int(fields["DeviceFileMinor"]), mode & 0o777)
    except (OSError, ValueError) as exc:
        raise CapError(f"{access} is not readable: {exc}") from exc


def char_major(proc: Path, name: str = CAPS_DEVICE) -> int | None:
    """The major of character device `name` in `<proc>/devices` (None: not registered)."""
    try:
        text = (proc / "devices").read_text()
    except OSError:
        return None
    in_chars = False
    for line in text.splitlines():
        if line.strip().endswith("devices:"):
            in_chars = line.strip() == "Character devices:"
            continue
        number, _, device = line.strip().partition(" ")
        if in_chars and device.strip() == name and number.isdigit():
            return int(number)
    return None


def node_path(dev: Path, minor: int) -> Path:
    return dev / CAPS_DEVICE / f"nvidia-cap{minor}"


def ensure_node(dev: Path, proc: Path, access: Path, *, placeholder: bool = False) -> Path:
    """`<dev>/nvidia-caps/nvidia-cap<minor>` for the capability at `access`, made (or remade with the
    right numbers) when it is not there as it should be; its path. `placeholder`: where this process
    may not create device nodes (the simulated machine run unprivileged), an empty file stands in.
    CapError says why it cannot be made."""
    cap = read_access(access)
    major = char_major(proc)
    if major is None:
        raise CapError(f"the NVIDIA driver has no {CAPS_DEVICE} character device in {proc / 'devices'} (a driver "
                       "without MIG support, or not loaded)")
    path = node_path(dev, cap.minor)
    want = os.makedev(major, cap.minor)
    with contextlib.suppress(FileNotFoundError):
        st = path.lstat()
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
            return path
        if placeholder and stat.S_ISREG(st.st_mode):
            return path
    try:
        path.parent.mkdir(mode=0o755, exist_ok=True)
        # Made beside it and renamed over it: a second agent (a rolling update) or a reader never sees
        # the path missing or half made.
        temp = path.with_name(f".{path.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        try:
            os.mknod(temp, stat.S_IFCHR | cap.mode, want)
        except PermissionError:
            if not placeholder:
                raise
            temp.touch()
        os.chmod(temp, cap.mode)  # mknod's mode is cut by the umask
        os.replace(temp, path)
    except OSError as exc:
        why = " (creating device nodes needs CAP_MKNOD)" if exc.errno in (errno.EPERM, errno.EACCES) else ""
        raise CapError(f"cannot create {path} (character device {major}:{cap.minor}): "
                       f"{exc.strerror or exc}{why}") from exc
    return path

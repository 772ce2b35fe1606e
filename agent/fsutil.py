"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def atomic_write(path: Path, data: bytes, mode: int = 0o644, durable: bool = False) -> None:
    """Write `data` to `path` through a temp file in the same directory and a rename.

    The temp name ends in neither .json nor .yaml, so a CDI runtime scanning the
    directory never picks it up. `durable` adds fsync of the file and of the
    directory: only the per-claim record pays for that.
    """
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if os.fstat(fd).st_mode & 0o7777 != mode:
                os.fchmod(fd, mode)  # the umask narrowed it
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and ".tmp-" in name


def unlink_quiet(path: Path) -> bool:
    """Remove a file; True if it was there."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def makedirs(path: Path, mode: int = 0o755) -> None:
    """Create `path` and its parents with `mode`, whatever the umask."""
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, mode)
            if os.stat(d).st_mode & 0o7777 != mode:
                os.chmod(d, mode)  # the umask narrowed it

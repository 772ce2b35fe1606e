"""The one atomic file write of the project: a reader sees the old file or the new one, never half.

The data goes to a temp file in the same directory, then a rename replaces the
target. The temp name (`.<name>.tmp-<hex>`) ends in neither `.json` nor `.yaml`,
so a CDI runtime scanning the directory never parses it, and it is the pattern
start-up cleanup removes. The directory is given as an open file descriptor, so
the caller decides how it was reached (the agent opens every directory below
its roots without following symbolic links); nothing here follows a link.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager

TEMP_MARK = ".tmp-"


def temp_name(name: str) -> str:
    return f".{name}{TEMP_MARK}{secrets.token_hex(4)}"


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TEMP_MARK in name


def write_at(dir_fd: int, name: str, data: bytes, mode: int = 0o644, durable: bool = False,
             sync_dir: bool = True,
             around_rename: Callable[[int], AbstractContextManager[object]] | None = None) -> None:
    """Atomically write `data` as `name` in the directory `dir_fd`, with exactly `mode`.
    `around_rename` is given the new file's inode and its context is held around the rename (so a
    watcher can tell this write's rename from anyone else's, whenever it sees the event, and never
    sees the one without the other).

    `durable` adds fsync of the file and of the directory, so the new file survives a
    power loss once this returns. With `sync_dir` false the directory's fsync is left to the
    caller, who must do it before relying on the file (several writes may share one).
    """
    tmp = temp_name(name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            st = os.fstat(fd)
            if st.st_mode & 0o7777 != mode:
                os.fchmod(fd, mode)  # the umask narrowed it
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.nullcontext() if around_rename is None else around_rename(st.st_ino):
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if durable and sync_dir:
        os.fsync(dir_fd)

"""Files under the agent's roots: atomic writes, and no symbolic link followed below a root.

A root (the CDI directory, the metadata directory, the records directory) is a
setting the operator chose; everything below it is the agent's own, and is
reached one component at a time with `O_NOFOLLOW` relative to the parent's file
descriptor. A link planted where the agent will create a directory therefore
makes the operation fail (`UnsafePath`) instead of writing outside the root, and
removing a claim's files removes a planted link itself, never what it points to.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cdi.atomic import is_temp_name, write_at

if TYPE_CHECKING:
    from agent.ownchanges import OwnChanges

__all__ = ["Root", "UnsafePath", "UnsafeRoot", "atomic_write", "check_root", "is_temp_name", "makedirs",
           "unlink_quiet"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class UnsafePath(OSError):
    """A link, or something that is not a directory, where the agent expected its own directory."""


class UnsafeRoot(RuntimeError):
    """A root the agent must not trust (writable by others, owned by someone else)."""


def atomic_write(path: Path, data: bytes, mode: int = 0o644, durable: bool = False) -> None:
    """Atomically write `path` in a directory that is not below one of the agent's roots."""
    fd = os.open(path.parent, _DIR_FLAGS)
    try:
        write_at(fd, path.name, data, mode, durable)
    finally:
        os.close(fd)


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


def check_root(path: Path, what: str) -> None:
    """Refuse a root that another user could plant files or links in, or that someone else owns."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRoot(f"{what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeRoot(f"{what} {path} is owned by uid {st.st_uid}, not by the agent's user "
                         f"(uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise UnsafeRoot(f"{what} {path} is writable by group or others (mode {st.st_mode & 0o7777:04o})")


class Root:
    """A directory the agent owns. Paths given to its methods must lie below it."""

    def __init__(self, path: Path, dir_mode: int = 0o755, own: OwnChanges | None = None) -> None:
        self.path = Path(path)
        self.dir_mode = dir_mode
        self._prefix = str(self.path) + os.sep
        self.own = own  # where writes and removals are noted for self-healing (`agent.ownchanges`)

    def __repr__(self) -> str:
        return f"Root({str(self.path)!r})"

    def contains(self, path: str | Path) -> bool:
        return str(path).startswith(self._prefix)

    def parts(self, path: str | Path) -> list[str]:
        text = str(path)
        if not text.startswith(self._prefix):
            raise UnsafePath(errno.EINVAL, f"{text} is not below {self.path}")
        parts = text[len(self._prefix):].split(os.sep)
        if any(p in ("", ".", "..") for p in parts):
            raise UnsafePath(errno.EINVAL, f"{text}: not a plain path below {self.path}")
        return parts

    def ensure(self) -> None:
        makedirs(self.path, self.dir_mode)

    @contextlib.contextmanager
    def directory(self, parts: Sequence[str], create: bool) -> Iterator[int]:
        """An open descriptor of the directory `root/parts...`, each component opened without
        following links; FileNotFoundError when it is missing and `create` is false."""
        try:
            fd = os.open(self.path, _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
            self.ensure()  # only when it is missing: a stat per write cost more than the rare miss
            fd = os.open(self.path, _DIR_FLAGS)
        try:
            for i in range(len(parts)):
                child = self._open_dir(fd, parts[: i + 1], create)
                os.close(fd)
                fd = child
                if create and os.fstat(fd).st_mode & 0o7777 != self.dir_mode:
                    os.fchmod(fd, self.dir_mode)  # the umask narrowed it
            yield fd
        finally:
            os.close(fd)

    def _open_dir(self, parent_fd: int, parts: Sequence[str], create: bool) -> int:
        """The directory `parts[-1]` in `parent_fd`, made first when `create` and it is missing (the
        directory is opened first: it nearly always exists, and then a write costs no mkdir)."""
        for attempt in (1, 2):
            try:
                return os.open(parts[-1], _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
            except FileNotFoundError:
                if not create or attempt == 2:
                    raise
                self._mkdir(parent_fd, parts)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = os.path.join(self.path, *parts)
                    raise UnsafePath(exc.errno, f"{where} is a symbolic link or not a directory: "
                                                "the agent never follows links below its roots") from None
                raise
        raise AssertionError("unreachable")

    # The agent's own changes are noted (`agent.ownchanges`) in the same step as they are made, so
    # self-healing never judges an event while one is made and the other not.
    def _mkdir(self, parent_fd: int, parts: Sequence[str]) -> None:
        with contextlib.nullcontext() if self.own is None else self.own.hold():
            try:
                os.mkdir(parts[-1], self.dir_mode, dir_fd=parent_fd)
            except FileExistsError:
                return
            if self.own is not None:
                self.own.made(os.path.join(self.path, *parts))

    def _removing(self, path: str | Path) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext() if self.own is None else self.own.removing(str(path))

    def write(self, path: str | Path, data: bytes, mode: int = 0o644, durable: bool = False) -> None:
        *dirs, name = self.parts(path)
        own = self.own
        noted = None if own is None else lambda inode: own.renaming(str(path), inode)
        with self.directory(dirs, create=True) as fd:
            write_at(fd, name, data, mode, durable, around_rename=noted)

    def read(self, path: str | Path) -> bytes:
        *dirs, name = self.parts(path)
        with self.directory(dirs, create=False) as dfd:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def unlink(self, path: str | Path, durable: bool = False) -> bool:
        """Remove a file (or a link, never its target); True if it was there."""
        *dirs, name = self.parts(path)
        try:
            with self.directory(dirs, create=False) as fd:
                with self._removing(path):
                    os.unlink(name, dir_fd=fd)
                if durable:
                    os.fsync(fd)
        except FileNotFoundError:
            return False
        return True

    def remove_tree(self, path: str | Path) -> bool:
        """Remove a directory and all below it; a link in its place is removed itself."""
        *dirs, name = self.parts(path)
        try:
            with self.directory(dirs, create=False) as fd, self._removing(path):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=fd)  # fd-based: immune to links swapped in below
                else:
                    os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return False
        return True

    def listdir(self, parts: Sequence[str] = ()) -> list[str]:
        try:
            with self.directory(parts, create=False) as fd:
                return os.listdir(fd)
        except FileNotFoundError:
            return []

    def remove_empty_dirs(self, path: str | Path, stop: int = 0) -> None:
        """Remove `path` and then its parents while they are empty, keeping the first `stop` components."""
        parts = self.parts(path)
        while len(parts) > stop:
            *dirs, name = parts
            try:
                with self.directory(dirs, create=False) as fd:
                    os.rmdir(name, dir_fd=fd)
            except OSError:
                return
            parts = dirs

"""Where the NVIDIA driver's user-space libraries are: below the driver root (`--driver-root`).

The driver root is the root directory of a filesystem the driver is installed in, as this process
sees it: `/` when the agent runs on the host itself, or a mount of the host's `/` (a host install) or
of the driver container's root (`/run/nvidia/driver` on the host, for a containerized driver).

A library is found the way that root's own dynamic linker would find it, from outside it: the root's
`etc/ld.so.cache` first (`agent.host.ldcache`), then the usual library directories of this machine's
architecture. Paths inside the root are resolved inside it: a symbolic link whose target is absolute
(`/usr/lib/...`, or a merged-/usr `lib -> /usr/lib`) points below the root, never into this process's
own filesystem, and `..` stops at the root. When the root is this process's own `/`, the linker's
`LD_LIBRARY_PATH` is searched first, as the linker would.
"""

from __future__ import annotations

import errno
import os
import platform
import stat
from dataclasses import dataclass, field
from pathlib import Path

from agent.host.ldcache import CacheError, lookup, read_cache

NVML_LIBRARY = "libnvidia-ml.so.1"
_MAX_LINKS = 40  # as the kernel's path walk allows
# The library directories of a root, by machine: Debian's multiarch ones, then the Red Hat and plain ones.
LIBRARY_DIRS = {
    "x86_64": ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "usr/lib64", "lib64", "usr/lib", "lib",
               "usr/local/lib"),
    "aarch64": ("lib/aarch64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib64", "usr/lib", "lib",
                "usr/local/lib"),
}
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


@dataclass(frozen=True, slots=True)
class LibrarySearch:
    """The outcome of looking for a library below a root: the file found (a path this process can
    open), and every place looked at, in order, as the root names them."""

    found: Path | None
    tried: tuple[str, ...] = field(default=())


def library_dirs(machine: str | None = None) -> tuple[str, ...]:
    arch = (machine or platform.machine()).lower()
    arch = _ALIASES.get(arch, arch)
    return LIBRARY_DIRS.get(arch, ("usr/lib64", "lib64", "usr/lib", "lib", "usr/local/lib"))


def find_library(root: Path, name: str = NVML_LIBRARY, *, machine: str | None = None,
                 env: dict[str, str] | None = None) -> LibrarySearch:
    """Look for library `name` below `root`: LD_LIBRARY_PATH (only when `root` is `/`), the root's
    ld.so.cache, then `library_dirs`. Blocking."""
    tried: list[str] = []
    seen: set[str] = set()

    def first(candidates: list[str]) -> Path | None:
        for candidate in candidates:
            if candidate in seen:
                continue
            seen.add(candidate)
            try:
                path = resolve_in(root, candidate)
                if not stat.S_ISREG(os.stat(path).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
            except OSError as exc:
                tried.append(candidate if exc.errno == errno.ENOENT else f"{candidate} ({_why(exc)})")
                continue
            return path
        return None

    if os.path.realpath(root) == "/":
        search = (env if env is not None else os.environ).get("LD_LIBRARY_PATH", "")
        if found := first([os.path.join(d, name) for d in search.split(":") if d]):
            return LibrarySearch(found, tuple(tried))
    cache = "/etc/ld.so.cache"
    try:
        paths = lookup(read_cache(resolve_in(root, cache)), name, machine)
    except (OSError, CacheError) as exc:
        tried.append(f"{cache} ({_why(exc)})")
    else:
        if not paths:
            tried.append(f"{cache} (no {name} for {machine or platform.machine()})")
        elif found := first(paths):
            return LibrarySearch(found, tuple(tried))
    if found := first([f"/{d}/{name}" for d in library_dirs(machine)]):
        return LibrarySearch(found, tuple(tried))
    return LibrarySearch(None, tuple(tried))


def resolve_in(root: Path, path: str) -> Path:
    """`path` (absolute, as a program inside `root` names it) as a path of this process, every symbolic
    link on the way resolved inside `root`. OSError (ENOENT, ELOOP, ...) as the path walk would raise."""
    base = os.path.realpath(root)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []  # components below the root, resolved
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        here = os.path.join(base, *done, part)
        st = os.lstat(here)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        if parts and not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), here)
        done.append(part)
    return Path(base, *done)


def _why(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)

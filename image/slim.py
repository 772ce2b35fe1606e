"""Leave in the image the interpreter, the agent and the libraries they load, and nothing else to run.

    python3 -I slim.py VENV [ROOT]

The Containerfile's last build step, run by the image's own interpreter in the image being built (ROOT
`/`), before the result is copied into an image of one layer (docs/image.md, "What is in it, and a shell
when one is needed"). The agent runs no program (it reads `ld.so.cache` itself, enters network
namespaces with setns(2)), so a program left in the image is only of use to code that got into the agent:
a shell, util-linux's `nsenter` and `unshare` into the host's namespaces, a package manager to fetch the
rest. This removes:

- every program in the bin and sbin directories but the interpreter VENV runs on, and the helpers of
  libexec;
- the package managers and what they keep: dpkg and apt (their state and configuration), pip (of the
  base's interpreter; the agent's environment has none) and ensurepip with its bundled wheels;
- perl's modules (its interpreter is a program, and goes), and the alternatives' links to programs gone;
- the set-user-ID and set-group-ID bits of whatever file remains.

Standard library only: it runs on any base the Containerfile accepts (Python >= 3.11).
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

PROGRAM_DIRS = ("usr/bin", "usr/sbin", "usr/local/bin", "usr/local/sbin", "bin", "sbin")
# Package managers, their state and configuration; helper programs; another interpreter's modules.
# (Patterns, below the image's root.)
REMOVED = ("usr/libexec", "usr/local/libexec", "usr/lib/dpkg", "usr/lib/apt", "usr/share/dpkg", "var/lib/dpkg",
           "var/lib/apt", "var/cache/apt", "var/cache/debconf", "var/log/apt", "var/log/dpkg.log",
           "var/log/alternatives.log", "etc/apt", "etc/dpkg", "etc/alternatives", "usr/share/python-wheels",
           "usr/share/perl", "usr/share/perl5", "usr/lib/*-linux-gnu/perl", "usr/lib/*-linux-gnu/perl-base")
# Package directories of pip and ensurepip, wherever an interpreter keeps them.
PACKAGE_MANAGERS = ("pip", "ensurepip")
LIBRARY_DIRS = ("site-packages", "dist-packages")


def inside(root: Path, path: str) -> Path:
    """`path` of the image (absolute, as its links say) below `root`."""
    return root / path.lstrip("/")


def interpreter(root: Path, venv: Path) -> set[Path]:
    """Every name the environment's interpreter is reached by: its python links, and each link they go
    through to the binary (`python3` -> `/usr/bin/python3` -> `python3.11`)."""
    keep: set[Path] = set()
    for start in (inside(root, str(venv)) / "bin").glob("python*"):
        path = start
        for _ in range(40):  # the kernel's own limit on links followed
            keep.add(path)
            if not path.is_symlink():
                break
            target = os.readlink(path)
            path = inside(root, target) if target.startswith("/") else path.parent / target
        if not path.is_file():
            raise SystemExit(f"slim: {start} leads to no interpreter ({path})")
    return keep


def _walk(root: Path) -> Iterator[tuple[Path, list[str], list[str]]]:
    """os.walk of the image, skipping what the build mounts into it (/proc, /sys, /dev, bind mounts)."""
    for top, dirs, files in os.walk(root):
        here = Path(top)
        dirs[:] = [d for d in dirs if not os.path.ismount(here / d)]
        yield here, dirs, files


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def package_manager(directory: Path) -> bool:
    """pip or its metadata in an interpreter's library directory, or the standard library's ensurepip."""
    name, parent = directory.name, directory.parent.name
    if name in PACKAGE_MANAGERS and (directory / "__init__.py").is_file():
        return parent in LIBRARY_DIRS or name == "ensurepip"
    return parent in LIBRARY_DIRS and name.startswith("pip-") and name.endswith(".dist-info")


def slim(venv: Path, root: Path = Path("/")) -> list[Path]:
    """Remove what the module's docstring says from the image at `root`; what was removed."""
    keep = interpreter(root, venv)
    removed: list[Path] = []
    for name in PROGRAM_DIRS:
        directory = root / name
        if directory.is_symlink() or not directory.is_dir():
            continue  # /bin -> usr/bin: swept as usr/bin
        for entry in directory.iterdir():
            if entry not in keep:
                remove(entry)
                removed.append(entry)
    for pattern in REMOVED:
        for path in root.glob(pattern):
            remove(path)
            removed.append(path)
    for here, dirs, files in _walk(root):
        for d in [d for d in dirs if package_manager(here / d)]:
            remove(here / d)
            removed.append(here / d)
            dirs.remove(d)
        for f in files:
            path = here / f
            mode = path.lstat().st_mode
            if stat.S_ISREG(mode) and mode & (stat.S_ISUID | stat.S_ISGID):
                path.chmod(stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID))
    return removed


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    removed = slim(Path(argv[0]), Path(argv[1]) if len(argv) == 2 else Path("/"))
    print(f"slim: removed {len(removed)} programs and directories", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

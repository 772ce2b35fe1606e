"""image/slim.py, the Containerfile's last build step, on root filesystems laid out as its two bases are.

tests/test_image.py builds the image on the Debian base made here (`make image-offline`) and checks what
is left in it; the registry's base (`make image`, python:3.11-slim-bookworm: Python built into /usr/local,
pip beside it) is built nowhere in the tests, so its layout is made here: the script keeps the interpreter
the agent's environment runs on, in either layout, and takes every other program, the package managers
and the set-user-ID bits.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLIM = ROOT / "image" / "slim.py"
VENV = "/opt/dra-agent"


def make(root: Path, files: dict[str, str], links: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    for name, target in links.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)


def common(root: Path) -> None:
    """What both bases have (Debian's essential packages) and the agent's environment."""
    make(root, {
        "usr/bin/dash": "ELF", "usr/bin/bash": "ELF", "usr/bin/nsenter": "ELF", "usr/bin/unshare": "ELF",
        "usr/bin/dpkg": "ELF", "usr/bin/apt-get": "ELF", "usr/bin/env": "ELF", "usr/bin/perl": "ELF",
        "usr/sbin/ldconfig": "ELF", "usr/libexec/coreutils/libstdbuf.so": "ELF", "var/lib/dpkg/status": "",
        "etc/apt/sources.list": "", "usr/share/perl5/Debconf/Db.pm": "", "usr/lib/x86_64-linux-gnu/libc.so.6": "ELF",
        "etc/passwd": "root:x:0:0::/root:/bin/sh\n", "usr/bin/su": "ELF",
        f"{VENV[1:]}/bin/dra-agent": f"#!{VENV}/bin/python3\n",
        f"{VENV[1:]}/lib/python3.11/site-packages/agent/__init__.py": "",
    }, {"bin": "usr/bin", "sbin": "usr/sbin", "usr/bin/sh": "dash", "etc/alternatives/awk": "/usr/bin/mawk",
        f"{VENV[1:]}/bin/python3.11": "python3", f"{VENV[1:]}/bin/python": "python3"})
    (root / "usr/bin/su").chmod(0o4755)


def slim(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", str(SLIM), VENV, str(root)], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def programs(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for d in ("usr/bin", "usr/sbin", "usr/local/bin", "usr/local/sbin")
            if (root / d).is_dir() for p in (root / d).iterdir()}


def assert_slim(root: Path, kept: set[str]) -> None:
    assert programs(root) == kept
    for gone in ("usr/libexec", "var/lib/dpkg", "etc/apt", "usr/share/perl5", "etc/alternatives"):
        assert not os.path.lexists(root / gone), gone
    # The agent's environment and the system's libraries stay, the interpreter still reached by its links.
    assert (root / VENV[1:] / "bin/dra-agent").is_file() and (root / "usr/lib/x86_64-linux-gnu/libc.so.6").is_file()
    assert (root / VENV[1:] / "lib/python3.11/site-packages/agent/__init__.py").is_file()
    assert all(not (p.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID)) for p in root.rglob("*") if not p.is_symlink())
    assert not list(root.rglob("pip/__init__.py")) and not list(root.rglob("ensurepip/__init__.py"))


def test_the_debian_base_keeps_its_interpreter_only(tmp_path: Path) -> None:
    # Debian's python3 (`make image-offline`): /usr/bin/python3 -> python3.11, ensurepip and its wheels.
    common(tmp_path)
    make(tmp_path, {"usr/bin/python3.11": "ELF", "usr/lib/python3.11/os.py": "",
                    "usr/lib/python3.11/ensurepip/__init__.py": "",
                    "usr/share/python-wheels/pip-23.0.1-py3-none-any.whl": ""},
         {"usr/bin/python3": "python3.11", f"{VENV[1:]}/bin/python3": "/usr/bin/python3"})
    done = slim(tmp_path)
    assert done.returncode == 0, done.stderr
    assert_slim(tmp_path, {"usr/bin/python3", "usr/bin/python3.11"})
    assert (tmp_path / "usr/lib/python3.11/os.py").is_file()
    assert not (tmp_path / "usr/share/python-wheels").exists()


def test_the_registry_base_keeps_its_interpreter_and_loses_its_pip(tmp_path: Path) -> None:
    # python:3.11-slim-bookworm (`make image`): Python in /usr/local, with pip importable by that interpreter.
    common(tmp_path)
    make(tmp_path, {"usr/local/bin/python3.11": "ELF", "usr/local/bin/pip3": "#!/usr/local/bin/python3.11\n",
                    "usr/local/lib/python3.11/os.py": "",
                    "usr/local/lib/python3.11/site-packages/pip/__init__.py": "",
                    "usr/local/lib/python3.11/site-packages/pip-24.0.dist-info/RECORD": "",
                    "usr/local/lib/python3.11/site-packages/setuptools/__init__.py": ""},
         {"usr/local/bin/python3": "python3.11", "usr/local/bin/python": "python3",
          f"{VENV[1:]}/bin/python3": "/usr/local/bin/python3"})
    done = slim(tmp_path)
    assert done.returncode == 0, done.stderr
    assert_slim(tmp_path, {"usr/local/bin/python3", "usr/local/bin/python3.11"})
    assert not (tmp_path / "usr/local/lib/python3.11/site-packages/pip-24.0.dist-info").exists()
    assert (tmp_path / "usr/local/lib/python3.11/site-packages/setuptools/__init__.py").is_file()


def test_an_environment_whose_interpreter_is_missing_is_refused(tmp_path: Path) -> None:
    # A link leading nowhere: the build stops there, rather than leave an image that cannot start.
    common(tmp_path)
    make(tmp_path, {}, {f"{VENV[1:]}/bin/python3": "/usr/bin/python3"})
    done = slim(tmp_path)
    assert done.returncode != 0 and "leads to no interpreter" in done.stderr
    assert (tmp_path / "usr/bin/dash").is_file(), "nothing is removed before the interpreter is found"


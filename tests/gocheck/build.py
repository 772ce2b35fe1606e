"""Builds the Go programs of tests/gocheck once and keeps them outside the repository: the checker
(main.go) and the kubelet's registration calls (kubeletreg/main.go).

The binaries live in `<cache>/dra-agent/gocheck-<hash>/`, where `<cache>` is $XDG_CACHE_HOME or
~/.cache and the hash covers go.mod, go.sum, every Go source file and the Go toolchain's binary: any
change to one of them builds anew, anything else reuses the binaries (hashing a few files). `make
test` runs this file first; tests/test_official_readers.py calls `binary()`, tests/test_registration.py
`binary("kubeletreg")`.

    python tests/gocheck/build.py    # prints the binary's path

Without Go it says so and exits 0 (the test then skips), or 1 when DRA_TEST_NO_SKIP is set; a
failed build always exits 1 with Go's output.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Where the Go distribution installs itself when PATH does not name it.
GO_FALLBACK = Path("/usr/local/go/bin/go")
BUILD_TIMEOUT = 600  # a cold module cache downloads the modules first


class GoMissing(RuntimeError):
    """No Go toolchain on this machine."""


class BuildFailed(RuntimeError):
    """`go build` failed; the message carries its output."""


def go_tool() -> str:
    found = shutil.which("go") or (str(GO_FALLBACK) if GO_FALLBACK.is_file() else None)
    if found is None:
        raise GoMissing("the Go checker of tests/gocheck needs Go (go1.26 or later) on PATH or in /usr/local/go")
    return found


def source_hash(go: str) -> str:
    # The toolchain by its file, not by asking it (`go env` costs a fifth of a second): another Go
    # installed there has another size or time.
    tool = Path(go).resolve()
    st = tool.stat()
    digest = hashlib.sha256(f"{tool}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for path in sorted([HERE / "go.mod", HERE / "go.sum", *HERE.glob("**/*.go")]):
        digest.update(str(path.relative_to(HERE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dra-agent"


PROGRAMS = {"gocheck": ".", "kubeletreg": "./kubeletreg", "deviceplugin": "./deviceplugin"}  # binary name -> package


def binary(program: str = "gocheck") -> Path:
    """The program's path, built first when no binary of these sources is cached."""
    go = go_tool()
    target = cache_root() / f"gocheck-{source_hash(go)}" / program
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: a build interrupted, or two at once, never leaves a
    # half-written binary at the final path.
    fd, tmp = tempfile.mkstemp(prefix=f".{program}-", dir=target.parent)
    os.close(fd)
    try:
        # -mod=readonly: go.sum must already hold every module; a build never rewrites the repository.
        built = subprocess.run([go, "build", "-mod=readonly", "-trimpath", "-o", tmp, PROGRAMS[program]], cwd=HERE,
                               capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if built.returncode != 0:
            raise BuildFailed(f"go build in {HERE} failed (exit {built.returncode}):\n{built.stderr}{built.stdout}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def main() -> int:
    try:
        for program in PROGRAMS:
            print(binary(program))
    except GoMissing as e:
        if os.environ.get("DRA_TEST_NO_SKIP", "") not in ("", "0"):
            print(f"gocheck: {e}", file=sys.stderr)
            return 1
        print(f"gocheck: {e}; tests/test_official_readers.py will skip", file=sys.stderr)
    except BuildFailed as e:
        print(f"gocheck: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

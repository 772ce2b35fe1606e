"""Builds promtool, Prometheus's rule checker and rule unit-test runner, once from its Go module
(`github.com/prometheus/prometheus/cmd/promtool`, pinned by go.mod here) and keeps it outside the
repository, for tests/test_monitoring.py (`promtool check rules`, `promtool test rules` on
deploy/monitoring); beside it promqlnames (promqlnames/main.go), which lists the metric names of
PromQL expressions with Prometheus's own parser.

The binaries live in `<cache>/dra-agent/promtool-<hash>/`, where `<cache>` is $XDG_CACHE_HOME or
~/.cache and the hash covers go.mod, go.sum, every Go source file here and the Go toolchain's
binary: a change to one of them builds anew, anything else reuses the binaries (hashing a few
files). `make test` runs this file first (the `promtool` target); the first build downloads and
compiles Prometheus's module graph (minutes: docs/tests.md), later runs cost nothing.

    python tests/promtool/build.py    # prints the binaries' paths

Without Go it says so and exits 0 (the tests then skip), or 1 when DRA_TEST_NO_SKIP is set; a
failed build always exits 1 with Go's output. Standard library only, as tests/gocheck/build.py is:
`make` runs it before the virtual environment matters.
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
# Binary name -> Go package.
PROGRAMS = {"promtool": "github.com/prometheus/prometheus/cmd/promtool", "promqlnames": "./promqlnames"}
BUILD_TIMEOUT = 3600  # cold: Prometheus's module graph downloaded and compiled (over 30 min on a busy 2-core machine)


class GoMissing(RuntimeError):
    """No Go toolchain on this machine."""


class BuildFailed(RuntimeError):
    """`go build` failed; the message carries its output."""


def go_tool() -> str:
    found = shutil.which("go") or (str(GO_FALLBACK) if GO_FALLBACK.is_file() else None)
    if found is None:
        raise GoMissing("promtool (tests/promtool) is built with Go (go1.26 or later) on PATH or in /usr/local/go")
    return found


def source_hash(go: str) -> str:
    # The toolchain by its file, not by asking it (`go env` costs a fifth of a second): another Go
    # installed there has another size or time.
    tool = Path(go).resolve()
    st = tool.stat()
    digest = hashlib.sha256(f"{tool}\0{st.st_size}\0{st.st_mtime_ns}\0{sorted(PROGRAMS.items())}\0".encode())
    for path in sorted([HERE / "go.mod", HERE / "go.sum", *HERE.glob("**/*.go")]):
        digest.update(str(path.relative_to(HERE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dra-agent"


def binary(program: str = "promtool") -> Path:
    """The program's path, built first when no binary of these sources is cached."""
    go = go_tool()
    target = cache_root() / f"promtool-{source_hash(go)}" / program
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
            raise BuildFailed(f"go build of {PROGRAMS[program]} in {HERE} failed (exit {built.returncode}):\n"
                              f"{built.stderr}{built.stdout}")
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
            print(f"promtool: {e}", file=sys.stderr)
            return 1
        print(f"promtool: {e}; tests/test_monitoring.py's promtool tests will skip", file=sys.stderr)
    except BuildFailed as e:
        print(f"promtool: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

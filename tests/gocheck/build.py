"""Builds the Go programs of tests/gocheck once and keeps them outside the repository: the checker
(main.go), the kubelet's registration calls (kubeletreg/main.go) and a device plugin
(deviceplugin/main.go); and, as `GoPrograms`, the builder tests/helm/build.py and tests/promtool/build.py
use for theirs.

The binaries live in `<cache>/dra-agent/<name>-<hash>/`, where `<cache>` is $XDG_CACHE_HOME or
~/.cache and the hash covers go.mod, go.sum, every Go source file of the module directory, the
programs and the Go toolchain's binary: any change to one of them builds anew, anything else reuses the
binaries (hashing a few files). `make test` runs this file first; tests/test_official_readers.py calls
`binary()`, tests/test_registration.py `binary("kubeletreg")`, the migration test `binary("deviceplugin")`.

    python tests/gocheck/build.py    # prints the binaries' paths

Without Go it says so and exits 0 (the tests then skip), or 1 when DRA_TEST_NO_SKIP is set; a
failed build always exits 1 with Go's output. Standard library only: `make` runs it before the virtual
environment matters.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Where the Go distribution installs itself when PATH does not name it.
GO_FALLBACK = Path("/usr/local/go/bin/go")
BUILD_TIMEOUT = 600  # a cold module cache downloads the modules first


class GoMissing(RuntimeError):
    """No Go toolchain on this machine."""


class BuildFailed(RuntimeError):
    """`go build` failed; the message carries its output."""


def go_tool(what: str = "the Go checker of tests/gocheck") -> str:
    found = shutil.which("go") or (str(GO_FALLBACK) if GO_FALLBACK.is_file() else None)
    if found is None:
        raise GoMissing(f"{what} needs Go (go1.26 or later) on PATH or in /usr/local/go")
    return found


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dra-agent"


@dataclass(frozen=True)
class GoPrograms:
    """Go programs of one module directory of tests/, built once into `<cache>/dra-agent/<name>-<hash>/`: this
    file's own (gocheck), tests/helm's and tests/promtool's."""

    name: str  # the cache directory's prefix, and what messages start with
    here: Path  # the module directory: go.mod, go.sum, the Go sources
    programs: dict[str, str]  # binary name -> Go package
    timeout: int  # seconds a build may take (a cold module cache downloads the modules first)
    skips: str  # what skips without Go ("tests/test_official_readers.py")

    def source_hash(self, go: str) -> str:
        # The toolchain by its file, not by asking it (`go env` costs a fifth of a second): another Go
        # installed there has another size or time.
        tool = Path(go).resolve()
        st = tool.stat()
        digest = hashlib.sha256(f"{tool}\0{st.st_size}\0{st.st_mtime_ns}\0{sorted(self.programs.items())}\0".encode())
        for path in sorted([self.here / "go.mod", self.here / "go.sum", *self.here.glob("**/*.go")]):
            digest.update(str(path.relative_to(self.here)).encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()[:16]

    def binary(self, program: str) -> Path:
        """The program's path, built first when no binary of these sources is cached."""
        go = go_tool(f"{self.name} (tests/{self.here.name})")
        target = cache_root() / f"{self.name}-{self.source_hash(go)}" / program
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: a build interrupted, or two at once, never leaves a
        # half-written binary at the final path.
        fd, tmp = tempfile.mkstemp(prefix=f".{program}-", dir=target.parent)
        os.close(fd)
        try:
            # -mod=readonly: go.sum must already hold every module; a build never rewrites the repository.
            built = subprocess.run([go, "build", "-mod=readonly", "-trimpath", "-o", tmp, self.programs[program]],
                                   cwd=self.here, capture_output=True, text=True, timeout=self.timeout)
            if built.returncode != 0:
                raise BuildFailed(f"go build of {self.programs[program]} in {self.here} failed (exit "
                                  f"{built.returncode}):\n{built.stderr}{built.stdout}")
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return target

    def for_test(self, program: str) -> Path:
        """The program for a test: without Go the test skips (a failure where DRA_TEST_NO_SKIP is set, as every
        skip is), a failed build fails it. pytest is imported here alone: `make` runs this file without it."""
        import pytest

        try:
            return self.binary(program)
        except GoMissing as e:
            pytest.skip(str(e))
        except BuildFailed as e:
            pytest.fail(str(e))

    def main(self) -> int:
        """Build (or find) every program and print its path; the exit status `make` reads."""
        try:
            for program in self.programs:
                print(self.binary(program))
        except GoMissing as e:
            if os.environ.get("DRA_TEST_NO_SKIP", "") not in ("", "0"):
                print(f"{self.name}: {e}", file=sys.stderr)
                return 1
            print(f"{self.name}: {e}; {self.skips} will skip", file=sys.stderr)
        except BuildFailed as e:
            print(f"{self.name}: {e}", file=sys.stderr)
            return 1
        return 0


GOCHECK = GoPrograms("gocheck", HERE, {"gocheck": ".", "kubeletreg": "./kubeletreg",
                                       "deviceplugin": "./deviceplugin"},
                     BUILD_TIMEOUT, "tests/test_official_readers.py, test_registration.py and the migration test")


def binary(program: str = "gocheck") -> Path:
    return GOCHECK.binary(program)


if __name__ == "__main__":
    sys.exit(GOCHECK.main())

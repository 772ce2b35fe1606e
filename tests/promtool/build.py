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
failed build always exits 1 with Go's output. The builder is tests/gocheck/build.py's `GoPrograms`;
standard library only: `make` runs it before the virtual environment matters.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Binary name -> Go package.
PROGRAMS = {"promtool": "github.com/prometheus/prometheus/cmd/promtool", "promqlnames": "./promqlnames"}
BUILD_TIMEOUT = 3600  # cold: Prometheus's module graph downloaded and compiled (over 30 min on a busy 2-core machine)


sys.path.insert(0, str(HERE.parent))  # tests/: run as a script, this directory alone is on the path
from gocheck import build as _go  # noqa: E402  (the builder)

GoMissing = _go.GoMissing
BuildFailed = _go.BuildFailed
PROMTOOL = _go.GoPrograms("promtool", HERE, PROGRAMS, BUILD_TIMEOUT, "tests/test_monitoring.py's promtool tests")


def binary(program: str = "promtool") -> Path:
    """The program's path, built first when no binary of these sources is cached."""
    return Path(PROMTOOL.binary(program))


if __name__ == "__main__":
    sys.exit(PROMTOOL.main())

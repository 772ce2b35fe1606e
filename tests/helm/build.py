"""Builds Helm's command line (`helm.sh/helm/v4/cmd/helm`, pinned by go.mod and go.sum here) once and
keeps it outside the repository, for tests/test_helm.py and tests/cluster/test_cluster_helm.py: `helm
lint`, `helm template`, and install, upgrade and uninstall against the real control plane.

The binary lives in `<cache>/dra-agent/helm-<hash>/helm`, where the hash covers go.mod, go.sum,
tools.go and the Go toolchain's binary: a change to one of them builds anew, anything else reuses it.
`make test` runs this file first (the `helm` target); the first build downloads and compiles Helm's
module graph (minutes), later runs cost nothing. The builder (Go, the cache, the temporary-name-then-rename
build) is tests/gocheck/build.py's `GoPrograms`.

    python tests/helm/build.py    # prints the binary's path

Without Go it says so and exits 0 (the tests then skip), or 1 when DRA_TEST_NO_SKIP is set; a failed
build always exits 1 with Go's output. Standard library only: `make` runs it before the virtual
environment matters.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "helm.sh/helm/v4/cmd/helm"
BUILD_TIMEOUT = 1800  # a cold module cache downloads Helm's module graph first


sys.path.insert(0, str(HERE.parent))  # tests/: run as a script, this directory alone is on the path
from gocheck import build as _go  # noqa: E402  (the builder)

GoMissing = _go.GoMissing
BuildFailed = _go.BuildFailed
HELM = _go.GoPrograms("helm", HERE, {"helm": PACKAGE}, BUILD_TIMEOUT, "tests/test_helm.py")


def binary() -> Path:
    """Helm's path, built first when no binary of these sources is cached."""
    return Path(HELM.binary("helm"))


if __name__ == "__main__":
    sys.exit(HELM.main())

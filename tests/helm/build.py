"""Builds Helm's command line (`helm.sh/helm/v4/cmd/helm`, pinned by go.mod and go.sum here) once and
keeps it outside the repository, for tests/test_helm.py and tests/cluster/test_cluster_helm.py: `helm
lint`, `helm template`, and install, upgrade and uninstall against the real control plane.

The binary lives in `<cache>/dra-agent/helm-<hash>/helm`, where the hash covers go.mod, go.sum,
tools.go and the Go toolchain's binary: a change to one of them builds anew, anything else reuses it.
`make test` runs this file first (the `helm` target); the first build downloads and compiles Helm's
module graph (minutes), later runs cost nothing. Go, the cache and the temporary-name-then-rename
build are tests/gocheck/build.py's.

    python tests/helm/build.py    # prints the binary's path

Without Go it says so and exits 0 (the tests then skip), or 1 when DRA_TEST_NO_SKIP is set; a failed
build always exits 1 with Go's output. Standard library only: `make` runs it before the virtual
environment matters.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
PACKAGE = "helm.sh/helm/v4/cmd/helm"
BUILD_TIMEOUT = 1800  # a cold module cache downloads Helm's module graph first


def _gocheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dra_gocheck_build", HERE.parent / "gocheck" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_go = _gocheck()
GoMissing = _go.GoMissing
BuildFailed = _go.BuildFailed


def source_hash(go: str) -> str:
    # The toolchain by its file, as tests/gocheck/build.py says why.
    tool = Path(go).resolve()
    st = tool.stat()
    digest = hashlib.sha256(f"{tool}\0{st.st_size}\0{st.st_mtime_ns}\0{PACKAGE}\0".encode())
    for path in (HERE / "go.mod", HERE / "go.sum", HERE / "tools.go"):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def binary() -> Path:
    """Helm's path, built first when no binary of these sources is cached."""
    go = _go.go_tool()
    target = Path(_go.cache_root()) / f"helm-{source_hash(go)}" / "helm"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".helm-", dir=target.parent)
    os.close(fd)
    try:
        # -mod=readonly: go.sum must already hold every module; a build never rewrites the repository.
        built = subprocess.run([go, "build", "-mod=readonly", "-trimpath", "-o", tmp, PACKAGE], cwd=HERE,
                               capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if built.returncode != 0:
            raise BuildFailed(f"go build {PACKAGE} in {HERE} failed (exit {built.returncode}):\n"
                              f"{built.stderr}{built.stdout}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def main() -> int:
    try:
        print(binary())
    except GoMissing as e:
        if os.environ.get("DRA_TEST_NO_SKIP", "") not in ("", "0"):
            print(f"helm: {e}", file=sys.stderr)
            return 1
        print(f"helm: {e}; tests/test_helm.py will skip", file=sys.stderr)
    except BuildFailed as e:
        print(f"helm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

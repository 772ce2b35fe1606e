#!/usr/bin/env python3
"""Build (or reuse) the Kubernetes control plane the cluster tests run against.

kube-apiserver, kube-scheduler and kube-controller-manager from `k8s.io/kubernetes`, and etcd from
`go.etcd.io/etcd/server/v3`, at the versions `tests/cluster/k8s/go.mod` pins, built with the Go
toolchain into `~/.cache/dra-agent/k8s-<version>/bin` (`$DRA_K8S_CACHE` overrides the directory),
outside the repository. A stamp beside the binaries records what they were built from (go.mod,
go.sum, tools.go, the Go version and the build flags): the binaries are reused while it matches,
and rebuilt when it does not.

    python3 tests/cluster/build.py            build unless the cached binaries are current; print bin/
    python3 tests/cluster/build.py --check    exit 1 (saying why) unless they are current; print bin/
    python3 tests/cluster/build.py --replace  print the replace block go.mod needs (see below)

`k8s.io/kubernetes` is not meant to be required as a module: its go.mod points every staging
module `k8s.io/<x>` at `./staging/src/k8s.io/<x>` and requires them at v0.0.0. Our go.mod pins
each of them to the matching published version instead (v1.37.2 -> v0.37.2); the build checks
that its replace block names exactly the staging modules of the pinned k8s.io/kubernetes, so a
version bump cannot silently build against mismatched staging modules.

Standard library only: `make` runs it before the virtual environment matters.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODULE_DIR = Path(__file__).resolve().parent / "k8s"
KUBERNETES = "k8s.io/kubernetes"
ETCD = "go.etcd.io/etcd/server/v3"
# Program name -> Go package. etcd's main package is its server module's root.
PROGRAMS = {
    "kube-apiserver": f"{KUBERNETES}/cmd/kube-apiserver",
    "kube-scheduler": f"{KUBERNETES}/cmd/kube-scheduler",
    "kube-controller-manager": f"{KUBERNETES}/cmd/kube-controller-manager",
    "etcd": ETCD,
}
# The version packages Kubernetes' own release build stamps (its hack/lib/version.sh); without them a
# component calls itself v0.0.0-master, and kubectl and the API's /version say so.
VERSION_PACKAGES = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")


class BuildError(RuntimeError):
    """The control plane is not there and could not be built; the message says what to do."""


@dataclass(frozen=True)
class Pins:
    kubernetes: str  # e.g. v1.37.2
    etcd: str  # e.g. v3.7.0


def pins(go_mod: str) -> Pins:
    def required(module: str) -> str:
        found = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", go_mod, re.MULTILINE)
        if not found:
            raise BuildError(f"{MODULE_DIR / 'go.mod'} requires no {module}")
        return found.group(1)

    return Pins(required(KUBERNETES), required(ETCD))


def cache_dir(version: str) -> Path:
    root = os.environ.get("DRA_K8S_CACHE")
    if root:
        return Path(root)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dra-agent" / f"k8s-{version}"


def _go(*args: str, capture: bool = True) -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError("no `go` on PATH: the cluster tests need Go >= 1.26 to build the Kubernetes "
                         "control plane (tests/cluster/build.py)")
    done = subprocess.run([go, *args], cwd=MODULE_DIR, text=True, check=False,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None,
                          env={**os.environ, "GOFLAGS": "-mod=readonly"})
    if done.returncode != 0:
        detail = (done.stderr or "").strip()[-4000:] if capture else "(output above)"
        raise BuildError(f"`go {' '.join(args)}` failed in {MODULE_DIR}: {detail}")
    return done.stdout or ""


def staging_modules(pin: Pins) -> list[str]:
    """The modules k8s.io/kubernetes keeps under ./staging: each needs a replace line in our go.mod."""
    info = json.loads(_go("mod", "download", "-json", f"{KUBERNETES}@{pin.kubernetes}"))
    text = Path(info["GoMod"]).read_text()
    return sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/src/\1\s*$", text, re.MULTILINE)))


def staging_version(pin: Pins) -> str:
    """k8s.io/kubernetes v1.X.Y publishes its staging modules as v0.X.Y."""
    major, rest = pin.kubernetes.removeprefix("v").split(".", 1)
    if major != "1":
        raise BuildError(f"unexpected Kubernetes version {pin.kubernetes}")
    return f"v0.{rest}"


def replace_block(pin: Pins) -> str:
    version = staging_version(pin)
    lines = "".join(f"\t{m} => {m} {version}\n" for m in staging_modules(pin))
    return f"replace (\n{lines})\n"


def check_replaces(go_mod: str, pin: Pins) -> None:
    wanted = {m: staging_version(pin) for m in staging_modules(pin)}
    have = dict(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\1\s+(v\S+)\s*$", go_mod, re.MULTILINE))
    if have != wanted:
        missing = sorted(set(wanted) - set(have))
        extra = sorted(set(have) - set(wanted))
        wrong = sorted(m for m in set(have) & set(wanted) if have[m] != wanted[m])
        raise BuildError(f"{MODULE_DIR / 'go.mod'}: the replace block does not pin {KUBERNETES} "
                         f"{pin.kubernetes}'s staging modules to {staging_version(pin)} (missing {missing}, "
                         f"not staging {extra}, other versions {wrong}); `build.py --replace` prints it")


def ldflags(pin: Pins) -> str:
    major, minor, _ = pin.kubernetes.removeprefix("v").split(".", 2)
    flags = ["-s"]
    for pkg in VERSION_PACKAGES:
        flags += [f"-X {pkg}.gitVersion={pin.kubernetes}", f"-X {pkg}.gitMajor={major}",
                  f"-X {pkg}.gitMinor={minor}", f"-X {pkg}.gitTreeState=clean"]
    return " ".join(flags)


def stamp(pin: Pins) -> str:
    """What the binaries are built from; they are reused only while this stays the same."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "tools.go"):
        digest.update(name.encode() + b"\0" + (MODULE_DIR / name).read_bytes() + b"\0")
    digest.update(_go("env", "GOVERSION").strip().encode() + b"\0")
    digest.update(ldflags(pin).encode() + b"\0" + " ".join(PROGRAMS.values()).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Components:
    bin: Path
    version: str

    def path(self, program: str) -> Path:
        return self.bin / program


def current(pin: Pins, want: str) -> tuple[Components | None, str]:
    """The cached binaries when they were built from `want`, else None and why not."""
    root = cache_dir(pin.kubernetes)
    bin_dir = root / "bin"
    stamp_file = root / "stamp"
    if not stamp_file.is_file():
        return None, f"nothing built in {root} yet"
    if stamp_file.read_text().strip() != want:
        return None, f"{root} was built from another go.mod/go.sum/tools.go or Go version"
    for program in PROGRAMS:
        exe = bin_dir / program
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            return None, f"{exe} is missing"
    return Components(bin_dir, pin.kubernetes), ""


def _verify(components: Components, pin: Pins) -> None:
    """Each binary runs and says it is the version pinned (a truncated or foreign binary would not)."""
    expected = {"etcd": f"etcd Version: {pin.etcd.removeprefix('v')}"}
    for program in PROGRAMS:
        done = subprocess.run([str(components.path(program)), "--version"], capture_output=True, text=True,
                              timeout=60, check=False)
        said = (done.stdout + done.stderr).strip()
        wanted = expected.get(program, f"Kubernetes {pin.kubernetes}")
        if done.returncode != 0 or wanted not in said:
            raise BuildError(f"{components.path(program)} --version: exit {done.returncode}, said {said[:300]!r}; "
                             f"expected {wanted!r}")


def build(pin: Pins, want: str, *, quiet: bool = False) -> Components:
    root = cache_dir(pin.kubernetes)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build of the same cache finishes first
        found, _ = current(pin, want)
        if found is not None:
            return found
        check_replaces((MODULE_DIR / "go.mod").read_text(), pin)
        out = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        try:
            started = time.monotonic()
            if not quiet:
                print(f"building the Kubernetes {pin.kubernetes} control plane and etcd {pin.etcd} into {root} "
                      "(about ten minutes on two cores the first time; reused afterwards)", file=sys.stderr)
            _go("build", "-trimpath", f"-ldflags={ldflags(pin)}", "-o", str(out) + "/", *PROGRAMS.values(),
                capture=quiet)
            (out / "server").rename(out / "etcd")  # go names a ".../server/v3" main package `server`
            _verify(Components(out, pin.kubernetes), pin)
            (out / "stamp").write_text(want + "\n")
            old = root / "bin"
            with contextlib.suppress(FileNotFoundError):
                (root / "stamp").unlink()
            if old.exists():
                shutil.rmtree(old)
            out.chmod(0o755)
            out.rename(old)
            (old / "stamp").rename(root / "stamp")
            if not quiet:
                print(f"built in {time.monotonic() - started:.0f} s", file=sys.stderr)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    found, why = current(pin, want)
    if found is None:
        raise BuildError(f"built, but {why}")
    return found


def ensure(*, build_missing: bool, quiet: bool = False) -> Components:
    """The current control plane; built first when `build_missing`, else BuildError saying why it is not there."""
    pin = pins((MODULE_DIR / "go.mod").read_text())
    want = stamp(pin)
    found, why = current(pin, want)
    if found is not None:
        return found
    if not build_missing:
        raise BuildError(f"no Kubernetes {pin.kubernetes} control plane built for the cluster tests ({why}): "
                         "run `make cluster-components` (tests/cluster/build.py)")
    return build(pin, want, quiet=quiet)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="only check that the cached binaries are current")
    group.add_argument("--replace", action="store_true", help="print the replace block go.mod needs")
    args = parser.parse_args()
    try:
        if args.replace:
            print(replace_block(pins((MODULE_DIR / "go.mod").read_text())), end="")
            return 0
        components = ensure(build_missing=not args.check)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(components.bin)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Build (or reuse) the Kubernetes components the cluster tests run.

Two sets, each built with the Go toolchain at the versions its Go modules pin, into
`~/.cache/dra-agent/k8s-<version>/` (`$DRA_K8S_CACHE` overrides the directory), outside the
repository:

- the control plane (`bin/`): kube-apiserver, kube-scheduler and kube-controller-manager from
  `k8s.io/kubernetes`, and etcd from `go.etcd.io/etcd/server/v3`, pinned by `tests/cluster/k8s`;
- the node (`node/bin/`, `--node`): the kubelet of the same `k8s.io/kubernetes` release
  (`tests/cluster/kubelet`), containerd, ctr and containerd-shim-runc-v2 from
  `github.com/containerd/containerd/v2` (`tests/cluster/containerd`), runc from
  `github.com/opencontainers/runc` (`tests/cluster/runc`; cgo and libseccomp, as runc's release
  builds it) and the CNI plugins bridge, host-local and loopback from
  `github.com/containernetworking/plugins` (`tests/cluster/cni`).

A stamp beside each set records what it was built from (each module's go.mod, go.sum and tools.go,
the Go version, the packages, tags and flags): the binaries are reused while it matches, and rebuilt
when it does not.

    python3 tests/cluster/build.py [--node]            build unless current; print the bin directory
    python3 tests/cluster/build.py [--node] --check    exit 1 (saying why) unless current; print it
    python3 tests/cluster/build.py --replace           print the replace block go.mod needs (see below)

`k8s.io/kubernetes` is not meant to be required as a module: its go.mod points every staging
module `k8s.io/<x>` at `./staging/src/k8s.io/<x>` and requires them at v0.0.0. Our go.mod files pin
each of them to the matching published version instead (v1.37.2 -> v0.37.2); the build checks
that their replace blocks name exactly the staging modules of the pinned k8s.io/kubernetes, and
that the kubelet's module pins the control plane's release, so a version bump cannot silently build
against mismatched staging modules or a kubelet of another release.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULE_DIR = HERE / "k8s"
KUBELET_DIR = HERE / "kubelet"
CONTAINERD_DIR = HERE / "containerd"
RUNC_DIR = HERE / "runc"
CNI_DIR = HERE / "cni"
KUBERNETES = "k8s.io/kubernetes"
ETCD = "go.etcd.io/etcd/server/v3"
CONTAINERD = "github.com/containerd/containerd/v2"
RUNC = "github.com/opencontainers/runc"
CNI_PLUGINS = "github.com/containernetworking/plugins"
# The CNI plugins of the node's pod network (nodekit.cni_config): a bridge, its addresses, and lo.
CNI_PROGRAMS = {"bridge": f"{CNI_PLUGINS}/plugins/main/bridge",
                "host-local": f"{CNI_PLUGINS}/plugins/ipam/host-local",
                "loopback": f"{CNI_PLUGINS}/plugins/main/loopback"}
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
# containerd's release build (its Makefile): no documentation generator in the CLI, and none of the
# snapshotters that need C headers or tools the tests do not use; the shim without the gRPC server
# it does not serve. CGO off: static binaries, no C toolchain needed.
CONTAINERD_TAGS = ("urfave_cli_no_docs", "no_btrfs", "no_devmapper", "no_zfs")
SHIM_TAGS = (*CONTAINERD_TAGS, "no_grpc")
# runc's release build: seccomp through libseccomp (cgo; Debian's libseccomp-dev), so that a pod's
# seccomp profile is applied, not refused as unsupported. runc's nsenter is C as well.
RUNC_TAGS = ("seccomp",)


class BuildError(RuntimeError):
    """The components are not there and could not be built; the message says what to do."""


@dataclass(frozen=True)
class Pins:
    kubernetes: str  # e.g. v1.37.2
    etcd: str  # e.g. v3.7.0


def required(go_mod: str, module: str, where: Path) -> str:
    found = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", go_mod, re.MULTILINE)
    if not found:
        raise BuildError(f"{where / 'go.mod'} requires no {module}")
    return found.group(1)


def pins(go_mod: str) -> Pins:
    return Pins(required(go_mod, KUBERNETES, MODULE_DIR), required(go_mod, ETCD, MODULE_DIR))


def cache_dir(version: str) -> Path:
    root = os.environ.get("DRA_K8S_CACHE")
    if root:
        return Path(root)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dra-agent" / f"k8s-{version}"


def _go(*args: str, capture: bool = True, cwd: Path = MODULE_DIR, env: Mapping[str, str] | None = None) -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError("no `go` on PATH: the cluster tests need Go >= 1.26 to build the Kubernetes "
                         "components (tests/cluster/build.py)")
    done = subprocess.run([go, *args], cwd=cwd, text=True, check=False,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None,
                          env={**os.environ, "GOFLAGS": "-mod=readonly", **(env or {})})
    if done.returncode != 0:
        detail = (done.stderr or "").strip()[-4000:] if capture else "(output above)"
        raise BuildError(f"`go {' '.join(args)}` failed in {cwd}: {detail}")
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


def check_replaces(go_mod: str, pin: Pins, where: Path = MODULE_DIR) -> None:
    wanted = {m: staging_version(pin) for m in staging_modules(pin)}
    have = dict(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\1\s+(v\S+)\s*$", go_mod, re.MULTILINE))
    if have != wanted:
        missing = sorted(set(wanted) - set(have))
        extra = sorted(set(have) - set(wanted))
        wrong = sorted(m for m in set(have) & set(wanted) if have[m] != wanted[m])
        raise BuildError(f"{where / 'go.mod'}: the replace block does not pin {KUBERNETES} "
                         f"{pin.kubernetes}'s staging modules to {staging_version(pin)} (missing {missing}, "
                         f"not staging {extra}, other versions {wrong}); `build.py --replace` prints it")


def ldflags(pin: Pins) -> str:
    major, minor, _ = pin.kubernetes.removeprefix("v").split(".", 2)
    flags = ["-s"]
    for pkg in VERSION_PACKAGES:
        flags += [f"-X {pkg}.gitVersion={pin.kubernetes}", f"-X {pkg}.gitMajor={major}",
                  f"-X {pkg}.gitMinor={minor}", f"-X {pkg}.gitTreeState=clean"]
    return " ".join(flags)


def containerd_ldflags(version: str) -> str:
    return f"-s -X {CONTAINERD}/version.Version={version}"


def runc_ldflags(version: str) -> str:
    return f"-s -X main.version={version.removeprefix('v')}"


def cni_ldflags(version: str) -> str:
    return f"-s -X {CNI_PLUGINS}/pkg/utils/buildversion.BuildVersion={version}"


def _module_files(digest: hashlib._Hash, module: Path) -> None:
    for name in ("go.mod", "go.sum", "tools.go"):
        digest.update(name.encode() + b"\0" + (module / name).read_bytes() + b"\0")


def stamp(pin: Pins) -> str:
    """What the control plane is built from; it is reused only while this stays the same."""
    digest = hashlib.sha256()
    _module_files(digest, MODULE_DIR)
    digest.update(_go("env", "GOVERSION").strip().encode() + b"\0")
    digest.update(ldflags(pin).encode() + b"\0" + " ".join(PROGRAMS.values()).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Group:
    """Packages built by one `go build` in one module with the same tags, flags and environment."""

    module: Path
    programs: Mapping[str, str]  # program name -> Go package
    ldflags: str
    tags: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    renames: Mapping[str, str] = field(default_factory=dict)  # the name go gives -> the program's

    def args(self, out: Path) -> list[str]:
        tags = [f"-tags={','.join(self.tags)}"] if self.tags else []
        return ["build", "-trimpath", *tags, f"-ldflags={self.ldflags}", "-o", str(out) + "/",
                *self.programs.values()]


@dataclass(frozen=True)
class Bundle:
    """A set of programs built, stamped and reused together under `<cache>/<subdir>`."""

    title: str
    subdir: str
    groups: tuple[Group, ...]
    versions: Mapping[str, tuple[str, str]]  # program -> (its version flag, what its answer must contain)
    want: Callable[[], str]  # the stamp
    check: Callable[[], None]  # consistency checks before building
    note: str  # said before a build

    @property
    def programs(self) -> list[str]:
        return [p for g in self.groups for p in g.programs]


@dataclass(frozen=True)
class Components:
    bin: Path
    version: str

    def path(self, program: str) -> Path:
        return self.bin / program


def control_plane(pin: Pins) -> Bundle:
    return Bundle(
        title=f"the Kubernetes {pin.kubernetes} control plane and etcd {pin.etcd}", subdir="",
        groups=(Group(MODULE_DIR, PROGRAMS, ldflags(pin), renames={"server": "etcd"}),),
        versions={**{p: ("--version", f"Kubernetes {pin.kubernetes}") for p in PROGRAMS},
                  "etcd": ("--version", f"etcd Version: {pin.etcd.removeprefix('v')}")},
        want=lambda: stamp(pin),
        check=lambda: check_replaces((MODULE_DIR / "go.mod").read_text(), pin),
        note="about ten minutes on two cores the first time; reused afterwards")


def node(pin: Pins) -> Bundle:
    kubelet_mod = (KUBELET_DIR / "go.mod").read_text()
    containerd = required((CONTAINERD_DIR / "go.mod").read_text(), CONTAINERD, CONTAINERD_DIR)
    runc = required((RUNC_DIR / "go.mod").read_text(), RUNC, RUNC_DIR)
    cni = required((CNI_DIR / "go.mod").read_text(), CNI_PLUGINS, CNI_DIR)
    static = {"CGO_ENABLED": "0"}
    groups = (
        Group(KUBELET_DIR, {"kubelet": f"{KUBERNETES}/cmd/kubelet"}, ldflags(pin)),
        Group(CONTAINERD_DIR, {"containerd": f"{CONTAINERD}/cmd/containerd", "ctr": f"{CONTAINERD}/cmd/ctr"},
              containerd_ldflags(containerd), CONTAINERD_TAGS, static),
        Group(CONTAINERD_DIR, {"containerd-shim-runc-v2": f"{CONTAINERD}/cmd/containerd-shim-runc-v2"},
              containerd_ldflags(containerd), SHIM_TAGS, static),
        Group(RUNC_DIR, {"runc": RUNC}, runc_ldflags(runc), RUNC_TAGS, {"CGO_ENABLED": "1"}),
        Group(CNI_DIR, CNI_PROGRAMS, cni_ldflags(cni), (), static),
    )

    def want() -> str:
        digest = hashlib.sha256()
        for module in (KUBELET_DIR, CONTAINERD_DIR, RUNC_DIR, CNI_DIR):
            _module_files(digest, module)
        digest.update(_go("env", "GOVERSION").strip().encode() + b"\0")
        for g in groups:
            digest.update(json.dumps([g.args(Path("/")), sorted(g.env.items())]).encode() + b"\0")
        return digest.hexdigest()

    def check() -> None:
        kubelet_pin = required(kubelet_mod, KUBERNETES, KUBELET_DIR)
        if kubelet_pin != pin.kubernetes:
            raise BuildError(f"{KUBELET_DIR / 'go.mod'} pins {KUBERNETES} {kubelet_pin}, the control plane "
                             f"({MODULE_DIR / 'go.mod'}) {pin.kubernetes}: they must be the same release")
        check_replaces(kubelet_mod, pin, KUBELET_DIR)

    return Bundle(
        title=f"the Kubernetes {pin.kubernetes} kubelet, containerd {containerd}, runc {runc} and the CNI "
              f"plugins {cni}", subdir="node",
        groups=groups,
        versions={"kubelet": ("--version", f"Kubernetes {pin.kubernetes}"),
                  "containerd": ("--version", f"{CONTAINERD} {containerd}"),
                  "ctr": ("--version", f"{CONTAINERD} {containerd}"),
                  "containerd-shim-runc-v2": ("-v", f"Version:  {containerd}"),
                  "runc": ("--version", f"runc version {runc.removeprefix('v')}"),
                  **{p: ("--version", f"CNI {p} plugin {cni}") for p in CNI_PROGRAMS}},
        want=want, check=check, note="a few minutes on two cores after the control plane; reused afterwards")


def _root(bundle: Bundle, pin: Pins) -> Path:
    return cache_dir(pin.kubernetes) / bundle.subdir


def current(bundle: Bundle, pin: Pins, want: str) -> tuple[Components | None, str]:
    """The cached binaries when they were built from `want`, else None and why not."""
    root = _root(bundle, pin)
    bin_dir = root / "bin"
    stamp_file = root / "stamp"
    if not stamp_file.is_file():
        return None, f"nothing built in {root} yet"
    if stamp_file.read_text().strip() != want:
        return None, f"{root} was built from other go.mod/go.sum/tools.go files, flags or Go version"
    for program in bundle.programs:
        exe = bin_dir / program
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            return None, f"{exe} is missing"
    return Components(bin_dir, pin.kubernetes), ""


def _verify(bundle: Bundle, components: Components) -> None:
    """Each binary runs and says it is the version pinned (a truncated or foreign binary would not)."""
    for program, (flag, wanted) in bundle.versions.items():
        done = subprocess.run([str(components.path(program)), flag], capture_output=True, text=True,
                              timeout=60, check=False)
        said = (done.stdout + done.stderr).strip()
        if done.returncode != 0 or wanted not in said:
            raise BuildError(f"{components.path(program)} {flag}: exit {done.returncode}, said {said[:300]!r}; "
                             f"expected {wanted!r}")


def build(bundle: Bundle, pin: Pins, want: str, *, quiet: bool = False) -> Components:
    root = _root(bundle, pin)
    root.mkdir(parents=True, exist_ok=True)
    with open(cache_dir(pin.kubernetes) / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build of the same cache finishes first
        found, _ = current(bundle, pin, want)
        if found is not None:
            return found
        bundle.check()
        out = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        try:
            started = time.monotonic()
            if not quiet:
                print(f"building {bundle.title} into {root} ({bundle.note})", file=sys.stderr)
            for group in bundle.groups:
                _go(*group.args(out), capture=quiet, cwd=group.module, env=group.env)
                for built, name in group.renames.items():
                    (out / built).rename(out / name)
            _verify(bundle, Components(out, pin.kubernetes))
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
    found, why = current(bundle, pin, want)
    if found is None:
        raise BuildError(f"built, but {why}")
    return found


def ensure(*, build_missing: bool, quiet: bool = False, node_set: bool = False) -> Components:
    """The current control plane (or, with `node_set`, the kubelet and containerd); built first when
    `build_missing`, else BuildError saying why it is not there."""
    pin = pins((MODULE_DIR / "go.mod").read_text())
    bundle = node(pin) if node_set else control_plane(pin)
    want = bundle.want()
    found, why = current(bundle, pin, want)
    if found is not None:
        return found
    if not build_missing:
        target = "kubelet-components" if node_set else "cluster-components"
        raise BuildError(f"{bundle.title} not built for the cluster tests ({why}): "
                         f"run `make {target}` (tests/cluster/build.py{' --node' if node_set else ''})")
    return build(bundle, pin, want, quiet=quiet)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--node", action="store_true", help="the kubelet and containerd, not the control plane")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="only check that the cached binaries are current")
    group.add_argument("--replace", action="store_true", help="print the replace block go.mod needs")
    args = parser.parse_args()
    try:
        if args.replace:
            print(replace_block(pins((MODULE_DIR / "go.mod").read_text())), end="")
            return 0
        components = ensure(build_missing=not args.check, node_set=args.node)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(components.bin)
    return 0


if __name__ == "__main__":
    sys.exit(main())

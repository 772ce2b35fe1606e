"""Build a release: the image for every architecture as one OCI archive, and the Helm chart, of one version.

    python image/release.py [--out DIR]

what `make release` runs (docs/image.md, "A release"). The version is the agent's, from its one source
(agent/__init__.py); the chart's version and appVersion must be the same (the build refuses another).
It writes DIR/<version>/ (default dist/<version>/):

- dra-agent-<version>.oci.tar: an OCI image layout in a tar, whose index holds one image index with
  a manifest per architecture (linux/amd64, linux/arm64), each built as `make image-offline` builds
  (image/build.py: a Debian base made by mmdebstrap for that architecture, that architecture's wheels
  downloaded by the host's pip, `podman build --network none --platform ...`);
- dra-agent-<version>.tgz: `helm package` of deploy/helm/dra-agent (Helm as tests/helm/build.py builds it);
- SHA256SUMS of both, as `sha256sum -c` reads it.

The foreign architecture's programs (its Debian packages' maintainer scripts, the build's pip and Python)
run under qemu-user-static through the kernel's binfmt_misc. Where binfmt_misc is not mounted this
mounts it, and where qemu has no registration for that architecture this registers Debian's
(/usr/lib/binfmt.d/qemu-<machine>.conf, with its F flag: the interpreter is opened once, here, so it
runs inside containers too); it says so, needs root for it, and leaves a mount or a registration that
was already there as it was. What it adds stays after the build (docs/image.md).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHART = ROOT / "deploy" / "helm" / "dra-agent"
DIST = ROOT / "dist"
REPOSITORY = "localhost/dra-agent"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
BINFMT_CONF = Path("/usr/lib/binfmt.d")  # qemu-user-static's registrations, in systemd-binfmt's format


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


image = _load("dra_image_build", HERE / "build.py")
BuildError = image.BuildError
log = image.log


@dataclass(frozen=True)
class Release:
    version: str
    directory: Path
    archive: Path
    chart: Path | None
    images: tuple[str, ...]  # in podman's storage, one an architecture: `<repository>:<version>-<arch>`


def ensure_qemu(arch: image.Arch) -> None:
    """Make the kernel run `arch`'s programs with qemu-user-static, adding only what is missing."""
    name = f"qemu-{arch.machine}"
    if not (BINFMT / "status").exists():
        log(f"qemu: mounting binfmt_misc at {BINFMT} (it was not mounted; it stays mounted)")
        image._run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)])
    entry = BINFMT / name
    if entry.exists():
        state = entry.read_text()
        if not state.startswith("enabled"):
            raise BuildError(f"{entry} is registered but disabled: `echo 1 > {entry}` enables it")
        flags = re.search(r"^flags: *(\S*)$", state, re.MULTILINE)
        if flags is None or "F" not in flags.group(1):
            raise BuildError(f"{entry} has no F flag, so containers cannot find its interpreter: remove it "
                             f"(`echo -1 > {entry}`) and this registers Debian's, with F")
        log(f"qemu: {arch.machine} programs run by {entry} (registered already)")
        return
    conf = BINFMT_CONF / f"{name}.conf"
    if not conf.is_file():
        raise BuildError(f"no {conf}: `apt-get install qemu-user-static` runs {arch.debian} programs here")
    line = next(line for line in conf.read_text().splitlines() if line.startswith(":"))
    if "F" not in line.rsplit(":", 1)[1]:
        line += "F"  # F: opened now, so found inside the build's containers too
    log(f"qemu: registering {name} from {conf} with binfmt_misc (it stays registered)")
    try:
        (BINFMT / "register").write_text(line)
    except OSError as e:
        raise BuildError(f"registering {name} with {BINFMT / 'register'} failed ({e}): it needs root") from e


def chart_version() -> tuple[str, str]:
    """The chart's version and appVersion, from its Chart.yaml (top-level keys, one a line)."""
    text = (CHART / "Chart.yaml").read_text()
    found = [re.search(rf'^{key}: *"?([^"\s]+)"?', text, re.MULTILINE) for key in ("version", "appVersion")]
    if found[0] is None or found[1] is None:
        raise BuildError(f"{CHART / 'Chart.yaml'} has no version or appVersion")
    return found[0].group(1), found[1].group(1)


def helm() -> Path | None:
    """Helm as tests/helm/build.py builds it (cached), or None without Go."""
    builder = _load("dra_helm_build", ROOT / "tests" / "helm" / "build.py")
    try:
        return Path(builder.binary())
    except builder.GoMissing as e:
        log(f"chart: no Helm ({e}): the release has no chart package")
        return None


def sha256sums(directory: Path, files: Sequence[Path]) -> Path:
    sums = directory / "SHA256SUMS"
    lines = []
    for path in files:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        lines.append(f"{digest.hexdigest()}  {path.name}\n")
    sums.write_text("".join(lines))
    return sums


def build_release(out: Path = DIST, podman: Sequence[str] = ("podman",), layers: bool = True,
                  chart: bool = True, repository: str = REPOSITORY) -> Release:
    """Build the release into out/<version>/; the images stay in podman's storage as
    `<repository>:<version>-<arch>`."""
    started = time.monotonic()
    version = image.agent_version()
    if chart and chart_version() != (version, version):
        raise BuildError(f"{CHART / 'Chart.yaml'} says version/appVersion {chart_version()}, the agent is "
                         f"{version}: one version for both")
    directory = out / version
    directory.mkdir(parents=True, exist_ok=True)
    host = image.host_arch()
    images = []
    for arch in image.ARCHES:
        if arch != host:
            ensure_qemu(arch)
        images.append(f"{repository}:{version}-{arch.debian}")
        image.build(images[-1], podman=podman, layers=layers, arch=arch)
    archive = directory / f"dra-agent-{version}.oci.tar"
    archive.unlink(missing_ok=True)
    log(f"archive {archive}: a manifest list of {', '.join(images)} (podman manifest push --all, OCI)")
    # The list lives in podman's storage only while it is pushed: podman 4.3's `podman images` fails
    # while a list there lacks an image for the host's architecture (docs/image.md, "A release").
    manifest_list = f"{repository}:{version}-list-{os.getpid()}"
    image._run([*podman, "manifest", "create", manifest_list])
    try:
        for tag in images:
            image._run([*podman, "manifest", "add", manifest_list, f"containers-storage:{tag}"])
        image._run([*podman, "manifest", "push", "--all", "--format", "oci", "--quiet", manifest_list,
                    f"oci-archive:{archive}:{version}"])
    finally:
        image._run([*podman, "manifest", "rm", manifest_list])
    files = [archive]
    package = None
    if chart and (tool := helm()) is not None:
        for old in directory.glob("dra-agent-*.tgz"):
            old.unlink()
        log(f"chart: helm package {CHART.relative_to(ROOT)} ({version})")
        image._run([str(tool), "package", str(CHART), "--destination", str(directory)])
        package = directory / f"dra-agent-{version}.tgz"
        if not package.is_file():
            raise BuildError(f"helm package wrote no {package}")
        files.append(package)
    sha256sums(directory, files)
    log(f"release {version} in {directory} in {time.monotonic() - started:.0f} s: "
        f"{', '.join(p.name for p in files)}, SHA256SUMS")
    return Release(version, directory, archive, package, tuple(images))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DIST, help="the release goes into OUT/<version>/")
    args = parser.parse_args(argv)
    try:
        build_release(args.out.resolve())
    except (BuildError, subprocess.SubprocessError, OSError) as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.umask(0o022)  # the release's files readable by all, whatever the caller's umask
    sys.exit(main())

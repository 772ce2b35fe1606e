"""Build the dra-agent image from the Containerfile without any container registry.

    python image/build.py [--tag TAG] [--base IMAGE]

what `make image-offline` and the image test (tests/test_image.py, run in CI) do:

1. the base: a Debian root filesystem with Python made by `mmdebstrap` from Debian's own
   packages and imported into podman (`localhost/dra-agent-base:<suite>-<recipe hash>`; kept in
   podman's storage and reused while the recipe is unchanged), unless --base names one;
2. the wheelhouse: every wheel the build needs (the build system's requirements and the
   agent's dependencies, read from pyproject.toml) downloaded by the host's pip into
   .image/wheels, for the base's Python;
3. `podman build --network none` of the Containerfile with that base and that wheelhouse: the
   same two stages as a build from a registry base with PyPI, and nothing fetched from inside.

Each stage says what it does as it goes (stderr, one line a step: mmdebstrap's own stages, podman
build's STEP lines), since the base alone takes a minute or more. Needs podman, and mmdebstrap for the
base (Debian packages; .ci/run installs them).

`make release` (image/release.py) calls build() once an architecture (`arch`): the same three steps with
that architecture's Debian packages, wheels (.image/wheels-<machine> for a foreign one) and `--platform`.
Without `arch`, as `make image-offline` calls it, nothing of that applies.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import subprocess
import sys
import threading
import time
import tomllib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
CONTAINERFILE = ROOT / "Containerfile"
WHEELS = ROOT / ".image" / "wheels"
CONTEXT = "/src"  # where the build stage sees the repository (COPY . /src)
DEFAULT_TAG = "localhost/dra-agent:latest"

# The base: Debian's python3 from its essential packages, without documentation (copyrights kept).
SUITE = "bookworm"
PYTHON_VERSION = "3.11"  # bookworm's python3; the wheelhouse is downloaded for it
GLIBC_MINOR = 36  # bookworm's glibc 2.36
PACKAGES = ("python3", "python3-venv", "libstdc++6", "ca-certificates")  # grpcio and grpcio-tools need libstdc++
MMDEBSTRAP_OPTIONS = (
    "--variant=essential",
    "--dpkgopt=force-unsafe-io",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
)
BASE_CONFIG = (
    "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    'CMD=["python3"]',
)
BASE_REPOSITORY = "localhost/dra-agent-base"


class BuildError(RuntimeError):
    """A step failed; the message carries the tool's own error output."""

COMMAND_TIMEOUT = 900
ERROR_LINES = 200  # the tail of a failed step's output kept for its error message
# podman build's progress: `STEP 3/9: RUN ...` (`[1/2] STEP ...` in a multi-stage build) and `COMMIT`.
BUILD_STEP = re.compile(r"^(\[\d+/\d+\] )?(STEP \d+/\d+: |COMMIT )")


class Arch(NamedTuple):
    """One architecture by each of its names: Debian's and OCI's (`arm64`), the kernel's and the wheels'
    (`aarch64`). `make release` builds the image for each of ARCHES (image/release.py). A NamedTuple, not a
    dataclass: the tests load this file by its path, as a module that is not in sys.modules."""

    debian: str
    machine: str

    @property
    def platform(self) -> str:
        return f"linux/{self.debian}"


ARCHES = (Arch("amd64", "x86_64"), Arch("arm64", "aarch64"))


def host_arch() -> Arch:
    machine = platform.machine()
    for arch in ARCHES:
        if arch.machine == machine:
            return arch
    raise BuildError(f"no image is built on {machine}: the architectures are {[a.machine for a in ARCHES]}")


def log(message: str) -> None:
    print(f"image: {message}", file=sys.stderr, flush=True)


def _run(argv: Sequence[str], *, timeout: int = COMMAND_TIMEOUT) -> None:
    proc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(argv[:3])} ... failed ({proc.returncode}):\n{proc.stderr.strip()[-4000:]}")


def _follow(lines: Iterable[bytes], tail: deque[str], progress: Callable[[str], str | None]) -> None:
    """Keep the last lines of a step's output for its error message, and log the lines that say how far it
    got (`progress` gives the text to log, or None)."""
    for raw in lines:
        line = raw.decode(errors="replace").rstrip()
        tail.append(line)
        if (shown := progress(line)) is not None:
            log(shown)


def _run_showing(argv: Sequence[str], progress: Callable[[str], str | None], *,
                 timeout: int = COMMAND_TIMEOUT) -> None:
    """`_run`, logging the progress lines of the command's output (stdout and stderr together) as they come."""
    tail: deque[str] = deque(maxlen=ERROR_LINES)
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    timer = threading.Timer(timeout, proc.kill)  # a step that hangs is killed, and fails below
    timer.start()
    try:
        with proc.stdout:
            _follow(proc.stdout, tail, progress)
        proc.wait()
    finally:
        timer.cancel()
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(argv[:3])} ... failed ({proc.returncode}):\n" + "\n".join(tail)[-4000:])


def _build_step(line: str) -> str | None:
    return f"build: {line[:110]}" if BUILD_STEP.match(line) else None


def base_tag(arch: Arch | None = None) -> str:
    """The local base image's name: a new recipe is a new name, so a stale base is never reused. `arch`
    None is this machine's (the name `make image-offline` has always used)."""
    recipe = repr((SUITE, PACKAGES, MMDEBSTRAP_OPTIONS, BASE_CONFIG, arch.machine if arch else platform.machine()))
    return f"{BASE_REPOSITORY}:{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def image_exists(podman: Sequence[str], name: str) -> bool:
    return subprocess.run([*podman, "image", "exists", name], stdin=subprocess.DEVNULL,
                          capture_output=True).returncode == 0


def ensure_base(podman: Sequence[str] = ("podman",), arch: Arch | None = None) -> str:
    """The local Debian base image: reused when present, else made by mmdebstrap | podman import. `arch`
    another than this machine's: Debian's packages of that one, their maintainer scripts run by qemu
    (image/release.py registers it first), and the image says that architecture."""
    foreign = arch is not None and arch != host_arch()
    tag = base_tag(arch if foreign else None)
    if image_exists(podman, tag):
        log(f"base {tag} (cached)")
        return tag
    log(f"base {tag}: mmdebstrap {SUITE} {','.join(PACKAGES)}{f' for {arch.debian} (under qemu)' if foreign else ''}"
        f" | podman import ({'several minutes' if foreign else 'a minute or two'})")
    started = time.monotonic()
    changes = [a for c in BASE_CONFIG for a in ("--change", c)]
    arch_options = [f"--arch={arch.debian}"] if foreign and arch else []

    def stage(line: str) -> str | None:  # mmdebstrap's own `I: downloading packages with apt...`
        return f"base: {line[3:]} ({time.monotonic() - started:.0f} s)" if line.startswith("I: ") else None

    tail: deque[str] = deque(maxlen=ERROR_LINES)
    # The root filesystem streams as a tar from mmdebstrap's stdout into podman import's stdin; its
    # stderr is read as it comes, by a thread of its own, so that neither output can block it.
    debootstrap = subprocess.Popen(
        ["mmdebstrap", *MMDEBSTRAP_OPTIONS, *arch_options, f"--include={','.join(PACKAGES)}", SUITE, "-"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert debootstrap.stdout is not None and debootstrap.stderr is not None
    follower = threading.Thread(target=_follow, args=(debootstrap.stderr, tail, stage), daemon=True)
    follower.start()
    try:
        imported = subprocess.run([*podman, "import", *arch_options, *changes, "-", tag], stdin=debootstrap.stdout,
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    finally:
        debootstrap.stdout.close()
        debootstrap.wait(timeout=COMMAND_TIMEOUT)
        follower.join(timeout=COMMAND_TIMEOUT)
        debootstrap.stderr.close()
    if debootstrap.returncode != 0:
        subprocess.run([*podman, "rmi", "--force", tag], stdin=subprocess.DEVNULL, capture_output=True)
        raise BuildError(f"mmdebstrap failed ({debootstrap.returncode}):\n" + "\n".join(tail)[-4000:])
    if imported.returncode != 0:
        raise BuildError(f"podman import failed ({imported.returncode}):\n{imported.stderr.strip()}")
    log(f"base {tag} made in {time.monotonic() - started:.0f} s")
    return tag


def requirements() -> list[str]:
    """What the wheel's build and the installed agent need, from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [*project["build-system"]["requires"], *project["project"]["dependencies"]]


def platforms(machine: str | None = None) -> list[str]:
    """pip's --platform options for the base: glibc 2.36 (bookworm) takes every manylinux wheel up to it.

    pip does not widen a given platform to the older manylinux ones itself."""
    arch = machine or platform.machine()
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(GLIBC_MINOR, 4, -1)]
    tags += [f"manylinux{legacy}_{arch}" for legacy in ("2014", "2010", "1")]
    return [a for tag in tags for a in ("--platform", tag)]


def wheels_dir(arch: Arch | None = None) -> Path:
    """This machine's wheelhouse is .image/wheels; another architecture's .image/wheels-<machine> (both
    in the build context: .containerignore)."""
    return WHEELS if arch is None or arch == host_arch() else WHEELS.with_name(f"wheels-{arch.machine}")


def in_context(path: Path) -> str:
    """Where the build stage sees a path of the repository."""
    return f"{CONTEXT}/{path.relative_to(ROOT).as_posix()}"


def wheelhouse(python: str = sys.executable, arch: Arch | None = None) -> Path:
    """Every needed wheel (binary only, for the base's Python and `arch`, None this machine's) in
    wheels_dir(arch): what is there already when it satisfies pyproject.toml (no network), else
    downloaded by the host's pip."""
    wheels = wheels_dir(arch)
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"wheelhouse {wheels.relative_to(ROOT)}: the wheels pyproject.toml needs, for CPython {PYTHON_VERSION}"
        f"{f' on {arch.machine}' if arch else ''}")
    started = time.monotonic()
    download = [python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
                "--python-version", PYTHON_VERSION, "--implementation", "cp",
                "--abi", f"cp{PYTHON_VERSION.replace('.', '')}", *platforms(arch.machine if arch else None),
                "--dest", str(wheels)]
    try:
        _run([*download, "--no-index", "--find-links", str(wheels), *requirements()])
        how = "present"
    except BuildError:
        log("wheelhouse: downloading what is missing (pip)")
        _run([*download, *requirements()])
        how = "downloaded"
    log(f"wheelhouse {wheels.relative_to(ROOT)}: {len(list(wheels.glob('*.whl')))} wheels {how} "
        f"in {time.monotonic() - started:.0f} s")
    return wheels


def agent_version() -> str:
    """The agent's version, from its one source (agent/__init__.py), read without importing the agent: the
    image's VERSION build argument (its OCI labels; the build refuses one that is not the agent's)."""
    found = re.search(r'^__version__ = "([^"]+)"$', (ROOT / "agent" / "__init__.py").read_text(), re.MULTILINE)
    if found is None:
        raise BuildError("agent/__init__.py sets no __version__")
    return found.group(1)


def build(tag: str = DEFAULT_TAG, base: str | None = None, podman: Sequence[str] = ("podman",),
          layers: bool = True, arch: Arch | None = None) -> str:
    """Build the Containerfile offline; returns the image's ID. `arch` builds for that platform (None:
    this machine's, without naming one)."""
    base = base or ensure_base(podman, arch)
    wheels = wheelhouse(arch=arch)
    for_arch = f" for {arch.platform}" if arch else ""
    log(f"podman build {tag}{for_arch} from {base}, no network (two stages: the wheel, then the image)")
    started = time.monotonic()
    argv = [*podman, "build", "--network", "none", f"--layers={str(layers).lower()}",
            *(["--platform", arch.platform] if arch else []),
            "--build-arg", f"BASE={base}", "--build-arg", f"VERSION={agent_version()}",
            "--build-arg", f"PIP_OPTIONS=--no-index --find-links {in_context(wheels)}",
            "--file", str(CONTAINERFILE), "--tag", tag, str(ROOT)]
    _run_showing(argv, _build_step)
    image_id = subprocess.run([*podman, "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True,
                              text=True, check=True, stdin=subprocess.DEVNULL).stdout.strip()
    log(f"built {tag} ({image_id[:12]}) in {time.monotonic() - started:.0f} s")
    return image_id


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default=os.environ.get("IMAGE", DEFAULT_TAG), help="the image's name")
    parser.add_argument("--base", help="a base image already in podman's storage (default: made locally)")
    args = parser.parse_args(argv)
    try:
        build(args.tag, args.base)
    except (BuildError, subprocess.SubprocessError, OSError) as e:
        print(f"image: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

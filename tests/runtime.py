"""A real container runtime for tests: podman applies the CDI specs, runc runs the container.

These machines cannot `podman run` (no CAP_SYS_RESOURCE, so setting rlimits fails,
and crun refuses the hybrid cgroups). What works, as root:

1. an image imported from a busybox root filesystem (built once, reused while present);
2. `podman create --device <cdi id>` then `podman init`: podman's CDI library resolves the
   devices from /etc/cdi and /var/run/cdi and writes the edited OCI config into the
   container's userdata directory. Init itself then fails on rlimits, which does not matter;
   a CDI failure (an unknown device, a spec podman refuses) shows as a missing config;
3. that config, minus rlimits and namespace paths, with the podman-mounted root filesystem,
   run by `runc run` in a bundle directory of our own.

Every container, mount, bundle and spec file is removed on the way out, pass or fail.
Podman runs with cgroupfs and a file event log (flags, not system configuration), so the
cgroup path in the config is one runc can use without systemd.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import need_command, need_root

from cdi.store import remove_spec, write_spec

CDI_DIR = Path("/var/run/cdi")  # podman 4.3 reads only /etc/cdi and /var/run/cdi; this one wins
IMAGE = "localhost/dra-test-busybox:latest"
APPLETS = ("sh", "cat", "echo", "env", "ls", "stat", "test", "true", "false", "wc", "head", "sleep")
PODMAN_FLAGS = ("--cgroup-manager=cgroupfs", "--events-backend=file")
COMMAND_TIMEOUT = 120


class HarnessError(RuntimeError):
    """The runtime could not set up or run the container; the message carries the runtime's stderr."""


def need_runtime() -> None:
    """Skip (with the reason) unless root, podman, runc and a static busybox are here."""
    need_root()
    need_command("podman", "runc", "busybox")
    busybox = Path(shutil.which("busybox") or "busybox").resolve()
    if not is_static_elf(busybox):
        pytest.skip(f"{busybox} is dynamically linked; the test image needs busybox-static")


def is_static_elf(path: Path) -> bool:
    """True for an ELF executable without a program interpreter: it runs in an empty root."""
    with open(path, "rb") as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:  # 64-bit ELF only
            return False
        endian = "<" if header[5] == 1 else ">"
        phoff, = struct.unpack_from(endian + "Q", header, 0x20)
        phentsize, phnum = struct.unpack_from(endian + "HH", header, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    pt_interp = 3
    return all(struct.unpack_from(endian + "I", table, i * phentsize)[0] != pt_interp for i in range(phnum))


def unique_vendor() -> str:
    """A vendor no other test, person or driver on this machine uses."""
    return f"test-{secrets.token_hex(4)}.example.com"


def podman(*args: str, check: bool = True,
           timeout: int = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["podman", *PODMAN_FLAGS, *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)
    if check and proc.returncode != 0:
        raise HarnessError(f"podman {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def ensure_image() -> str:
    """The busybox test image, imported now unless it is already in podman's storage."""
    if podman("image", "exists", IMAGE, check=False).returncode == 0:
        return IMAGE
    busybox = Path(shutil.which("busybox") or "busybox").resolve()
    with tempfile.TemporaryDirectory(prefix="dra-test-rootfs-") as tmp:
        root = Path(tmp)
        for d in ("bin", "dev", "proc", "sys", "etc", "tmp", "data"):
            (root / d).mkdir()
        shutil.copy2(busybox, root / "bin" / "busybox")
        for applet in APPLETS:
            os.symlink("busybox", root / "bin" / applet)
        tar = subprocess.run(["tar", "-C", str(root), "-c", "."], capture_output=True, check=True)
        imported = subprocess.run(["podman", *PODMAN_FLAGS, "import", "-", IMAGE], input=tar.stdout,
                                  capture_output=True, timeout=COMMAND_TIMEOUT)
        if imported.returncode != 0:
            raise HarnessError(f"podman import failed: {imported.stderr.decode(errors='replace').strip()}")
    return IMAGE


@contextlib.contextmanager
def installed_spec(spec: Mapping[str, Any], filename: str | None = None,
                   directory: Path = CDI_DIR) -> Iterator[Path]:
    """`spec` written where podman reads it (validated, atomically) for the duration of the block."""
    if filename is None:
        vendor, _, cls = str(spec["kind"]).partition("/")
        filename = f"{vendor}-{cls}.json"
    path = write_spec(directory, filename, spec)
    try:
        yield path
    finally:
        remove_spec(path)


@dataclass(frozen=True, slots=True)
class PreparedContainer:
    id: str
    name: str
    config: dict[str, Any]  # the OCI config podman wrote, with the CDI edits applied


def _argv(command: str | Sequence[str] | None) -> list[str]:
    if command is None:
        return []  # the image's own CMD
    return ["sh", "-c", command] if isinstance(command, str) else list(command)


@contextlib.contextmanager
def podman_container(cdi_ids: Sequence[str], command: str | Sequence[str] | None = "true", *,
                     image: str | None = None, options: Sequence[str] = ("--network", "none"),
                     ) -> Iterator[PreparedContainer]:
    """A podman container created with `cdi_ids` and initialised; removed when the block ends.

    `image` defaults to the busybox test image; `options` go to `podman create` (mounts,
    environment, network); a list `command` is the arguments after the image's entrypoint."""
    image = image or ensure_image()
    name = f"dra-test-{secrets.token_hex(6)}"
    args = ["create", "--name", name, *options]
    for device in cdi_ids:
        args += ["--device", device]
    created = podman(*args, image, *_argv(command), check=False)
    if created.returncode != 0:
        raise HarnessError(f"podman create failed: {created.stderr.strip()}")
    cid = created.stdout.strip().splitlines()[-1]
    try:
        init = podman("init", cid, check=False)
        userdata = podman("inspect", "--format", "{{.StaticDir}}", cid).stdout.strip()
        config_path = Path(userdata) / "config.json"
        if not config_path.is_file():
            raise HarnessError(f"podman init wrote no OCI config for {list(cdi_ids)}: {init.stderr.strip()}")
        config = json.loads(config_path.read_text())
        yield PreparedContainer(cid, name, config)
    finally:
        podman("rm", "--force", cid, check=False)


def oci_config_for(cdi_ids: Sequence[str], command: str | Sequence[str] = "true") -> dict[str, Any]:
    """The OCI config podman produces for a container asking for `cdi_ids`."""
    with podman_container(cdi_ids, command) as container:
        return container.config


def bundle_config(config: Mapping[str, Any], rootfs: str) -> dict[str, Any]:
    """Podman's OCI config made runnable by runc here: no rlimits, fresh namespaces, no terminal."""
    out = copy.deepcopy(dict(config))
    process = out.setdefault("process", {})
    process.pop("rlimits", None)  # setrlimit needs CAP_SYS_RESOURCE, which these VMs lack
    process["terminal"] = False
    process.pop("consoleSize", None)
    for namespace in out.get("linux", {}).get("namespaces", []):
        namespace.pop("path", None)  # a path joins a namespace podman would have made; make new ones
    out["root"] = {**out.get("root", {}), "path": rootfs}
    return out


@contextlib.contextmanager
def _bundle(container: PreparedContainer) -> Iterator[tuple[list[str], list[str]]]:
    """A runc bundle for the container on its podman-mounted root filesystem: (runc, `runc run` argv).

    The runc state, the container and the mount are removed when the block ends."""
    rootfs = podman("mount", container.id).stdout.strip()
    try:
        with tempfile.TemporaryDirectory(prefix="dra-test-bundle-") as bundle:
            state = Path(bundle) / "runc-state"
            config = bundle_config(container.config, rootfs)
            (Path(bundle) / "config.json").write_text(json.dumps(config))
            runc = ["runc", "--root", str(state)]
            try:
                yield runc, [*runc, "run", "--bundle", bundle, container.name]
            finally:
                subprocess.run([*runc, "delete", "--force", container.name], capture_output=True,
                               stdin=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT)
    finally:
        podman("umount", container.id, check=False)


def run_prepared(container: PreparedContainer, timeout: int = COMMAND_TIMEOUT) -> tuple[int, str, str]:
    """Run a prepared container with runc to its end: (exit status, stdout, stderr)."""
    with _bundle(container) as (_, argv):
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise HarnessError(f"container {container.name} still running after {timeout} s") from e
    return proc.returncode, proc.stdout, proc.stderr


@dataclass(slots=True)
class RunningContainer:
    name: str
    process: subprocess.Popen[bytes]  # `runc run` in the foreground: it exits with the container
    runc: list[str]

    def signal(self, name: str) -> None:
        subprocess.run([*self.runc, "kill", self.name, name], capture_output=True, stdin=subprocess.DEVNULL,
                       timeout=COMMAND_TIMEOUT, check=True)


@contextlib.contextmanager
def started(container: PreparedContainer, output: Path) -> Iterator[RunningContainer]:
    """A prepared container running in the background (stdout and stderr to `output`) for the block;
    killed if it is still running at the end."""
    with _bundle(container) as (runc, argv), open(output, "wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        running = RunningContainer(container.name, process, runc)
        try:
            yield running
        finally:
            if process.poll() is None:
                subprocess.run([*runc, "kill", container.name, "KILL"], capture_output=True,
                               stdin=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT)
                process.wait(timeout=COMMAND_TIMEOUT)


def run_container(cdi_ids: Sequence[str], command: str | Sequence[str],
                  timeout: int = COMMAND_TIMEOUT) -> tuple[int, str, str]:
    """Run `command` in a container with `cdi_ids` applied by podman: (exit status, stdout, stderr)."""
    with podman_container(cdi_ids, command) as container:
        return run_prepared(container, timeout)

"""The container image: built from the Containerfile with no registry, then run.

The build is image/build.py's (what `make image-offline` runs): a Debian base made by
mmdebstrap from Debian packages and imported into podman (kept in podman's storage between
runs), the wheels downloaded on the host, `podman build --network none`. The image is then run
the way tests/runtime.py runs containers on these machines (podman writes the OCI config, runc
runs it): `dra-agent devices` with simulated GPUs, with no NVML library (the image has none), and
with a libnvidia-ml.so.1 mounted from the host the way the driver's is; and `dra-agent run`
offline with the kubelet, CDI, state and offline directories mounted from the host, driven from
outside the container through the mounted sockets by the kubelet stand-in.

Needs root, podman, runc and mmdebstrap (.ci/run installs them); a cold build takes a few
minutes, a warm one (the base cached) under one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import runtime
import yaml
from conftest import need_command, need_root
from driverroots import make_driver_root

from agent import __version__

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "nvml_standin" / "build"  # `make nvml-standin`, a stand-in libnvidia-ml.so.1
NODE = "image-node"
DRIVER = "dra.example.com"

pytestmark = [pytest.mark.image, pytest.mark.podman, pytest.mark.root]


def image_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("image_build", ROOT / "image" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    need_root()
    need_command("podman", "runc", "mmdebstrap")
    builder = image_builder()
    tag = f"localhost/dra-agent-test:{secrets.token_hex(4)}"
    started = time.monotonic()
    # No layer cache: a test build leaves no intermediate images behind; the base stays cached.
    builder.build(tag, podman=("podman", *runtime.PODMAN_FLAGS), layers=False)
    print(f"image {tag} built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    try:
        yield tag
    finally:
        runtime.podman("rmi", "--force", tag, check=False)


def in_container(image: str, args: Sequence[str], options: Sequence[str] = ("--network", "none"),
                 ) -> tuple[int, str, str]:
    with runtime.podman_container([], list(args), image=image, options=options) as container:
        return runtime.run_prepared(container)


def host_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`dra-agent ...` from this checkout, outside the container (the kubelet stand-in, `claims`)."""
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=ROOT, stdin=subprocess.DEVNULL)


def devices(out: str) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in json.loads(out)}


def test_the_image_has_the_agent_and_neither_nvml_nor_build_leftovers(image):
    config = json.loads(runtime.podman("image", "inspect", image).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["dra-agent"] and config["Cmd"] == ["run"]
    # The version a registry and a scanner read, the agent's own (`dra-agent --version`, dra_agent_build_info).
    labels = config.get("Labels") or {}
    assert labels["org.opencontainers.image.version"] == __version__, labels
    assert labels["org.opencontainers.image.title"] == "dra-agent"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    with runtime.podman_container([], None, image=image) as container:
        root = Path(runtime.podman("mount", container.id).stdout.strip())
        try:
            assert (root / "opt/dra-agent/bin/dra-agent").is_file()
            assert list(root.glob("opt/dra-agent/lib/python3*/site-packages/agent/pb/dra_v1_pb2.py"))
            for leftover in ("src", "wheels", "opt/build"):
                assert not (root / leftover).exists(), leftover
            nvml = [p for d in ("usr/lib", "usr/local/lib", "opt") for p in (root / d).rglob("libnvidia-ml.so*")]
            assert not nvml, "NVML comes from the host driver at run time, never from the image"
        finally:
            runtime.podman("umount", container.id, check=False)


# What code running in the agent would otherwise find at hand: a shell, util-linux's ways into the host's
# namespaces and mounts, a package manager to fetch the rest (checked through any /bin -> usr/bin link).
NOT_IN_THE_IMAGE = ("bin/sh", "bin/bash", "bin/dash", "usr/bin/nsenter", "usr/bin/unshare", "usr/bin/mount",
                    "usr/bin/su", "usr/bin/env", "usr/bin/perl", "usr/bin/apt", "usr/bin/apt-get", "usr/bin/dpkg",
                    "var/lib/dpkg", "etc/apt")
PROGRAM_DIRS = ("usr/bin", "usr/sbin", "usr/local/bin", "usr/local/sbin", "bin", "sbin")


def test_the_image_holds_the_interpreter_and_the_agent_and_nothing_to_run_besides(image):
    with runtime.podman_container([], None, image=image) as container:
        root = Path(runtime.podman("mount", container.id).stdout.strip())
        try:
            present = [p for p in NOT_IN_THE_IMAGE if os.path.lexists(root / p)]
            assert not present, f"in the image: {present}"
            # The programs left: the interpreter the agent's environment runs on (and its names).
            venv_python = root / "opt/dra-agent/bin/python3"
            interpreter = (root / os.readlink(venv_python).lstrip("/")).resolve()
            assert interpreter.is_relative_to(root) and interpreter.is_file()
            programs = {p.relative_to(root).as_posix() for d in PROGRAM_DIRS if (root / d).is_dir()
                        and not (root / d).is_symlink() for p in (root / d).iterdir()}
            assert programs and all(Path(p).name.startswith("python3") for p in programs), sorted(programs)
            assert not [p for p in ("usr/libexec", "usr/lib/apt", "usr/lib/dpkg") if (root / p).exists()]
            # No pip for any interpreter, nor its bundled wheels (ensurepip), nor a set-user-ID file.
            assert not list(root.rglob("pip/__init__.py")) and not list(root.rglob("ensurepip/__init__.py"))
            setid = [p for p in root.rglob("*") if not p.is_symlink() and p.is_file()
                     and p.stat().st_mode & (stat.S_ISUID | stat.S_ISGID)]
            assert not setid, setid
        finally:
            runtime.podman("umount", container.id, check=False)
    # `kubectl exec POD -- sh` finds no shell; the agent's own commands run without one.
    rc, out, err = in_container(image, ["-c", "true"], ("--network", "none", "--entrypoint", "sh"))
    assert rc != 0 and "executable file not found" in err, (rc, out, err)
    rc, out, err = in_container(image, ["--version"])
    assert rc == 0 and re.fullmatch(r"dra-agent \S+\n", out), (rc, out, err)


def test_devices_with_simulated_gpus_match_the_checkout(image, short_tmp):
    args = ["devices", "--nvml", "sim", "-o", "json", "--node-name", NODE]
    rc, out, err = in_container(image, args)
    assert rc == 0, err
    inside = devices(out)
    assert [n for n in inside if re.fullmatch(r"gpu-\d+", n)] == [f"gpu-{i}" for i in range(8)]
    assert len([n for n in inside if n.startswith("gpu-") and n.endswith("-vfio")]) == 8
    assert inside["gpu-0"]["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    # The same command from this checkout on the host: the same machine, so the same devices.
    # (The container has no network devices of its own, so NICs are left out of the comparison.)
    host = host_cli(*args, "--state-dir", str(short_tmp / "state"), env={})
    assert host.returncode == 0, host.stderr
    assert inside == {n: d for n, d in devices(host.stdout).items() if d["kind"] != "nic"}


def test_without_a_driver_library_there_are_no_gpus(image):
    rc, out, err = in_container(image, ["devices", "-o", "json", "--node-name", NODE])
    assert rc == 0, err
    inside = devices(out)
    assert not [d for d in inside.values() if d["kind"] == "gpu"]
    assert {d["kind"] for d in inside.values()} >= {"cpu", "memory"}


@pytest.mark.parametrize("how", ["library directory", "driver root"])
def test_nvml_from_the_host_mounted_at_run_time(image, short_tmp, how):
    # The library's directory in LD_LIBRARY_PATH (the agent's own root searched as its linker would), or
    # the DaemonSet's way: the driver's root mounted at /driver-root and named by DRA_DRIVER_ROOT.
    library = STANDIN / "libnvidia-ml.so.1"
    if not library.is_file():
        pytest.skip(f"needs {library.relative_to(ROOT)} (make nvml-standin)")
    if how == "library directory":
        options = ["--network", "none", "--volume", f"{STANDIN}:/usr/local/nvidia/lib64:ro",
                   "--env", "LD_LIBRARY_PATH=/usr/local/nvidia/lib64"]
    else:
        make_driver_root(short_tmp / "driver", STANDIN, "debian")
        options = ["--network", "none", "--volume", f"{short_tmp / 'driver'}:/driver-root:ro",
                   "--volume", f"{STANDIN / 'machine.txt'}:/machine.txt:ro",
                   "--env", "NVML_STANDIN_MACHINE=/machine.txt", "--env", "DRA_DRIVER_ROOT=/driver-root"]
    rc, out, err = in_container(image, ["devices", "--nvml", "real", "-o", "json", "--node-name", NODE], options)
    assert rc == 0, err
    gpus = [d for d in devices(out).values() if d["kind"] == "gpu"]
    machine = (STANDIN / "machine.txt").read_text()
    assert gpus and len(gpus) == sum(1 for line in machine.splitlines() if line.split()[:1] == ["gpu"])


@pytest.fixture
def host_dirs(short_tmp) -> dict[str, Path]:
    """The node's directories the DaemonSet mounts, and an offline claim source seeded from examples/."""
    kubelet = short_tmp / "kubelet"
    dirs = {"plugin": kubelet / "plugins" / DRIVER, "registry": kubelet / "plugins_registry",
            **{name: short_tmp / name for name in ("cdi", "cdi-static", "state", "offline")}}
    for path in dirs.values():
        path.mkdir(mode=0o755, parents=True)
    seeded = subprocess.run([sys.executable, str(ROOT / "examples" / "seed.py"), str(short_tmp)],
                            capture_output=True, text=True, cwd=ROOT, timeout=60, stdin=subprocess.DEVNULL,
                            env={**os.environ, "NODE_NAME": NODE, "DRA_DRIVER_NAME": DRIVER})
    assert seeded.returncode == 0, seeded.stderr
    return dirs


def wait_for(path: Path, running: runtime.RunningContainer, log: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert running.process.poll() is None, f"the agent exited {running.process.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {path} after {seconds} s:\n{log.read_text()}"
        time.sleep(0.1)


def test_run_offline_with_host_directories_prepared_from_outside(image, host_dirs, short_tmp):
    run_offline_and_prepare(image, host_dirs, short_tmp)


def run_offline_and_prepare(image: str, host_dirs: dict[str, Path], short_tmp: Path, seconds: float = 120) -> None:
    """The walk-through of docs/image.md ("Running it"); tests/test_release.py runs it on the arm64 image
    under qemu too (`seconds`: how long the agent may take to start)."""
    # As deploy/'s DaemonSet runs it in the dev overlay: host network, the host's directories at the
    # same paths, a read-only root filesystem, no capability but CAP_MKNOD (the simulated GPUs'
    # device nodes), settings from the environment, and the image's own command (`dra-agent run`).
    mounts = {"plugin": f"/var/lib/kubelet/plugins/{DRIVER}", "registry": "/var/lib/kubelet/plugins_registry",
              "cdi": "/var/run/cdi", "cdi-static": "/etc/cdi:ro", "state": "/var/lib/dra-agent",
              "offline": "/offline"}
    options = ["--network", "host", "--read-only", "--read-only-tmpfs=false", "--cap-drop", "all",
               "--cap-add", "mknod", "--security-opt", "no-new-privileges"]
    for name, target in mounts.items():
        options += ["--volume", f"{host_dirs[name]}:{target}"]
    for var in (f"NODE_NAME={NODE}", f"DRA_DRIVER_NAME={DRIVER}", "DRA_NVML=sim", "DRA_OFFLINE=/offline",
                "DRA_LOG_FORMAT=json"):
        options += ["--env", var]
    env = {"DRA_KUBELET_DIR": str(short_tmp / "kubelet"), "DRA_OFFLINE": str(host_dirs["offline"]),
           "DRA_STATE_DIR": str(host_dirs["state"]), "DRA_CDI_DIR": str(host_dirs["cdi"]),
           "NODE_NAME": NODE, "DRA_DRIVER_NAME": DRIVER}
    log = short_tmp / "agent.log"
    with runtime.podman_container([], None, image=image, options=options) as container, \
            runtime.started(container, log) as running:
        wait_for(host_dirs["registry"] / f"{DRIVER}-reg.sock", running, log, seconds)
        info = host_cli("kubelet", "info", env=env)
        assert info.returncode == 0 and "DRAPlugin" in info.stdout, info.stderr + log.read_text()
        wait_for(host_dirs["plugin"] / "dra.sock", running, log, seconds)

        prepared = host_cli("kubelet", "prepare", "default/gpu-one", env=env)
        assert prepared.returncode == 0, prepared.stderr + log.read_text()
        (entry,) = json.loads(prepared.stdout)["claims"].values()
        assert "error" not in entry and [d["device_name"] for d in entry["devices"]] == ["gpu-0"], entry
        uid = yaml.safe_load((host_dirs["offline"] / "resourceclaims/default/gpu-one.yaml").read_text())[
            "metadata"]["uid"]
        # What the agent in the container wrote is on the host, where the runtime and kubelet read it.
        spec = json.loads((host_dirs["cdi"] / f"{DRIVER}-claim_{uid}.json").read_text())
        assert spec["kind"] == f"{DRIVER}/claim"
        assert host_cli("cdi", "validate", str(host_dirs["cdi"]), env=env).returncode == 0
        metadata = host_dirs["plugin"] / "dra-device-metadata" / uid / "gpu" / "metadata.json"
        assert '"gpu-0"' in metadata.read_text()
        # CAP_MKNOD is enough for the simulated GPUs' character devices, made in the state directory.
        assert stat.S_ISCHR((host_dirs["state"] / "nvml-sim" / "dev" / "nvidia0").stat().st_mode)
        claims = json.loads(host_cli("claims", "-o", "json", env=env).stdout)
        assert [c["name"] for c in claims] == ["gpu-one"]
        slices = [yaml.safe_load(p.read_text()) for p in (host_dirs["offline"] / "resourceslices").glob("*.yaml")]
        assert slices and all(s["spec"]["nodeName"] == NODE for s in slices)

        unprepared = host_cli("kubelet", "unprepare", "default/gpu-one", env=env)
        assert unprepared.returncode == 0, unprepared.stderr
        assert not list(host_dirs["cdi"].glob(f"{DRIVER}-claim_*")) and not metadata.exists()

        running.signal("TERM")
        assert running.process.wait(timeout=60) == 0, log.read_text()
    assert not (host_dirs["registry"] / f"{DRIVER}-reg.sock").exists()
    assert not (host_dirs["plugin"] / "dra.sock").exists()

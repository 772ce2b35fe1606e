"""A real runtime consumes a CDI spec: podman applies it, runc runs a container that uses it."""

from __future__ import annotations

import os
import re
import secrets
import stat
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import runtime

import cdi
from cdi import ContainerEdits, Device, DeviceNode, Mount, Spec


@dataclass(frozen=True)
class ThingSpec:
    kind: str
    device_id: str
    digit_device_id: str
    token: str
    greeting: Path
    node_rdev: int
    path: Path


@pytest.fixture
def thing(tmp_path: Path) -> Iterator[ThingSpec]:
    runtime.need_runtime()
    runtime.ensure_image()
    kind = f"{runtime.unique_vendor()}/thing"
    token = secrets.token_hex(8)
    greeting = tmp_path / "greeting.txt"
    greeting.write_text(f"hello {token}\n")
    dev_root = tmp_path / "dev"
    dev_root.mkdir()
    node = dev_root / "thing0"
    rdev = os.stat("/dev/null").st_rdev  # a harmless real char device: writes vanish
    os.mknod(node, 0o666 | stat.S_IFCHR, rdev)
    spec = Spec(kind, [
        Device("dev0", ContainerEdits(
            env=[f"DRA_TEST_TOKEN={token}", "DRA_TEST_MODE=runtime"],
            device_nodes=[DeviceNode("/dev/dra-thing0", host_path=str(node))],
            mounts=[Mount(str(greeting), "/data/greeting.txt", ["ro", "bind"])],
        )),
        Device("7", ContainerEdits(env=["DRA_TEST_DIGIT=seven"])),  # a one-character name
    ]).to_dict()
    assert spec["cdiVersion"] == "0.5.0"  # hostPath and the digit name need it; podman 4.3 takes no more
    with runtime.installed_spec(spec) as path:
        yield ThingSpec(kind, f"{kind}=dev0", f"{kind}=7", token, greeting, rdev, path)
    assert not path.exists()


@pytest.mark.root
@pytest.mark.podman
def test_oci_config_carries_env_device_node_and_mount(thing: ThingSpec) -> None:
    config = runtime.oci_config_for([thing.device_id])

    env = config["process"]["env"]
    assert f"DRA_TEST_TOKEN={thing.token}" in env
    assert "DRA_TEST_MODE=runtime" in env
    major, minor = os.major(thing.node_rdev), os.minor(thing.node_rdev)
    nodes = [d for d in config["linux"]["devices"] if d["path"] == "/dev/dra-thing0"]
    assert len(nodes) == 1
    assert (nodes[0]["type"], nodes[0]["major"], nodes[0]["minor"]) == ("c", major, minor)
    allowed = [r for r in config["linux"]["resources"]["devices"]
               if r.get("allow") and (r.get("type"), r.get("major"), r.get("minor")) == ("c", major, minor)]
    assert allowed, "the device cgroup must allow the injected node"
    mounts = [m for m in config["mounts"] if m["destination"] == "/data/greeting.txt"]
    assert len(mounts) == 1
    assert mounts[0]["source"] == str(thing.greeting)
    assert {"ro", "bind"} <= set(mounts[0]["options"])


@pytest.mark.root
@pytest.mark.podman
def test_single_character_device_name_resolves(thing: ThingSpec) -> None:
    config = runtime.oci_config_for([thing.digit_device_id])
    assert "DRA_TEST_DIGIT=seven" in config["process"]["env"]
    assert not any(e.startswith("DRA_TEST_TOKEN=") for e in config["process"]["env"])


@pytest.mark.root
@pytest.mark.podman
def test_container_reads_the_mount_sees_the_env_and_uses_the_device(thing: ThingSpec) -> None:
    script = (
        "cat /data/greeting.txt; "
        "echo \"env=$DRA_TEST_TOKEN\"; "
        "stat -c 'node=%F %t:%T' /dev/dra-thing0; "
        "echo probe > /dev/dra-thing0 && echo wrote-device; "
        "(echo x > /data/greeting.txt) 2>/dev/null || echo mount-is-read-only"
    )
    rc, out, err = runtime.run_container([thing.device_id], script)

    assert rc == 0, err
    lines = out.splitlines()
    assert f"hello {thing.token}" in lines
    assert f"env={thing.token}" in lines
    major, minor = os.major(thing.node_rdev), os.minor(thing.node_rdev)
    assert f"node=character special file {major:x}:{minor:x}" in lines
    assert "wrote-device" in lines
    assert "mount-is-read-only" in lines
    assert thing.greeting.read_text() == f"hello {thing.token}\n"


@pytest.mark.root
@pytest.mark.podman
def test_exit_status_and_stderr_come_back(thing: ThingSpec) -> None:
    rc, out, err = runtime.run_container([thing.device_id], "echo to-stderr >&2; exit 7")
    assert rc == 7
    assert "to-stderr" in err
    assert out == ""


@pytest.mark.root
@pytest.mark.podman
def test_unknown_device_is_reported_with_the_runtime_reason(thing: ThingSpec) -> None:
    missing = f"{thing.kind}=missing"
    with pytest.raises(runtime.HarnessError, match=re.escape(missing)):
        runtime.oci_config_for([missing])


@pytest.mark.root
@pytest.mark.podman
def test_nothing_is_left_behind(thing: ThingSpec) -> None:
    with runtime.podman_container([thing.device_id], "true") as container:
        rc, _, err = runtime.run_prepared(container)
        assert rc == 0, err
        assert runtime.podman("container", "exists", container.id, check=False).returncode == 0
    assert runtime.podman("container", "exists", container.id, check=False).returncode == 1
    mounts = Path("/proc/self/mounts").read_text()
    assert container.id not in mounts
    runc_state = subprocess.run(["runc", "list", "-q"], capture_output=True, text=True)
    assert container.name not in runc_state.stdout


@pytest.mark.root
@pytest.mark.podman
def test_spec_file_is_world_readable_and_valid(thing: ThingSpec) -> None:
    assert stat.S_IMODE(thing.path.stat().st_mode) == 0o644
    assert thing.path.parent == runtime.CDI_DIR
    assert cdi.validate_file(thing.path) == []


# -- no root needed -------------------------------------------------------------------------------

def test_bundle_config_makes_podman_config_runnable() -> None:
    podman_config = {
        "process": {"args": ["sh"], "terminal": True, "consoleSize": {"height": 1, "width": 1},
                    "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1, "soft": 1}], "env": ["A=b"]},
        "root": {"path": "/var/lib/containers/storage/x/merged", "readonly": False},
        "linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/run/netns/cni-1"}]},
    }
    out = runtime.bundle_config(podman_config, "/mnt/rootfs")

    assert "rlimits" not in out["process"]
    assert "consoleSize" not in out["process"]
    assert out["process"]["terminal"] is False
    assert out["process"]["env"] == ["A=b"]
    assert out["root"] == {"path": "/mnt/rootfs", "readonly": False}
    assert out["linux"]["namespaces"] == [{"type": "pid"}, {"type": "network"}]
    assert podman_config["linux"]["namespaces"][1]["path"] == "/run/netns/cni-1"  # input untouched
    assert "rlimits" in podman_config["process"]


def _elf(tmp_path: Path, program_types: list[int]) -> Path:
    """A minimal little-endian ELF64 header followed by its program header table."""
    phoff, phentsize = 64, 56
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x20, phoff)
    struct.pack_into("<HH", header, 0x36, phentsize, len(program_types))
    table = b"".join(struct.pack("<I", t) + bytes(phentsize - 4) for t in program_types)
    path = tmp_path / f"elf-{len(program_types)}-{'-'.join(map(str, program_types))}"
    path.write_bytes(bytes(header) + table)
    return path


def test_static_elf_detection(tmp_path: Path) -> None:
    pt_load, pt_interp = 1, 3
    assert runtime.is_static_elf(_elf(tmp_path, [pt_load, pt_load])) is True
    assert runtime.is_static_elf(_elf(tmp_path, [pt_load, pt_interp, pt_load])) is False
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\n")
    assert runtime.is_static_elf(script) is False

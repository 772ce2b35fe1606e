"""The release: `make release`'s two-architecture image archive and chart package, then its arm64 image run.

The release is built as `make release` builds it (image/release.py, into a scratch directory, under a
repository name of its own): the image for linux/amd64 and linux/arm64, each offline as `make
image-offline` builds, pushed as one OCI archive, and the chart packaged by Helm (tests/helm/build.py).
The archive is read as a registry would: its index, one image index, one manifest per platform, each
config and its labels, and the interpreter in each image's layer, an ELF of that architecture. The arm64
image is then pulled from the archive and run the way tests/test_image.py runs the image, under
qemu-user-static: it says it is on aarch64, and walks through docs/image.md's offline run with simulated
GPUs, a claim prepared from outside through the mounted sockets.

Needs root, podman, runc, mmdebstrap, arch-test and qemu-user-static (.ci/run installs them), and Go for
Helm; a cold build takes many minutes, most of it the arm64 base and build under qemu. `make test` runs
it with the rest, `make test-release` alone (marker `release`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import secrets
import struct
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import runtime
import yaml
from conftest import need_command, need_root
from test_image import host_dirs, in_container, run_offline_and_prepare

from agent import __version__

ROOT = Path(__file__).resolve().parent.parent
PLATFORMS = {"amd64": 0x3E, "arm64": 0xB7}  # OCI's architecture -> the ELF e_machine of its programs
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
QEMU_START_SECONDS = 600  # the agent's start under qemu on a shared 2-core machine: imports, emulated

pytestmark = [pytest.mark.release, pytest.mark.image, pytest.mark.podman, pytest.mark.root]
__all__ = ["host_dirs"]  # the fixture, from tests/test_image.py


def release_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("image_release", ROOT / "image" / "release.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Iterator[Any]:
    need_root()
    need_command("podman", "runc", "mmdebstrap", "arch-test", "qemu-aarch64-static")
    builder = release_builder()
    repository = f"localhost/dra-agent-release-test-{secrets.token_hex(4)}"
    podman = ("podman", *runtime.PODMAN_FLAGS)
    started = time.monotonic()
    # No layer cache: a test build leaves no intermediate images behind; the bases stay cached.
    built = builder.build_release(tmp_path_factory.mktemp("dist"), podman=podman, layers=False,
                                  repository=repository)
    print(f"release {built.version} built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    try:
        yield built
    finally:
        for tag in built.images:
            runtime.podman("rmi", "--force", tag, check=False)


class Layout:
    """An OCI image layout in a tar, read by digest."""

    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar

    def file(self, name: str) -> bytes:
        member = self.tar.extractfile(name)
        assert member is not None, name
        return member.read()

    def blob(self, descriptor: dict[str, Any]) -> bytes:
        algorithm, digest = descriptor["digest"].split(":")
        data = self.file(f"blobs/{algorithm}/{digest}")
        assert hashlib.new(algorithm, data).hexdigest() == digest and len(data) == descriptor["size"]
        return data

    def json(self, descriptor: dict[str, Any]) -> dict[str, Any]:
        return dict(json.loads(self.blob(descriptor)))


def elf_machine(layer: bytes, path: str) -> int:
    """The e_machine of an ELF file in a layer (gzip or plain tar), following symbolic links in it."""
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        for _ in range(10):
            member = tar.getmember(path)
            if not member.issym():
                break
            target = member.linkname
            path = target.lstrip("/") if target.startswith("/") else str(Path(path).parent / target)
        extracted = tar.extractfile(member)
        assert extracted is not None, path
        header = extracted.read(20)
    assert header[:4] == b"\x7fELF", path
    return int(struct.unpack_from("<H", header, 18)[0])


def test_the_archive_is_one_index_of_an_amd64_and_an_arm64_image_of_the_version(release):
    assert release.version == __version__
    assert release.archive.name == f"dra-agent-{__version__}.oci.tar"
    with tarfile.open(release.archive) as tar:
        check_layout(Layout(tar))


def check_layout(layout: Layout) -> None:
    assert json.loads(layout.file("oci-layout"))["imageLayoutVersion"] == "1.0.0"
    (top,) = json.loads(layout.file("index.json"))["manifests"]
    assert top["mediaType"] == INDEX and top["annotations"]["org.opencontainers.image.ref.name"] == __version__
    images = layout.json(top)["manifests"]
    assert sorted((m["platform"]["os"], m["platform"]["architecture"]) for m in images) == [
        ("linux", "amd64"), ("linux", "arm64")]
    for descriptor in images:
        arch = descriptor["platform"]["architecture"]
        assert descriptor["mediaType"] == MANIFEST
        manifest = layout.json(descriptor)
        config = layout.json(manifest["config"])
        assert (config["os"], config["architecture"]) == ("linux", arch)
        labels = config["config"]["Labels"]
        assert labels["org.opencontainers.image.version"] == __version__, (arch, labels)
        assert config["config"]["Entrypoint"] == ["dra-agent"]
        # The programs in it are that architecture's: the interpreter the agent runs on (one layer).
        (layer,) = manifest["layers"]
        assert elf_machine(layout.blob(layer), "opt/dra-agent/bin/python3") == PLATFORMS[arch], arch


def test_the_chart_package_and_the_checksums_are_of_the_same_version(release):
    if release.chart is None:
        pytest.skip("no chart package: Helm needs Go (tests/helm/build.py)")
    assert release.chart == release.directory / f"dra-agent-{__version__}.tgz"
    with tarfile.open(release.chart) as tar:
        member = tar.extractfile("dra-agent/Chart.yaml")
        assert member is not None
        chart = yaml.safe_load(member.read())
    assert (chart["version"], chart["appVersion"]) == (__version__, __version__)
    sums = dict(reversed(line.split("  ")) for line in (release.directory / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {release.archive.name, release.chart.name}
    for name, digest in sums.items():
        assert hashlib.sha256((release.directory / name).read_bytes()).hexdigest() == digest, name


@pytest.fixture(scope="module")
def arm64_image(release, tmp_path_factory) -> Iterator[str]:
    """The arm64 image, taken out of the archive: a layout of its own holding the index's arm64 manifest
    (podman 4.3 cannot pull one platform's image out of an index in an archive: it looks for the host's)."""
    layout = tmp_path_factory.mktemp("arm64")
    with tarfile.open(release.archive) as tar:
        tar.extractall(layout, filter="data")
    (top,) = json.loads((layout / "index.json").read_text())["manifests"]
    index = json.loads((layout / "blobs" / Path(*top["digest"].split(":"))).read_bytes())
    (arm64,) = [m for m in index["manifests"] if m["platform"]["architecture"] == "arm64"]
    arm64["annotations"] = {"org.opencontainers.image.ref.name": "arm64"}
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [arm64]}))
    pulled = runtime.podman("pull", "--quiet", "--arch", "arm64", f"oci:{layout}:arm64")
    image_id = pulled.stdout.strip().splitlines()[-1]
    try:
        yield image_id
    finally:
        runtime.podman("rmi", "--force", image_id, check=False)


def test_the_arm64_image_runs_arm64_code_under_qemu(arm64_image):
    (inspected,) = json.loads(runtime.podman("image", "inspect", arm64_image).stdout)
    assert inspected["Architecture"] == "arm64"
    rc, out, err = in_container(arm64_image, ["-I", "-c", "import platform; print(platform.machine())"],
                                ("--network", "none", "--entrypoint", "/opt/dra-agent/bin/python3"))
    assert (rc, out) == (0, "aarch64\n"), err
    rc, out, err = in_container(arm64_image, ["--version"])
    assert (rc, out) == (0, f"dra-agent {__version__}\n"), err


def test_the_arm64_image_prepares_a_claim_offline_under_qemu(arm64_image, host_dirs, short_tmp):
    run_offline_and_prepare(arm64_image, host_dirs, short_tmp, QEMU_START_SECONDS)

"""The VM path end to end, as KubeVirt uses it: a running agent (`dra-agent run --nvml sim`, its
simulated kernel applying the binding writes) prepares a claim for a passthrough GPU over its real DRA
socket; podman applies the CDI specs and runc runs a container in which a reader built like KubeVirt
1.9's (the metadata path from the claim and request names, the v1alpha1 object, `mdevUUID` before
`pciBusID`) finds the GPU's PCI address and the VFIO device nodes are there. Unprepare puts the GPU
back on its driver in the simulated sysfs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import runtime
from agentkit import NODE, agent_process, claim, result, roots, write_claim

from agent import kubelet_client as kc
from agent import metadata
from agent.config import Settings
from agent.names import ClaimRef
from agent.simkernel.tree import SimTree

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")

ROOT = Path(__file__).resolve().parents[1]
UID = "5d3f0a00-0000-4000-8000-0000000000f1"
GPU_BUS, GROUP = "0000:2a:00.0", 101  # gpu-1 of dgx-h100
VARIANT = "gpu-0000-2a-00-0-vfio"
POD_CLAIM, REQUEST = "gpu", "gpu"  # the VM's claim template entry and its request


def kubevirt_pci_address(stream: bytes) -> str:
    """KubeVirt 1.9's read of one request's metadata file: the v1alpha1 object, exactly one device,
    `mdevUUID` when present, else `resource.kubernetes.io/pciBusID`."""
    doc = next(o for o in metadata.parse_stream(stream) if o.get("apiVersion") == "metadata.resource.k8s.io/v1alpha1")
    (req,) = doc["requests"]
    (dev,) = req["devices"]
    attrs = dev["attributes"]
    key = "mdevUUID" if "mdevUUID" in attrs else "resource.kubernetes.io/pciBusID"
    return str(attrs[key]["string"])


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dra-vm-", dir="/tmp"))  # socket paths stay short
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def agent_args(s: Settings) -> list[str]:
    assert s.offline is not None
    return ["run", "--nvml", "sim", "--node-name", NODE, "--driver-name", s.driver_name, "--offline", str(s.offline),
            "--kubelet-dir", str(s.kubelet_dir), "--cdi-dir", str(s.cdi_dir), "--static-cdi-dir",
            str(s.static_cdi_dir), "--state-dir", str(s.state_dir), "--nic-exclude", "*", "--metrics-address", ""]


async def test_kubevirt_gets_a_passthrough_gpu_over_the_dra_socket(short_tmp: Path) -> None:
    runtime.need_runtime()
    driver = runtime.unique_vendor()
    s = roots(short_tmp, driver_name=driver, cdi_dir=runtime.CDI_DIR)
    assert s.offline is not None
    write_claim(s.offline / "resourceclaims", claim(
        "vm-1-gpu-x7k2", UID, [result(VARIANT, REQUEST, driver=driver)],
        annotations={"resource.kubernetes.io/pod-claim-name": POD_CLAIM}))
    ref = ClaimRef("default", "vm-1-gpu-x7k2", UID)
    tree = SimTree(s.state_dir / "nvml-sim")
    with agent_process(agent_args(s), {}, s.registration_socket, ROOT):
        assert tree.driver_of(GPU_BUS) == "nvidia"
        async with kc.DRAClient(s.dra_socket) as client:
            reply = await client.prepare([ref], timeout=60)
            entry = reply.claims[UID]
            assert entry.error == ""
            try:
                assert tree.driver_of(GPU_BUS) == "vfio-pci"
                ids = [i for d in entry.devices for i in d.cdi_device_ids]
                request_dir = f"{metadata.CONTAINER_ROOT}/resourceclaimtemplates/{POD_CLAIM}/{REQUEST}"
                rc, out, err = runtime.run_container(ids, (
                    f"cd {request_dir} && ls && echo --- && cat *-metadata.json && echo --- && "
                    "stat -c '%n %F %t:%T' /dev/vfio/* && (ls /dev/nvidia* 2>/dev/null || echo no-nvidia)"))
                assert rc == 0, err
                listing, stream, nodes = out.split("---\n")
                assert listing.split() == [f"{driver}-metadata.json"]  # exactly one file, as KubeVirt requires
                assert kubevirt_pci_address(stream.encode()) == GPU_BUS
                lines = nodes.strip().splitlines()
                assert lines[-1] == "no-nvidia"
                # Character devices in the container with the host's numbers (VFIO misc 10:196; group major 0xf3).
                assert sorted(lines[:-1]) == [f"/dev/vfio/{GROUP} character special file f3:65",
                                              "/dev/vfio/vfio character special file a:c4"]
            finally:
                reply = await client.unprepare([ref], timeout=60)
                assert reply.claims[UID].error == ""
        assert tree.driver_of(GPU_BUS) == "nvidia" and tree.override_of(GPU_BUS) is None
        assert not (tree.dev / "vfio" / str(GROUP)).exists()
    assert not list(runtime.CDI_DIR.glob(f"{driver}*"))


def test_make_run_prepares_the_vm_example(short_tmp: Path) -> None:
    """README's quickstart with the VM example: seeded from examples/ as `make run` does, prepared with
    `dra-agent kubelet prepare`, shown by `dra-agent vfio status`, unprepared."""
    env = {**os.environ, "DRA_KUBELET_DIR": str(short_tmp / "kubelet"), "DRA_CDI_DIR": str(short_tmp / "cdi"),
           "DRA_STATIC_CDI_DIR": str(short_tmp / "cdi-static"), "DRA_STATE_DIR": str(short_tmp / "state"),
           "DRA_OFFLINE": str(short_tmp / "offline"), "DRA_NVML": "sim", "NODE_NAME": "node-vm"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=120,
                              env=env, cwd=ROOT)

    seeded = subprocess.run([sys.executable, str(ROOT / "examples" / "seed.py"), str(short_tmp)],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert seeded.returncode == 0, seeded.stderr
    example = short_tmp / "offline" / "resourceclaims" / "default" / "virt-launcher-vm-1-gpu-k8q2z.yaml"
    assert f"device: {VARIANT}" in example.read_text()
    tree = SimTree(short_tmp / "state" / "nvml-sim")
    reg = short_tmp / "kubelet" / "plugins_registry" / "dra.example.com-reg.sock"
    with agent_process(["run", "--metrics-address", ""], env, reg, ROOT):
        prepared = cli("kubelet", "prepare", "default/virt-launcher-vm-1-gpu-k8q2z")
        assert prepared.returncode == 0, prepared.stderr
        assert tree.driver_of(GPU_BUS) == "vfio-pci"
        status = cli("vfio", "status")
        assert status.returncode == 0, status.stderr
        assert f"default/virt-launcher-vm-1-gpu-k8q2z  prepared  {VARIANT}  {GPU_BUS}" in status.stdout
        assert cli("kubelet", "unprepare", "default/virt-launcher-vm-1-gpu-k8q2z").returncode == 0
        assert tree.driver_of(GPU_BUS) == "nvidia"

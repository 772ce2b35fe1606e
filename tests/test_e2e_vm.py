"""The VM path end to end, as KubeVirt uses it: a running agent (`dra-agent run --nvml sim`, its
simulated kernel applying the binding writes) prepares a claim for a passthrough GPU, and one for a
passthrough SR-IOV VF of the simulated ConnectX-7 with the MAC a KubeVirt SR-IOV VM asks for, over its
real DRA socket; podman applies the CDI specs and runc runs a container in which a reader built like
KubeVirt 1.9's (the metadata path from the claim and request names, the v1alpha1 object, `mdevUUID`
before `pciBusID`) finds the function's PCI address (and a VF's MAC) and the VFIO device nodes are
there. Unprepare puts the function back on its driver in the simulated sysfs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import runtime
from agentkit import NODE, Quickstart, agent_process, claim, result, roots, write_claim

from agent.claims import metadata
from agent.claims.allocation import config_api_version
from agent.config import Settings
from agent.kubelet import client as kc
from agent.names import ClaimRef
from agent.sim.kernel.tree import SimTree

ROOT = Path(__file__).resolve().parents[1]
UID = "5d3f0a00-0000-4000-8000-0000000000f1"
GPU_BUS, GROUP = "0000:2a:00.0", 101  # gpu-1 of dgx-h100
VARIANT = "gpu-0000-2a-00-0-vfio"
POD_CLAIM, REQUEST = "gpu", "gpu"  # the VM's claim template entry and its request
VF_UID = "5d3f0a00-0000-4000-8000-0000000000f2"
VF_BUS, VF_GROUP, VF_IF = "0000:4b:00.1", 201, "ens75f0np0v0"  # VF 0 of dgx-h100's ConnectX-7
VF_VARIANT = "nic-0000-4b-00-1-vfio"
VF_MAC = "02:aa:bb:cc:dd:01"  # the MAC the VM's SR-IOV network expects


def kubevirt_device(stream: bytes) -> dict[str, Any]:
    """The one device of one request's metadata file, as KubeVirt 1.9 reads it: the v1alpha1 object,
    exactly one device."""
    doc = next(o for o in metadata.parse_stream(stream) if o.get("apiVersion") == "metadata.resource.k8s.io/v1alpha1")
    (req,) = doc["requests"]
    (dev,) = req["devices"]
    return dict(dev)


def kubevirt_pci_address(stream: bytes) -> str:
    """KubeVirt 1.9's address of the device: `mdevUUID` when present, else `resource.kubernetes.io/pciBusID`."""
    attrs = kubevirt_device(stream)["attributes"]
    key = "mdevUUID" if "mdevUUID" in attrs else "resource.kubernetes.io/pciBusID"
    return str(attrs[key]["string"])


def in_vm_container(ids: list[str], pod_claim: str, request: str) -> tuple[list[str], str, list[str]]:
    """In a container with the claim's CDI devices applied (podman + runc), what virt-launcher would see:
    the request's metadata directory, the metadata stream, and `/dev/vfio` (with `no-nvidia` last when
    no `/dev/nvidia*` is there)."""
    request_dir = f"{metadata.CONTAINER_ROOT}/resourceclaimtemplates/{pod_claim}/{request}"
    rc, out, err = runtime.run_container(ids, (
        f"cd {request_dir} && ls && echo --- && cat *-metadata.json && echo --- && "
        "stat -c '%n %F %t:%T' /dev/vfio/* && (ls /dev/nvidia* 2>/dev/null || echo no-nvidia)"))
    assert rc == 0, err
    listing, stream, nodes = out.split("---\n")
    return listing.split(), stream, nodes.strip().splitlines()


def agent_args(s: Settings, nic_exclude: str = "*") -> list[str]:
    assert s.offline is not None
    return ["run", "--nvml", "sim", "--node-name", NODE, "--driver-name", s.driver_name, "--offline", str(s.offline),
            "--kubelet-dir", str(s.kubelet_dir), "--cdi-dir", str(s.cdi_dir), "--static-cdi-dir",
            str(s.static_cdi_dir), "--state-dir", str(s.state_dir), "--nic-exclude", nic_exclude,
            "--metrics-address", ""]


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
                listing, stream, lines = in_vm_container(ids, POD_CLAIM, REQUEST)
                assert listing == [f"{driver}-metadata.json"]  # exactly one file, as KubeVirt requires
                assert kubevirt_pci_address(stream.encode()) == GPU_BUS
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


async def test_kubevirt_gets_a_passthrough_vf_with_its_mac_over_the_dra_socket(short_tmp: Path) -> None:
    """The simulated NIC's VF has no netdev for netlink: the running agent publishes its passthrough
    device from the simulated sysfs (`--nic-exclude` must leave the VF's interface alone, as on a host)."""
    runtime.need_runtime()
    driver = runtime.unique_vendor()
    s = roots(short_tmp, driver_name=driver, cdi_dir=runtime.CDI_DIR)
    assert s.offline is not None
    config = [{"source": "FromClaim", "requests": ["net"], "opaque": {"driver": driver, "parameters": {
        "apiVersion": config_api_version(driver), "kind": "VfioConfig", "mac": VF_MAC}}}]
    write_claim(s.offline / "resourceclaims", claim(
        "vm-1-net-p4w9c", VF_UID, [result(VF_VARIANT, "net", driver=driver)], config=config,
        annotations={"resource.kubernetes.io/pod-claim-name": "sriov"}))
    ref = ClaimRef("default", "vm-1-net-p4w9c", VF_UID)
    tree = SimTree(s.state_dir / "nvml-sim")
    host_mac = (tree.function(VF_BUS) / "net" / VF_IF / "address")
    # Host NICs may be published too; only the GPU test's catch-all would hide the simulated VF.
    with agent_process(agent_args(s, nic_exclude="ens75f0np0v1"), {}, s.registration_socket, ROOT):
        assert tree.driver_of(VF_BUS) == "mlx5_core" and host_mac.is_file()
        async with kc.DRAClient(s.dra_socket) as client:
            reply = await client.prepare([ref], timeout=60)
            entry = reply.claims[VF_UID]
            assert entry.error == ""
            try:
                assert tree.driver_of(VF_BUS) == "vfio-pci" and not host_mac.exists()
                ids = [i for d in entry.devices for i in d.cdi_device_ids]
                listing, stream, lines = in_vm_container(ids, "sriov", "net")
                assert listing == [f"{driver}-metadata.json"]
                assert kubevirt_pci_address(stream.encode()) == VF_BUS
                assert kubevirt_device(stream.encode())["networkData"] == {"hardwareAddress": VF_MAC}
                assert lines[-1] == "no-nvidia"
                assert sorted(lines[:-1]) == [f"/dev/vfio/{VF_GROUP} character special file f3:{VF_GROUP:x}",
                                              "/dev/vfio/vfio character special file a:c4"]
                # An excluded VF has no passthrough device to prepare.
                other = ClaimRef("default", "vm-2-net-x", "5d3f0a00-0000-4000-8000-0000000000f3")
                write_claim(s.offline / "resourceclaims", claim(
                    other.name, other.uid, [result("nic-0000-4b-00-2-vfio", "net", driver=driver)]))
                refused = (await client.prepare([other], timeout=60)).claims[other.uid]
                assert "nic-0000-4b-00-2-vfio" in refused.error
                assert tree.driver_of("0000:4b:00.2") == "mlx5_core"
            finally:
                reply = await client.unprepare([ref], timeout=60)
                assert reply.claims[VF_UID].error == ""
        assert tree.driver_of(VF_BUS) == "mlx5_core" and tree.override_of(VF_BUS) is None
        assert host_mac.is_file()  # its netdev is back with its driver
        assert not (tree.dev / "vfio" / str(VF_GROUP)).exists()
    assert not list(runtime.CDI_DIR.glob(f"{driver}*"))


def test_make_run_prepares_the_vm_example(short_tmp: Path) -> None:
    """README's walk-through with the VM examples (a passthrough GPU, a VF): seeded from examples/ as `make
    run` does, prepared with `dra-agent kubelet prepare`, shown by `dra-agent vfio status`, unprepared."""
    quick = Quickstart.seeded(short_tmp, "node-vm")
    cli = quick.cli
    assert f"device: {VARIANT}" in quick.example("virt-launcher-vm-1-gpu-k8q2z")
    tree = SimTree(short_tmp / "state" / "nvml-sim")
    with quick.agent():
        prepared = cli("kubelet", "prepare", "default/virt-launcher-vm-1-gpu-k8q2z")
        assert prepared.returncode == 0, prepared.stderr
        assert tree.driver_of(GPU_BUS) == "vfio-pci"
        status = cli("vfio", "status")
        assert status.returncode == 0, status.stderr
        assert f"default/virt-launcher-vm-1-gpu-k8q2z  prepared  {VARIANT}  {GPU_BUS}" in status.stdout
        assert cli("kubelet", "unprepare", "default/virt-launcher-vm-1-gpu-k8q2z").returncode == 0
        assert tree.driver_of(GPU_BUS) == "nvidia"

        # The VM's SR-IOV VF, seeded with the simulated ConnectX-7's first VF and a MAC.
        net = "default/virt-launcher-vm-1-net-m5t8w"
        assert f"device: {VF_VARIANT}" in quick.example("virt-launcher-vm-1-net-m5t8w")
        prepared = cli("kubelet", "prepare", net)
        assert prepared.returncode == 0, prepared.stderr
        assert tree.driver_of(VF_BUS) == "vfio-pci"
        status = cli("vfio", "status")
        assert f"{net}  prepared  {VF_VARIANT}  {VF_BUS}" in status.stdout
        assert cli("kubelet", "unprepare", net).returncode == 0
        assert tree.driver_of(VF_BUS) == "mlx5_core"

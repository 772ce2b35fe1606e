"""A real container runtime consumes what prepare wrote: podman applies every CDI ID the agent
returned, and a container run with runc reads the device metadata at its contract path.
Also: the metadata file read the way KubeVirt 1.9 reads it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import runtime
from agentkit import claim, make_node, result, write_claim

from agent.claims import metadata
from agent.model import PCI_BUS_ID
from agent.names import ClaimRef

UID = "5d3f0a00-0000-4000-8000-000000000001"
SYSTEM_CDI_DIR = Path("/var/run/cdi")  # podman 4.3 reads only /etc/cdi and /var/run/cdi


@pytest.fixture
async def prepared(tmp_path):
    runtime.need_runtime()
    driver = runtime.unique_vendor()
    node = await make_node(tmp_path, driver_name=driver, cdi_dir=SYSTEM_CDI_DIR)
    # podman 4.3 reads CDI specs up to 0.6/0.7, not 1.1's netDevices: the NIC stays on the host (moved into a
    # container through the real kubelet, containerd and runc 1.5: tests/cluster/test_cluster_kubelet.py).
    stay = {"source": "FromClaim", "requests": ["nic"], "opaque": {"driver": driver, "parameters": {
        "apiVersion": f"{driver}/v1alpha1", "kind": "NetworkConfig", "move": False}}}
    obj = claim("train", UID, [result("gpu-0", "gpus", driver=driver), result("gpu-5", "gpus", driver=driver),
                               result("nic-0000-3b-00-0", "nic", driver=driver)], config=[stay])
    write_claim(node.claims_dir, obj)
    out = await node.engine.prepare([ClaimRef("default", "train", UID)])
    assert out[UID].error == ""
    try:
        yield node, out[UID].devices
    finally:
        assert await node.engine.unprepare([ClaimRef("default", "train", UID)]) == {UID: ""}
        assert not list(SYSTEM_CDI_DIR.glob(f"{driver}*"))


def _ids(devices):
    return [i for d in devices for i in d.cdi_device_ids]


async def test_podman_applies_every_cdi_id_env_device_nodes_and_metadata_mounts(prepared):
    node, devices = prepared
    driver = node.settings.driver_name
    config = runtime.oci_config_for(_ids(devices))
    env = config["process"]["env"]
    gpu0, gpu5 = node.inventory.get("gpu-0"), node.inventory.get("gpu-5")
    assert f"DRA_GPU_0_UUID={gpu0.node.gpu.uuid}" in env and f"DRA_GPU_5_UUID={gpu5.node.gpu.uuid}" in env
    assert "DRA_NIC_0000_3B_00_0_INTERFACE=ens1f0" in env
    nodes = {d["path"]: d for d in config["linux"]["devices"]}
    for path in ("/dev/nvidia0", "/dev/nvidia5", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        assert path in nodes, sorted(nodes)
    host0 = os.stat(gpu0.device_nodes[0].host_path)
    assert stat.S_ISCHR(host0.st_mode)
    assert (nodes["/dev/nvidia0"]["major"], nodes["/dev/nvidia0"]["minor"]) == (
        os.major(host0.st_rdev), os.minor(host0.st_rdev))
    mounts = {m["destination"]: m for m in config["mounts"]}
    base = "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train"
    for request in ("gpus", "nic"):
        dest = f"{base}/{request}/{driver}-metadata.json"
        assert dest in mounts
        assert mounts[dest]["source"] == str(metadata.host_file(node.settings.metadata_dir, UID, request))
        assert "ro" in mounts[dest]["options"]


async def test_a_container_reads_the_pci_bus_id_from_the_metadata_file(prepared):
    node, devices = prepared
    driver = node.settings.driver_name
    path = f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train/gpus/{driver}-metadata.json"
    rc, out, err = runtime.run_container(_ids(devices), f"cat {path}")
    assert rc == 0, err
    objs = metadata.parse_stream(out.encode())
    assert objs[0]["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    buses = [d["attributes"][PCI_BUS_ID]["string"] for d in objs[0]["requests"][0]["devices"]]
    assert buses == [node.inventory.get("gpu-0").attributes[PCI_BUS_ID],
                     node.inventory.get("gpu-5").attributes[PCI_BUS_ID]] == ["0000:18:00.0", "0000:ab:00.0"]


def kubevirt_read(request_dir: Path) -> list[str]:
    """PCI addresses the way KubeVirt 1.9 reads them: exactly one *-metadata.json per request
    directory, the first object whose apiVersion it knows (v1alpha1), mdevUUID before pciBusID."""
    files = list(request_dir.glob("*-metadata.json"))
    if len(files) != 1:
        raise ValueError(f"expected exactly one *-metadata.json in {request_dir}, found {len(files)}")
    known = "metadata.resource.k8s.io/v1alpha1"
    doc = next(o for o in metadata.parse_stream(files[0].read_bytes()) if o.get("apiVersion") == known)
    out = []
    for req in doc["requests"]:
        for dev in req["devices"]:
            attrs = dev["attributes"]
            if "mdevUUID" in attrs:
                out.append(attrs["mdevUUID"]["string"])
            else:
                out.append(attrs["resource.kubernetes.io/pciBusID"]["string"])
    return out


async def test_kubevirt_reader_finds_the_pci_address(tmp_path):
    node = await make_node(tmp_path)
    write_claim(node.claims_dir, claim("vm-gpu", UID, [result("gpu-3", "gpu")],
                                       annotations={"resource.kubernetes.io/pod-claim-name": "gpu"}))
    out = await node.engine.prepare([ClaimRef("default", "vm-gpu", UID)])
    assert out[UID].error == ""
    # Lay the host file out as the container sees it: the request dir holds <driver>-metadata.json.
    host = metadata.host_file(node.settings.metadata_dir, UID, "gpu")
    request_dir = tmp_path / "container-view" / "gpu"
    request_dir.mkdir(parents=True)
    (request_dir / f"{node.settings.driver_name}-metadata.json").write_bytes(host.read_bytes())
    assert kubevirt_read(request_dir) == [node.inventory.get("gpu-3").attributes[PCI_BUS_ID]]
    objs = metadata.parse_stream(host.read_bytes())
    assert [o["apiVersion"] for o in objs][-1] == "metadata.resource.k8s.io/v1alpha1"
    assert len(objs[0]["requests"]) == 1 and len(objs[0]["requests"][0]["devices"]) == 1

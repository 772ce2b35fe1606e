"""A NIC prepared for a pod moves into the pod's network namespace: the claim's CDI device carries
`netDevices` (CDI 1.1, applied by runc >= 1.4), under the name the claim's `NetworkConfig` gives; the
node's uplink never moves; a moved NIC's absence from the host is expected. Through the real kubelet:
tests/cluster/test_cluster_kubelet.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from agentkit import DRIVER, NODE, claim, make_node, nic, result, write_claim

from agent.claims.allocation import parse_claim
from agent.errors import ClaimError
from agent.kinds import Kind
from agent.model import Device
from agent.names import ClaimRef

UID = "7a1c0e00-0000-4000-8000-0000000000a1"
REF = ClaimRef("default", "net", UID)


def network_config(driver: str, **fields: Any) -> dict[str, Any]:
    return {"source": "FromClaim", "requests": ["nic"], "opaque": {"driver": driver, "parameters": {
        "apiVersion": f"{driver}/v1alpha1", "kind": "NetworkConfig", **fields}}}


async def prepare(tmp_path: Path, *, uplink: bool = False, **fields: Any):  # type: ignore[no-untyped-def]
    node = await make_node(tmp_path, nics=[nic(uplink=uplink)])
    driver = node.settings.driver_name
    config = [network_config(driver, **fields)] if fields else []
    write_claim(node.claims_dir, claim("net", UID, [result("nic-0000-3b-00-0", "nic", driver=driver)],
                                       config=config))
    out = await node.engine.prepare([REF])
    return node, out[UID]


def claim_spec(node: Any) -> dict[str, Any]:
    (path,) = [p for p in node.settings.cdi_dir.iterdir() if "claim_" in p.name]
    return json.loads(path.read_text())


def metadata_network(node: Any) -> dict[str, Any]:
    (path,) = node.settings.metadata_dir.glob(f"{UID}/nic/*.json")
    doc = json.loads(path.read_text().splitlines()[0])
    return doc["requests"][0]["devices"][0]["networkData"]


async def test_a_nic_moves_into_the_pod_under_the_name_its_config_gives(tmp_path: Path) -> None:
    node, answer = await prepare(tmp_path, interfaceName="net1")
    assert answer.error == ""
    spec = claim_spec(node)
    assert spec["cdiVersion"] == "1.1.0"
    (device,) = spec["devices"]
    assert device["containerEdits"]["netDevices"] == [{"hostInterfaceName": "ens1f0", "name": "net1"}]
    # The workload reads where its interface is, by the pod's name for it, with the host's addresses.
    assert metadata_network(node) == {"interfaceName": "net1", "ips": ["10.0.0.5/24"],
                                      "hardwareAddress": "02:00:00:00:00:01"}


async def test_without_a_config_it_keeps_its_host_name(tmp_path: Path) -> None:
    node, answer = await prepare(tmp_path)
    assert answer.error == ""
    (device,) = claim_spec(node)["devices"]
    assert device["containerEdits"]["netDevices"] == [{"hostInterfaceName": "ens1f0", "name": "ens1f0"}]


async def test_move_false_leaves_it_on_the_host(tmp_path: Path) -> None:
    node, answer = await prepare(tmp_path, move=False)
    assert answer.error == ""
    spec = claim_spec(node)
    assert "netDevices" not in spec["devices"][0]["containerEdits"] and spec["cdiVersion"] != "1.1.0"
    assert metadata_network(node)["interfaceName"] == "ens1f0"


async def test_the_uplink_is_never_moved_and_nothing_is_left_behind(tmp_path: Path) -> None:
    node, answer = await prepare(tmp_path, uplink=True)
    assert ("device nic-0000-3b-00-0 (ens1f0) is this node's uplink: ens1f0 carries the default route 0.0.0.0/0 "
            "(table main). Moved into a pod it would cut the node off, so it is never moved") in answer.error
    assert not node.settings.cdi_dir.exists() or list(node.settings.cdi_dir.iterdir()) == []
    assert not list(node.settings.metadata_dir.glob(f"{UID}/**/*.json"))
    # Left on the host explicitly (a host-network pod), it may be claimed.
    node, answer = await prepare(tmp_path / "again", uplink=True, move=False)
    assert answer.error == ""


async def test_a_moved_nic_gone_from_the_host_stays_prepared(tmp_path: Path) -> None:
    # The runtime moved it: the host's discovery no longer sees it. The kubelet's prepare after its own
    # restart is answered from the record, not rolled back as a lost device would be.
    node, answer = await prepare(tmp_path, interfaceName="net1")
    assert answer.error == ""
    before = claim_spec(node)
    node.nic_source.devices = []
    await node.inventory.scan()
    assert node.inventory.get("nic-0000-3b-00-0") is None
    again = (await node.engine.prepare([REF]))[UID]
    assert again.error == "" and claim_spec(node) == before
    found = node.engine.store.read(UID)
    assert found is not None and [d.pod_interface for d in found[0].devices] == ["net1"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"interfaceName": "a/b"}, "interfaceName must be a network interface name: 'a/b' has '/'"),
    ({"interfaceName": "x" * 16}, "is not 1 to 15 bytes long"),
    ({"interfaceName": 7}, "interfaceName must be a string, not int"),
    ({"move": "yes"}, "move must be true or false, not 'yes'"),
    ({"mac": "02:00:00:00:00:01"}, "unknown field(s) 'mac'"),
])
def test_a_bad_network_config_is_refused_by_field(fields: dict[str, Any], message: str) -> None:
    obj = claim("net", UID, [result("nic-0000-3b-00-0", "nic")], config=[network_config(DRIVER, **fields)])
    with pytest.raises(ClaimError) as err:
        parse_claim(obj, REF, driver=DRIVER, pool=NODE, lookup={"nic-0000-3b-00-0": nic()}.get)
    assert message in str(err.value)


def test_a_network_config_for_a_gpu_is_refused() -> None:
    obj = claim("net", UID, [result("gpu-0", "nic")], config=[network_config(DRIVER, interfaceName="net1")])
    with pytest.raises(ClaimError, match="a NetworkConfig applies to NICs only; device gpu-0"):
        parse_claim(obj, REF, driver=DRIVER, pool=NODE, lookup={"gpu-0": Device(name="gpu-0", kind=Kind.GPU)}.get)

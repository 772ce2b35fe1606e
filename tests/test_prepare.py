"""Prepare and unprepare semantics (docs/contract.md §2, §5-7), one test per rule, through the real engine:
simulated NVML GPUs, claims from the offline directory, files in temporary roots."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import orjson
import pytest
from agentkit import DRIVER, NODE, claim, make_node, result, write_claim, written_files

from agent.claims import metadata
from agent.model import PCI_BUS_ID
from agent.names import ClaimRef

UID1 = "1c0d7a58-0000-4000-8000-000000000001"
UID2 = "1c0d7a58-0000-4000-8000-000000000002"


@pytest.fixture
async def node(tmp_path):
    return await make_node(tmp_path)


def ref(name: str, uid: str, namespace: str = "default") -> ClaimRef:
    return ClaimRef(namespace, name, uid)


async def prepare_one(node, name, uid, namespace="default"):
    results = await node.engine.prepare([ref(name, uid, namespace)])
    return results[uid]


async def test_one_gpu_gets_claim_spec_metadata_file_and_metadata_spec(node):
    write_claim(node.claims_dir, claim("gpu-one", UID1, [result("gpu-3", "gpu")]))
    res = await prepare_one(node, "gpu-one", UID1)
    assert res.error == ""
    s = node.settings
    (dev,) = res.devices
    assert dev.device == "gpu-3" and dev.pool == NODE and dev.request == "gpu"
    assert dev.cdi_device_ids == (f"{DRIVER}/claim={UID1}-gpu-3", f"{DRIVER}/metadata={UID1}_gpu")

    spec = orjson.loads((s.cdi_dir / f"{DRIVER}-claim_{UID1}.json").read_bytes())
    assert spec["kind"] == f"{DRIVER}/claim" and spec["cdiVersion"] == "0.5.0"
    (cdev,) = spec["devices"]
    assert cdev["name"] == f"{UID1}-gpu-3"
    gpu = node.inventory.get("gpu-3")
    edits = cdev["containerEdits"]
    assert f"DRA_GPU_3_UUID={gpu.node.gpu.uuid}" in edits["env"]
    assert {n["path"] for n in edits["deviceNodes"]} == {
        "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    sim_dev = s.state_dir / "nvml-sim" / "dev"
    assert {n["hostPath"] for n in edits["deviceNodes"]} >= {str(sim_dev / "nvidia3")}

    host = s.plugin_dir / "dra-device-metadata" / UID1 / "gpu" / "metadata.json"
    assert oct(os.stat(host).st_mode & 0o777) == "0o644"
    assert oct(os.stat(host.parent).st_mode & 0o777) == "0o755"
    objs = metadata.parse_stream(host.read_bytes())
    assert [o["apiVersion"] for o in objs] == ["metadata.resource.k8s.io/v1beta1",
                                               "metadata.resource.k8s.io/v1alpha1"]
    assert host.read_bytes().endswith(b"}\n") and host.read_bytes().count(b"\n") == 2
    for o in objs:
        assert o["kind"] == "DeviceMetadata"
        assert o["metadata"] == {"name": "gpu-one", "namespace": "default", "uid": UID1, "generation": 1}
        assert "podClaimName" not in o
        (req,) = o["requests"]
        assert req["name"] == "gpu"
        (md,) = req["devices"]
        assert md["driver"] == DRIVER and md["pool"] == NODE and md["name"] == "gpu-3"
        # every attribute the slice publishes, in the API's one-of form
        assert md["attributes"] == gpu.wire()["attributes"]
        assert md["attributes"][PCI_BUS_ID] == {"string": "0000:5d:00.0"}

    mspec = orjson.loads((s.cdi_dir / f"{DRIVER}_metadata_{UID1}_gpu.json").read_bytes())
    assert mspec["kind"] == f"{DRIVER}/metadata"
    (mdev,) = mspec["devices"]
    assert mdev["name"] == f"{UID1}_gpu"
    assert mdev["containerEdits"]["mounts"] == [{
        "hostPath": str(host),
        "containerPath":
            f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/gpu-one/gpu/{DRIVER}-metadata.json",
        "options": ["ro", "bind"]}]
    assert UID1 in node.engine.records
    assert (s.claims_state_dir / f"{UID1}.rec").exists()


async def test_eight_gpus_one_request_one_metadata_file_metadata_id_on_first_device(node):
    write_claim(node.claims_dir, claim("all", UID1, [result(f"gpu-{i}", "gpus") for i in range(8)]))
    res = await prepare_one(node, "all", UID1)
    assert res.error == ""
    assert [d.device for d in res.devices] == [f"gpu-{i}" for i in range(8)]
    assert res.devices[0].cdi_device_ids[-1] == f"{DRIVER}/metadata={UID1}_gpus"
    assert all(len(d.cdi_device_ids) == 1 for d in res.devices[1:])
    req_dir = node.settings.metadata_dir / UID1 / "gpus"
    assert sorted(os.listdir(req_dir)) == ["metadata.json"]
    (req,) = metadata.parse_stream((req_dir / "metadata.json").read_bytes())[1]["requests"]
    assert [d["name"] for d in req["devices"]] == [f"gpu-{i}" for i in range(8)]


async def test_template_claim_uses_resourceclaimtemplates_path_and_pod_claim_name(node):
    write_claim(node.claims_dir, claim("pod-0-gpu-x7k2", UID1, [result("gpu-1", "gpu/h100")],
                                       annotations={"resource.kubernetes.io/pod-claim-name": "gpu"}))
    res = await prepare_one(node, "pod-0-gpu-x7k2", UID1)
    assert res.error == ""
    mspec = orjson.loads((node.settings.cdi_dir / f"{DRIVER}_metadata_{UID1}_gpu.json").read_bytes())
    mount = mspec["devices"][0]["containerEdits"]["mounts"][0]
    assert mount["containerPath"] == (
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/{DRIVER}-metadata.json")
    objs = metadata.parse_stream(Path(mount["hostPath"]).read_bytes())
    assert all(o["podClaimName"] == "gpu" for o in objs)
    assert objs[0]["requests"][0]["name"] == "gpu/h100"  # the full request name in the file
    assert res.devices[0].request == "gpu/h100"


async def test_nic_metadata_has_network_data_and_env_names_interface_and_mac(node):
    write_claim(node.claims_dir, claim("net", UID1, [result("nic-0000-3b-00-0", "nic")]))
    res = await prepare_one(node, "net", UID1)
    assert res.error == ""
    host = metadata.host_file(node.settings.metadata_dir, UID1, "nic")
    md = metadata.parse_stream(host.read_bytes())[1]["requests"][0]["devices"][0]
    assert md["networkData"] == {"interfaceName": "ens1f0", "ips": ["10.0.0.5/24"],
                                 "hardwareAddress": "02:00:00:00:00:01"}
    spec = orjson.loads((node.settings.cdi_dir / f"{DRIVER}-claim_{UID1}.json").read_bytes())
    env = spec["devices"][0]["containerEdits"]["env"]
    assert "DRA_NIC_0000_3B_00_0_INTERFACE=ens1f0" in env and "DRA_NIC_0000_3B_00_0_MAC=02:00:00:00:00:01" in env
    assert "deviceNodes" not in spec["devices"][0]["containerEdits"]


async def test_share_id_is_returned(node):
    write_claim(node.claims_dir, claim("shared", UID1, [result("gpu-0", "a", shareID="5f1b2c")]))
    res = await prepare_one(node, "shared", UID1)
    assert res.devices[0].share_id == "5f1b2c"


async def test_results_of_other_drivers_are_ignored(node):
    write_claim(node.claims_dir, claim("mixed", UID1, [result("gpu-0", "a"),
                                                        result("eth9", "b", driver="other.example.com")]))
    res = await prepare_one(node, "mixed", UID1)
    assert res.error == "" and [d.device for d in res.devices] == ["gpu-0"]


@pytest.mark.parametrize("case,expect", [
    ("unallocated", "is not allocated"),
    ("uid-mismatch", "UID mismatch"),
    ("unknown-device", "device gpu-42 is not on this node"),
    ("other-node", "device gpu-0 of pool 'node-b' is not on this node"),
    ("missing", "not found"),
])
async def test_bad_claims_get_a_precise_error_and_nothing_is_written(node, case, expect):
    if case == "unallocated":
        write_claim(node.claims_dir, claim("c", UID1, [result("gpu-0")], allocated=False))
    elif case == "uid-mismatch":
        write_claim(node.claims_dir, claim("c", UID2, [result("gpu-0")]))
    elif case == "unknown-device":
        write_claim(node.claims_dir, claim("c", UID1, [result("gpu-42")]))
    elif case == "other-node":
        write_claim(node.claims_dir, claim("c", UID1, [result("gpu-0", pool="node-b")]))
    before = written_files(node.settings)
    res = await prepare_one(node, "c", UID1)
    assert expect in res.error, res.error
    assert res.error.startswith(f"claim default/c ({UID1}): ")
    assert res.devices == []
    assert written_files(node.settings) == before
    assert node.engine.records == {}


async def test_two_claims_in_one_call_one_bad_does_not_stop_the_other(node):
    write_claim(node.claims_dir, claim("good", UID1, [result("gpu-0")]))
    write_claim(node.claims_dir, claim("bad", UID2, [result("gpu-99")]))
    out = await node.engine.prepare([ref("good", UID1), ref("bad", UID2)])
    assert set(out) == {UID1, UID2}
    assert out[UID1].error == "" and out[UID1].devices
    assert "gpu-99" in out[UID2].error
    assert set(node.engine.records) == {UID1}


async def test_repeated_prepare_returns_the_record_without_new_side_effects(node):
    write_claim(node.claims_dir, claim("c", UID1, [result("gpu-0")]))
    first = await prepare_one(node, "c", UID1)
    stats = {p: os.stat(p) for p in [str(node.settings.claims_state_dir / f"{UID1}.rec")]}
    before = written_files(node.settings)
    # The claim source changing (or vanishing) does not matter: the record is the truth.
    (node.claims_dir / "default" / "c.yaml").unlink()
    again = await prepare_one(node, "c", UID1)
    assert again.devices == first.devices and again.error == ""
    assert written_files(node.settings) == before
    for p, st in stats.items():
        assert os.stat(p).st_ino == st.st_ino and os.stat(p).st_mtime_ns == st.st_mtime_ns


async def test_concurrent_prepare_of_one_claim_has_one_set_of_side_effects(node, monkeypatch):
    write_claim(node.claims_dir, claim("c", UID1, [result("gpu-0"), result("gpu-1")]))
    writes = []
    real_write = node.engine.store.write
    monkeypatch.setattr(node.engine.store, "write", lambda rec: (writes.append(rec.uid), real_write(rec)))
    a, b = await asyncio.gather(node.engine.prepare([ref("c", UID1)]), node.engine.prepare([ref("c", UID1)]))
    assert a[UID1].devices == b[UID1].devices and a[UID1].error == ""
    assert writes == [UID1]


async def test_unprepare_removes_everything_and_is_idempotent(node):
    write_claim(node.claims_dir, claim("c", UID1, [result("gpu-0", "a"), result("nic-0000-3b-00-0", "b")]))
    before = written_files(node.settings)
    assert (await prepare_one(node, "c", UID1)).error == ""
    assert written_files(node.settings) != before
    assert await node.engine.unprepare([ref("c", UID1)]) == {UID1: ""}
    assert written_files(node.settings) == before
    assert not (node.settings.metadata_dir / UID1).exists()
    assert await node.engine.unprepare([ref("c", UID1)]) == {UID1: ""}


async def test_unprepare_of_an_unknown_claim_succeeds(node):
    assert await node.engine.unprepare([ref("never", UID2)]) == {UID2: ""}


async def test_prepare_fails_cleanly_when_a_device_node_is_missing(node):
    gpu = node.inventory.get("gpu-2")
    os.unlink(gpu.device_nodes[0].host_path)
    write_claim(node.claims_dir, claim("c", UID1, [result("gpu-2")]))
    before = written_files(node.settings)
    res = await prepare_one(node, "c", UID1)
    assert "device node /dev/nvidia2 is missing" in res.error
    assert written_files(node.settings) == before


async def test_toolkit_cdi_device_is_added_when_its_spec_is_present(node):
    gpu = node.inventory.get("gpu-4")
    static = node.settings.static_cdi_dir
    static.mkdir(parents=True)
    (static / "nvidia.yaml").write_text(
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n"
        f"- name: '{gpu.node.gpu.uuid}'\n  containerEdits: {{deviceNodes: [{{path: /dev/nvidia4}}]}}\n"
        "- name: '4'\n  containerEdits: {deviceNodes: [{path: /dev/nvidia4}]}\n")
    write_claim(node.claims_dir, claim("c", UID1, [result("gpu-4"), result("gpu-5")]))
    res = await prepare_one(node, "c", UID1)
    assert list(res.devices[0].cdi_device_ids[:2]) == [f"{DRIVER}/claim={UID1}-gpu-4",
                                                 f"nvidia.com/gpu={gpu.node.gpu.uuid}"]
    assert res.devices[1].cdi_device_ids == (f"{DRIVER}/claim={UID1}-gpu-5",)


@pytest.mark.parametrize("params,expect", [
    ({"apiVersion": f"{DRIVER}/v1alpha1", "kind": "DeviceConfig", "env": {"A": "1"}, "sharing": "x"},
     "unknown field(s) 'sharing'"),
    ({"apiVersion": "other/v1", "kind": "DeviceConfig"}, "apiVersion must be"),
    ({"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig"}, "kind must be"),
    ({"apiVersion": f"{DRIVER}/v1alpha1", "kind": "DeviceConfig", "env": {"1BAD": "x"}}, "not a valid variable"),
    ({"apiVersion": f"{DRIVER}/v1alpha1", "kind": "DeviceConfig", "env": {"DRA_X": "x"}}, "reserved"),
    ({"apiVersion": f"{DRIVER}/v1alpha1", "kind": "DeviceConfig", "env": {"A": 3}}, "must be a string"),
    ("not an object", "parameters must be an object"),
])
async def test_broken_opaque_config_is_an_error_and_writes_nothing(node, params, expect):
    config = [{"source": "FromClaim", "requests": ["req"], "opaque": {"driver": DRIVER, "parameters": params}}]
    write_claim(node.claims_dir, claim("c", UID1, [result("gpu-0")], config=config))
    before = written_files(node.settings)
    res = await prepare_one(node, "c", UID1)
    assert expect in res.error, res.error
    assert written_files(node.settings) == before


async def test_opaque_config_env_reaches_the_devices_it_names_claim_over_class(node):
    def cfg(source, requests, env):
        return {"source": source, "requests": requests,
                "opaque": {"driver": DRIVER, "parameters": {"apiVersion": f"{DRIVER}/v1alpha1",
                                                            "kind": "DeviceConfig", "env": env}}}
    config = [cfg("FromClaim", ["a"], {"MODE": "claim"}), cfg("FromClass", [], {"MODE": "class", "X": "1"}),
              {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"junk": 1}}}]
    write_claim(node.claims_dir, claim("c", UID1, [result("gpu-0", "a"), result("gpu-1", "b")], config=config))
    res = await prepare_one(node, "c", UID1)
    assert res.error == ""
    spec = orjson.loads((node.settings.cdi_dir / f"{DRIVER}-claim_{UID1}.json").read_bytes())
    env = {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]}
    assert "MODE=claim" in env[f"{UID1}-gpu-0"] and "X=1" in env[f"{UID1}-gpu-0"]
    assert "MODE=class" in env[f"{UID1}-gpu-1"]


async def test_metadata_is_rewritten_with_generation_plus_one_when_a_device_changes(node):
    from agentkit import nic

    node.nic_source.devices = [nic(ips=())]
    await node.inventory.scan(["nic"])
    write_claim(node.claims_dir, claim("net", UID1, [result("nic-0000-3b-00-0", "nic")]))
    assert (await prepare_one(node, "net", UID1)).error == ""
    host = metadata.host_file(node.settings.metadata_dir, UID1, "nic")
    first = metadata.parse_stream(host.read_bytes())[0]
    assert "ips" not in first["requests"][0]["devices"][0]["networkData"]
    assert await node.engine.refresh_devices({"nic-0000-3b-00-0"}) == 0  # nothing changed yet

    node.nic_source.devices = [nic(ips=("10.9.9.9/16",))]
    assert await node.inventory.scan(["nic"])
    assert await node.engine.refresh_devices({"nic-0000-3b-00-0"}) == 1
    for obj in metadata.parse_stream(host.read_bytes()):
        assert obj["metadata"]["generation"] == 2
        dev = obj["requests"][0]["devices"][0]
        assert dev["networkData"]["ips"] == ["10.9.9.9/16"]
        assert dev["attributes"]["ipv4"] == {"string": "10.9.9.9/16"}
    # The durable record follows: after a restart the repair writes generation 2, not 1.
    from agent.claims.store import ClaimStore

    records, _ = ClaimStore(node.settings.claims_state_dir).load_all()
    assert records[UID1].generation == 2
    assert {f.path: f.content for f in records[UID1].files}[str(host)] == host.read_bytes()


async def test_a_burst_of_claims_runs_a_few_at_a_time_and_every_one_is_prepared(node):
    # 16 claims in one burst: at most CLAIM_WORKERS of their operations run at once (a few threads overlap
    # the fsyncs; many only hand the GIL to each other), and each one is prepared. Two claims of each GPU:
    # one waits for the other's lock, holding no slot meanwhile (agent/workslots.py).
    from agent.engine import prepare as engine_prepare

    refs = []
    for i in range(16):
        uid = f"b0000000-0000-4000-8000-{i:012d}"
        write_claim(node.settings.offline / "resourceclaims", claim(f"burst-{i}", uid, [result(f"gpu-{i % 8}")]))
        refs.append(ref(f"burst-{i}", uid))
    results = await asyncio.gather(*(node.engine.prepare([r]) for r in refs))
    assert [res[r.uid].error for res, r in zip(results, refs, strict=True)] == [""] * 16
    slots = node.engine.slots
    assert 1 < slots.most <= engine_prepare.CLAIM_WORKERS and slots.running == 0


async def test_a_claim_asked_for_by_three_calls_at_once_is_prepared_once_and_said_once(node, caplog):
    # The kubelet asks once per pod when the pods of a PodGroup share a claim (seen through the real
    # kubelet: three calls within a millisecond): one prepares it, the others are answered from its
    # record, and the log says "prepared" once, not three times.
    import logging

    caplog.set_level(logging.INFO, logger="agent.engine.prepare")
    write_claim(node.claims_dir, claim("shared-gpu", UID1, [result("gpu-3", "gpu")]))
    answers = await asyncio.gather(*(prepare_one(node, "shared-gpu", UID1) for _ in range(3)))
    await asyncio.sleep(0)  # the line is logged once the loop is back from answering
    assert [a.error for a in answers] == [""] * 3
    assert len({tuple(d.cdi_device_ids for d in a.devices) for a in answers}) == 1
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prepared ")]
    assert said == [f"prepared claim default/shared-gpu ({UID1})"]

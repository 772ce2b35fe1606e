"""Consumable GPU shares (`--gpu-sharing`, `gpu-<minor>-shared`) and the GPU host-memory overhead in node
allocatable: the published form (valid under the 1.37 schema, the API rules and the API emulator), and
shares of one GPU prepared for two claims through the engine, each with its own share ID and memory
limit in its CDI env and metadata, and unprepared independently."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import kubernetes_validate
import orjson
import pytest
from agentkit import DRIVER, NODE, Node, claim, make_node, result, roots, write_claim
from handshakes import paused
from kubeapi import RESOURCE_SLICES, KubeApi

from agent import apirules, failpoints, quantity
from agent.app.assembly import set_node_features
from agent.claims import metadata
from agent.claims import plan as claimplan
from agent.computeshare import ComputeShares
from agent.config import ConfigError, NvmlMode, Settings
from agent.inventory import Inventory
from agent.inventory.gpus import GpuSource
from agent.inventory.gpushare import memory_request_policy, percent_compute
from agent.kinds import Kind
from agent.kube import NODE_ALLOCATABLE_FEATURE, NodeInfo, read_node
from agent.model import Device
from agent.names import ClaimRef
from agent.publish.apiserver import ApiPublisher
from agent.publish.slices import build_slices
from agent.sim.nvmlopen import open_sim_nvml

UID1 = "5a4e0c1d-0000-4000-8000-000000000001"
UID2 = "5a4e0c1d-0000-4000-8000-000000000002"
SHARE1 = "0b7e1f3a-0000-4000-8000-0000000000a1"
SHARE2 = "0b7e1f3a-0000-4000-8000-0000000000a2"
GIB = 1 << 30


def scan(tmp_path: Path, profile: str = "dgx-h100", *, sharing: bool = True, node_allocatable: bool = False,
         overhead: int | None = None) -> dict[str, Device]:
    extra = {} if overhead is None else {"host_memory_overhead": overhead}
    source = GpuSource(Settings(node_name=NODE, nvml=NvmlMode("sim", profile), state_dir=tmp_path / "state"),
                       dynamic_mig=True, sharing=sharing, opener=open_sim_nvml, **extra)
    source.node_allocatable = node_allocatable
    source.open()
    try:
        return {d.name: d for d in source.scan().devices}
    finally:
        source.close()


# -- the published form -----------------------------------------------------------------------------

def test_each_gpu_has_a_shared_form_taking_the_whole_gpu(tmp_path: Path) -> None:
    devices = scan(tmp_path)
    gpus = sorted(n for n, d in devices.items() if d.kind == "gpu")
    shares = sorted(n for n, d in devices.items() if d.kind == Kind.GPUSHARE)
    assert len(gpus) == 8 and shares == sorted(f"{g}-shared" for g in gpus)
    gpu, share = devices["gpu-0"], devices["gpu-0-shared"]
    assert share.allow_multiple_allocations and not gpu.allow_multiple_allocations
    assert share.attributes == {**gpu.attributes, "type": "shared"}
    # What the whole GPU takes: `gpu` and all of `memory`, which every MIG placement takes some of.
    assert share.consumes_counters == gpu.consumes_counters
    [use] = share.consumes_counters
    assert use.counters == {"gpu": "1", "memory": use.counter_set.counters["memory"]}
    assert any(k.startswith("memory-slice-") for k in use.counter_set.counters)  # the set has MIG's counters
    memory = quantity.parse_int(gpu.capacity["memory"].value)
    cap = share.capacity["memory"]
    assert cap.value == gpu.capacity["memory"].value
    assert cap.request_policy == {"default": "1Gi", "validRange": {"min": "1Gi", "max": f"{memory // GIB}Gi",
                                                                   "step": "1Gi"}}
    assert memory % GIB and memory // GIB == 79  # an H100's 81559Mi: max rounds down to a multiple of step
    assert (share.device_nodes, share.gpu) == (gpu.device_nodes, gpu.gpu)  # its device nodes and UUID
    assert not any(d.kind == Kind.GPUSHARE for d in scan(tmp_path / "off", sharing=False).values())


def test_no_shared_form_for_a_gpu_too_small_to_share() -> None:
    assert memory_request_policy(GIB + GIB // 2) is None
    assert memory_request_policy(2 * GIB) == {"default": "1Gi", "validRange": {"min": "1Gi", "max": "2Gi",
                                                                               "step": "1Gi"}}


def test_overhead_only_when_the_node_declares_the_feature(tmp_path: Path) -> None:
    plain = scan(tmp_path / "a")
    assert all(d.node_allocatable is None for d in plain.values())
    source = GpuSource(Settings(node_name=NODE, nvml=NvmlMode("sim", "dgx-h100"), state_dir=tmp_path / "b"),
                       dynamic_mig=True, sharing=True, host_memory_overhead=300 * (1 << 20), opener=open_sim_nvml)
    inventory = Inventory([source])
    # The daemon's switch, as for CPU and memory devices: only a Node that declares the feature.
    set_node_features(inventory, NodeInfo(NODE, declared_features=frozenset({"SomethingElse"})))
    assert source.node_allocatable is False
    set_node_features(inventory, NodeInfo(NODE, declared_features=frozenset({NODE_ALLOCATABLE_FEATURE})))
    source.open()
    try:
        devices = source.scan().devices
    finally:
        source.close()
    kinds = {d.kind for d in devices}
    assert {"gpu", "vfio", "mig", Kind.GPUSHARE} <= kinds
    for d in devices:
        assert d.node_allocatable == {"memory": {"overhead": {"perContainer": "300Mi"}}}, d.name
    objs = build_slices(devices, driver=DRIVER, node=NODE)
    assert sum(len(o["spec"].get("devices") or []) for o in objs) == len(devices)
    for obj in objs:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    assert apirules.pool_errors(objs) == []


@pytest.mark.parametrize("profile", ["dgx-h100", "hgx-16"])
@pytest.mark.parametrize("sharing", [False, True])
@pytest.mark.parametrize("declared", [False, True])
async def test_slices_are_accepted_by_the_api_emulator(tmp_path: Path, kube_api: KubeApi, profile: str,
                                                       sharing: bool, declared: bool) -> None:
    devices = list(scan(tmp_path, profile, sharing=sharing, node_allocatable=declared).values())
    features = [NODE_ALLOCATABLE_FEATURE] if declared else []
    kube_api.add_node(NODE, uid="6f1d2c3b-0000-4000-8000-000000000001", declared_features=features)
    node = await read_node(kube_api.client(), NODE)
    settings = roots(tmp_path / "roots")
    res = await ApiPublisher(kube_api.client(timeout=5.0), settings, node).sync(devices)
    assert res.devices == len(devices)
    stored = kube_api.items(RESOURCE_SLICES)
    assert apirules.pool_errors(stored) == []
    published = {d["name"]: d for o in stored for d in o["spec"].get("devices") or []}
    assert set(published) == {d.name for d in devices}
    for dev in devices:
        wire = published[dev.name]
        assert ("nodeAllocatableResources" in wire) == declared, dev.name
        assert wire.get("allowMultipleAllocations", False) == (dev.kind == Kind.GPUSHARE)


@pytest.mark.parametrize("policy, capacity, expect", [
    ({"default": "1Gi", "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"}}, "81559Mi", None),
    ({"default": "1Gi", "validRange": {"min": "1Gi", "max": "81559Mi", "step": "1Gi"}}, "81559Mi",
     "whole number of validRange.step"),
    ({"default": "1Gi", "validRange": {"min": "1Gi", "max": "90Gi", "step": "1Gi"}}, "81559Mi", "above the cap"),
    ({"default": "100Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}, "200Gi", None),
    ({"default": "0", "validRange": {"min": "1Gi"}}, "2Gi", "within validRange"),
    ({"validRange": {"min": "1Gi"}}, "2Gi", "needs a default"),
    ({"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}, "1Gi", "min + step"),
    # Fractional ranges (DRAFractionalCapacityRange) count in thousandths.
    ({"default": "100m", "validRange": {"min": "50m", "max": "1", "step": "50m"}}, "1", None),
    ({"default": "100m", "validRange": {"min": "50m", "step": "30m"}}, "1", "whole number of validRange.step"),
    ({"default": "100m", "validRange": {"min": "50m", "max": "950m", "step": "100m"}}, "1",
     "whole number of validRange.step"),
    ({"default": "100m", "validRange": {"min": "500u", "step": "50m"}}, "1", "thousandths"),
    ({"default": "3", "validRange": {"min": "0", "step": "1500m"}}, "4", None),
    ({"default": "2", "validValues": ["1", "2", "4"]}, "8", None),
    ({"default": "3", "validValues": ["1", "2", "4"]}, "8", "one of validValues"),
    ({"default": "1", "validValues": ["2", "1"]}, "8", "ascending"),
])
def test_request_policy_rules(policy: dict[str, Any], capacity: str, expect: str | None) -> None:
    errs = apirules.request_policy_errors(policy, capacity)
    assert errs == [] if expect is None else any(expect in e for e in errs), errs


@pytest.mark.parametrize("res, expect", [
    ({"overhead": {"perContainer": "256Mi"}}, None),
    ({"overhead": {"perPod": "1Gi", "perContainer": "64Mi"}}, None),
    ({"mapping": {"capacityKey": "memory", "capacityMultiplier": "1"}, "overhead": {"perPod": "1Mi"}}, None),
    ({}, "mapping or an overhead"),
    ({"overhead": {"perNode": "1Mi"}}, "unknown fields"),
    ({"overhead": {"perPod": "lots"}}, "not a quantity"),
    ({"overhead": {"perPod": "-1Mi"}}, "negative"),
    ({"mapping": {"capacityKey": "memory"}}, "capacityMultiplier"),
    ({"mapping": {"deviceMultiplier": "2", "capacityMultiplier": "1"}}, "without capacityKey"),
])
def test_node_allocatable_rules(res: dict[str, Any], expect: str | None) -> None:
    errs = apirules.node_allocatable_errors("memory", res, {"memory": {"value": "1Gi"}})
    assert errs == [] if expect is None else any(expect in e for e in errs), errs


# -- prepare ------------------------------------------------------------------------------------------

@pytest.fixture
async def node(tmp_path: Path) -> Node:
    return await make_node(tmp_path, gpu_sharing=True)


def share(uid: str, share_id: str, memory: str, device: str = "gpu-0-shared") -> dict[str, Any]:
    return result(device, "gpu", shareID=share_id, consumedCapacity={"memory": memory})


def claim_spec(node: Node, uid: str) -> dict[str, Any]:
    return dict(orjson.loads((node.settings.cdi_dir / f"{DRIVER}-claim_{uid}.json").read_bytes()))


async def test_the_mps_limit_is_keyed_by_the_ordinal_cuda_gives_the_shared_gpu(node: Node) -> None:
    # A whole GPU first and a share of another: CUDA numbers them 0 and 1 in the order of
    # CUDA_VISIBLE_DEVICES, and MPS applies a limit keyed by that ordinal (not one keyed by UUID).
    write_claim(node.claims_dir, claim("mixed", UID1, [result("gpu-1", "whole"),
                                                         result("gpu-2-shared", "gpu", shareID=SHARE1,
                                                                consumedCapacity={"memory": "6Gi"})]))
    out = await node.engine.prepare([ClaimRef("default", "mixed", UID1)])
    assert out[UID1].error == "", out[UID1].error
    whole, shared = node.inventory.get("gpu-1"), node.inventory.get("gpu-2")
    assert whole is not None and shared is not None and whole.gpu is not None and shared.gpu is not None
    envs = {d["name"]: d["containerEdits"]["env"] for d in claim_spec(node, UID1)["devices"]}
    share_env = next(e for n, e in envs.items() if "shared" in n)
    assert f"CUDA_VISIBLE_DEVICES={whole.gpu.uuid},{shared.gpu.uuid}" in share_env
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1={6 << 10}M" in share_env


def metadata_entry(node: Node, uid: str) -> dict[str, Any]:
    host = metadata.host_file(node.settings.metadata_dir, uid, "gpu")
    (req,) = metadata.parse_stream(host.read_bytes())[0]["requests"]
    (dev,) = req["devices"]
    return dict(dev)


async def test_two_claims_share_one_gpu_each_with_its_own_id_and_limit(node: Node) -> None:
    write_claim(node.claims_dir, claim("a", UID1, [share(UID1, SHARE1, "4Gi")]))
    write_claim(node.claims_dir, claim("b", UID2, [share(UID2, SHARE2, "10Gi")]))
    out = await node.engine.prepare([ClaimRef("default", "a", UID1), ClaimRef("default", "b", UID2)])
    assert out[UID1].error == "" and out[UID2].error == "", (out[UID1].error, out[UID2].error)
    assert [d.share_id for d in out[UID1].devices] == [SHARE1]
    assert [d.share_id for d in out[UID2].devices] == [SHARE2]
    gpu = node.inventory.get("gpu-0")
    assert gpu is not None
    for uid, share_id, limit in ((UID1, SHARE1, 4 * GIB), (UID2, SHARE2, 10 * GIB)):
        (cdev,) = claim_spec(node, uid)["devices"]
        env = cdev["containerEdits"]["env"]
        assert f"DRA_GPU_0_SHARED_MEMORY_LIMIT={limit}" in env
        assert f"DRA_GPU_0_SHARED_SHARE_ID={share_id}" in env
        assert f"DRA_GPU_0_SHARED_UUID={gpu.node.gpu.uuid}" in env
        # MPS applies a limit keyed by the ordinal CUDA gives the device (0: the claim's only GPU)
        assert f"CUDA_VISIBLE_DEVICES={gpu.node.gpu.uuid}" in env
        assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={limit >> 20}M" in env
        assert {n["path"] for n in cdev["containerEdits"]["deviceNodes"]} == {
            "/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
        entry = metadata_entry(node, uid)
        assert entry["name"] == "gpu-0-shared" and entry["shareID"] == share_id
        assert entry["consumedCapacity"] == {"memory": quantity.binary(limit)}
        assert entry["attributes"]["type"] == {"string": "shared"}

    # One goes, the other stays whole.
    assert await node.engine.unprepare([ClaimRef("default", "a", UID1)]) == {UID1: ""}
    assert not (node.settings.cdi_dir / f"{DRIVER}-claim_{UID1}.json").exists()
    assert not metadata.host_dir(node.settings.metadata_dir, UID1).exists()
    assert "DRA_GPU_0_SHARED_MEMORY_LIMIT=10737418240" in claim_spec(node, UID2)["devices"][0]["containerEdits"]["env"]
    assert metadata_entry(node, UID2)["shareID"] == SHARE2
    assert await node.engine.unprepare([ClaimRef("default", "b", UID2)]) == {UID2: ""}
    assert not (node.settings.cdi_dir / f"{DRIVER}-claim_{UID2}.json").exists()


async def test_claims_sharing_one_gpu_are_prepared_and_unprepared_at_once(node: Node) -> None:
    """The claims of one shared GPU exclude nothing among themselves (each has its own files): a
    share's prepare never waits for another share of the GPU (a node full of pods shares few GPUs)."""
    write_claim(node.claims_dir, claim("a", UID1, [share(UID1, SHARE1, "4Gi")]))
    write_claim(node.claims_dir, claim("b", UID2, [share(UID2, SHARE2, "10Gi")]))
    refs = [ClaimRef("default", "a", UID1), ClaimRef("default", "b", UID2)]
    failpoints.configure("after-claim-spec=pause")
    try:
        prepares = [asyncio.create_task(node.engine.prepare([r])) for r in refs]
        await paused("after-claim-spec", 2)  # both are halfway at once, each holding the GPU's lock
        failpoints.configure("unprepare-after-record=pause")  # and the prepares go on
        assert [(await t)[r.uid].error for t, r in zip(prepares, refs, strict=True)] == ["", ""]
        unprepares = [asyncio.create_task(node.engine.unprepare([r])) for r in refs]
        await paused("unprepare-after-record", 2)
        failpoints.configure("")
        assert [await t for t in unprepares] == [{UID1: ""}, {UID2: ""}]
    finally:
        failpoints.configure("")
    assert node.engine.records == {}


async def test_the_claims_own_config_may_set_the_mps_limit(node: Node) -> None:
    config = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": f"{DRIVER}/v1alpha1", "kind": "DeviceConfig",
        "env": {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M"}}}}]
    write_claim(node.claims_dir, claim("a", UID1, [share(UID1, SHARE1, "4Gi")], config=config))
    out = await node.engine.prepare([ClaimRef("default", "a", UID1)])
    assert out[UID1].error == ""
    env = claim_spec(node, UID1)["devices"][0]["containerEdits"]["env"]
    assert [e for e in env if e.startswith("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=")] == [
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M"]
    assert "DRA_GPU_0_SHARED_MEMORY_LIMIT=4294967296" in env


# -- compute shares (`--gpu-compute-shares`) ------------------------------------------------------------

def test_a_shared_gpu_offers_compute_in_fractions_of_the_gpu(tmp_path: Path) -> None:
    devices = scan(tmp_path)
    shared = devices["gpu-0-shared"]
    compute = shared.capacity["compute"]
    assert compute.value == "1"
    assert compute.request_policy == {"default": "100m", "validRange": {"min": "50m", "max": "1", "step": "50m"}}
    assert apirules.request_policy_errors(compute.request_policy, compute.value) == []
    # Only the shared form: a whole GPU is not consumed in parts.
    assert "compute" not in devices["gpu-0"].capacity
    # Whole percentages, in the form an API server without fractional ranges keeps.
    (percent,) = percent_compute([shared])
    assert set(percent.capacity) == {"memory", "computePercent"}
    assert percent.capacity["computePercent"].value == "100"
    assert percent.capacity["computePercent"].request_policy == {
        "default": "10", "validRange": {"min": "5", "max": "100", "step": "5"}}
    assert percent_compute([devices["gpu-0"]]) == [devices["gpu-0"]]


def test_compute_shares_follow_the_setting(tmp_path: Path) -> None:
    settings = Settings(node_name=NODE, gpu_compute_shares="0.25/0.25/0.75/0.25")
    assert settings.compute_shares == ComputeShares(25, 25, 75, 25)
    value, policy = ComputeShares(25, 25, 75, 25).fraction_capacity()
    assert (value, policy) == ("1", {"default": "250m", "validRange": {"min": "250m", "max": "750m", "step": "250m"}})
    assert Settings(node_name=NODE, gpu_compute_shares="off").compute_shares is None
    source = GpuSource(Settings(node_name=NODE, nvml=NvmlMode("sim", "dgx-h100"), state_dir=tmp_path / "state",
                                gpu_compute_shares="off"), sharing=True, opener=open_sim_nvml)
    source.open()
    try:
        shared = next(d for d in source.scan().devices if d.kind is Kind.GPUSHARE)
    finally:
        source.close()
    assert set(shared.capacity) == {"memory"}


@pytest.mark.parametrize("text, expect", [
    ("0.1/0.05", "DEFAULT/MIN/MAX/STEP"),
    ("0.1/0.05/1/lots", "STEP 'lots' is not a number"),
    ("0.125/0.05/1/0.05", "not a whole percentage"),
    ("0.1/0.05/1.5/0.05", "<= 1"),
    ("0.1/0/1/0.05", "0 < MIN"),
    ("0.1/0.05/1/0.03", "whole number of STEPs"),
    ("0.1/0.1/1/0", "STEP must be above 0"),
])
def test_bad_compute_shares_are_refused_at_start(text: str, expect: str) -> None:
    with pytest.raises(ConfigError, match="--gpu-compute-shares") as caught:
        Settings(node_name=NODE, gpu_compute_shares=text)
    assert expect in str(caught.value)


def compute_share(share_id: str, memory: str, compute: dict[str, str], device: str = "gpu-0-shared") -> dict[str, Any]:
    return result(device, "gpu", shareID=share_id, consumedCapacity={"memory": memory, **compute})


async def test_each_claim_gets_the_thread_percentage_of_its_compute_share(node: Node) -> None:
    write_claim(node.claims_dir, claim("a", UID1, [compute_share(SHARE1, "4Gi", {"compute": "250m"})]))
    write_claim(node.claims_dir, claim("b", UID2, [compute_share(SHARE2, "4Gi", {"computePercent": "50"})]))
    out = await node.engine.prepare([ClaimRef("default", "a", UID1), ClaimRef("default", "b", UID2)])
    assert out[UID1].error == "" and out[UID2].error == "", (out[UID1].error, out[UID2].error)
    for uid, percent in ((UID1, "25"), (UID2, "50")):
        env = claim_spec(node, uid)["devices"][0]["containerEdits"]["env"]
        assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percent}" in env
        assert f"DRA_GPU_0_SHARED_COMPUTE_PERCENT={percent}" in env
    assert metadata_entry(node, UID1)["consumedCapacity"] == {"memory": "4Gi", "compute": "250m"}


async def test_a_claim_with_shares_of_two_gpus_gets_the_smaller_thread_percentage(node: Node) -> None:
    write_claim(node.claims_dir, claim("a", UID1, [compute_share(SHARE1, "4Gi", {"compute": "750m"}),
                                                   compute_share(SHARE2, "2Gi", {"compute": "200m"},
                                                                 device="gpu-1-shared")]))
    out = await node.engine.prepare([ClaimRef("default", "a", UID1)])
    assert out[UID1].error == "", out[UID1].error
    envs = {d["name"]: d["containerEdits"]["env"] for d in claim_spec(node, UID1)["devices"]}
    assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20" in env for env in envs.values()), envs
    assert any("DRA_GPU_0_SHARED_COMPUTE_PERCENT=75" in env for env in envs.values())


@pytest.mark.parametrize("given, expect", [("20", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20"),
                                           ("30", "above what the claim's compute shares give (25)")])
async def test_a_configuration_may_only_lower_the_thread_percentage(node: Node, given: str, expect: str) -> None:
    config = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": f"{DRIVER}/v1alpha1", "kind": "DeviceConfig",
        "env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": given}}}}]
    write_claim(node.claims_dir, claim("a", UID1, [compute_share(SHARE1, "4Gi", {"compute": "250m"})],
                                       config=config))
    out = await node.engine.prepare([ClaimRef("default", "a", UID1)])
    if expect.startswith("CUDA"):
        assert out[UID1].error == "", out[UID1].error
        env = claim_spec(node, UID1)["devices"][0]["containerEdits"]["env"]
        assert [e for e in env if e.startswith("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=")] == [expect]
    else:
        assert expect in out[UID1].error
        assert node.engine.records == {}


@pytest.mark.parametrize("compute, expect", [
    ({"compute": "333m"}, "not a whole percentage"),
    ({"compute": "2"}, "not a whole percentage"),
    ({"computePercent": "0"}, "not a whole percentage"),
    ({"compute": "500m", "computePercent": "50"}, "names both"),
])
async def test_a_compute_share_that_is_no_percentage_is_refused(node: Node, compute: dict[str, str],
                                                                 expect: str) -> None:
    write_claim(node.claims_dir, claim("a", UID1, [compute_share(SHARE1, "4Gi", compute)]))
    out = await node.engine.prepare([ClaimRef("default", "a", UID1)])
    assert expect in out[UID1].error
    assert node.engine.records == {}


@pytest.mark.parametrize("res, expect", [
    (result("gpu-0-shared", "gpu", consumedCapacity={"memory": "4Gi"}), "no shareID"),
    (result("gpu-0-shared", "gpu", shareID=SHARE1), "no consumedCapacity.memory"),
    (result("gpu-0-shared", "gpu", shareID=SHARE1, consumedCapacity={"memory": "90Gi"}), "is not a share"),
    (result("gpu-0-shared", "gpu", shareID=SHARE1, consumedCapacity={"memory": "0"}), "is not a share"),
    (result("gpu-0-shared", "gpu", shareID=SHARE1, consumedCapacity={"memory": 4}), "must be a quantity"),
    (result("gpu-0-shared", "gpu", shareID=SHARE1, consumedCapacity=["4Gi"]), "must be an object"),
])
async def test_a_share_without_what_it_got_is_refused(node: Node, res: dict[str, Any], expect: str) -> None:
    write_claim(node.claims_dir, claim("a", UID1, [res]))
    out = await node.engine.prepare([ClaimRef("default", "a", UID1)])
    assert expect in out[UID1].error
    assert node.engine.records == {}


async def test_a_metadata_refresh_keeps_each_shares_memory(node: Node) -> None:
    write_claim(node.claims_dir, claim("a", UID1, [share(UID1, SHARE1, "6Gi")]))
    assert (await node.engine.prepare([ClaimRef("default", "a", UID1)]))[UID1].error == ""
    read = node.engine.store.read(UID1)
    assert read is not None
    record = read[0]
    current = node.inventory.get("gpu-0-shared")
    assert current is not None
    changed = dataclasses.replace(current, attributes={**current.attributes, "driverVersion": "next"})
    out = claimplan.refreshed(node.settings, lambda name: changed if name == changed.name else None, record)
    assert out is not None
    new, paths = out
    (path,) = paths
    content = next(f.content for f in new.files if f.path == path)
    (req,) = metadata.parse_stream(content)[0]["requests"]
    (entry,) = req["devices"]
    assert entry["attributes"]["driverVersion"] == {"string": "next"}
    assert entry["shareID"] == SHARE1 and entry["consumedCapacity"] == {"memory": "6Gi"}
    assert new.generation == record.generation + 1

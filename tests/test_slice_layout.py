"""What a device slice says of its devices (1.37, gated): `partitionTypeAttribute` on the slices of MIG and
vGPU devices (`--partition-type-attribute`, `DRAPartitionableDevicesType`) and `skipNodeOperations` on the
slices of CPU or memory devices whose claims need no prepare (`--skip-node-operations`, where the Node
declares `DRAOptionalNodeOperations`); the API's rules for both; and what publishing leaves out where the
API server drops or refuses a gated field."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx2
import kubernetes_validate
import pytest
from lightkube.core.exceptions import ApiError
from topology import build_topology

from agent import apirules
from agent.config import build_settings
from agent.inventory.cpus import CpuSource
from agent.inventory.gpus import GpuSource
from agent.inventory.memory import MemorySource
from agent.inventory.published import PARTITION_TYPE
from agent.kinds import Kind
from agent.kube import OPTIONAL_NODE_OPERATIONS_FEATURE, NodeInfo
from agent.model import Device
from agent.publish import dropped, slices
from agent.sim.nvmlopen import open_sim_nvml
from agent.sim.profiles import BUILTIN

DRIVER = "dra.example.com"
NODE = "node-a"
ATTR = f"{DRIVER}/{PARTITION_TYPE}"


def one_gpu_profile(tmp: Path) -> str:
    """The DGX H100's first GPU alone (a machine whose partition types fit one pool status summary)."""
    profile = dict(BUILTIN["dgx-h100"])
    profile["gpus"] = profile["gpus"][:1]
    path = tmp / "one-gpu.json"
    path.write_text(json.dumps(profile))
    return f"sim:{path}"


def gpu_devices(tmp: Path, nvml: str, **extra: Any) -> list[Device]:
    s = build_settings({"driver_name": DRIVER, "node_name": NODE, "nvml": nvml, "state_dir": tmp / "state",
                        "vgpu_types": "auto", "compatibility_groups": True, **extra})
    source = GpuSource(s, opener=open_sim_nvml)
    source.open()
    try:
        return source.scan().devices
    finally:
        source.close()


def valid(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for obj in objs:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    assert apirules.pool_errors(objs) == []
    return objs


def cost(device: dict[str, Any]) -> str:
    return json.dumps(device.get("consumesCounters") or [], sort_keys=True)


def test_mig_and_vgpu_devices_get_slices_naming_their_partition_type(tmp_path: Path) -> None:
    devices = gpu_devices(tmp_path, one_gpu_profile(tmp_path), partition_type_attribute=True)
    layout = slices.SliceLayout(partition_type_attribute=ATTR)
    chunks = slices.chunk_devices(devices, compatibility_groups=True, layout=layout)
    assert chunks.errors == [] and chunks.dropped == []
    objs = valid(slices.build_slices(devices, driver=DRIVER, node=NODE, compatibility_groups=True, layout=layout))
    marked = [o for o in objs if o["spec"].get("partitionTypeAttribute")]
    assert marked and all(o["spec"]["partitionTypeAttribute"] == ATTR for o in marked)
    in_marked = [d for o in marked for d in o["spec"]["devices"]]
    kinds = {d["attributes"]["type"]["string"] for d in in_marked}
    assert kinds == {"mig", "vgpu"}
    # Every MIG and vGPU device is in them, and nothing else is.
    rest = [d for o in objs if not o["spec"].get("partitionTypeAttribute") for d in o["spec"].get("devices") or []]
    assert not {d["attributes"]["type"]["string"] for d in rest} & {"mig", "vgpu"}
    # Devices of one type take the same counters (what a pool status summary needs), and there are few
    # enough types for one summary.
    by_type: dict[str, set[str]] = defaultdict(set)
    for d in in_marked:
        by_type[d["attributes"][PARTITION_TYPE]["string"]].add(cost(d))
    assert all(len(costs) == 1 for costs in by_type.values()) and len(by_type) <= slices.MAX_PARTITION_TYPES
    # The instances of one vGPU type on the GPU are one type; each MIG placement is a type of its own.
    vgpus = [d for d in in_marked if d["attributes"]["type"]["string"] == "vgpu"]
    assert len({d["attributes"][PARTITION_TYPE]["string"] for d in vgpus}) < len(vgpus)
    migs = [d for d in in_marked if d["attributes"]["type"]["string"] == "mig"]
    assert len({d["attributes"][PARTITION_TYPE]["string"] for d in migs}) == len(migs)
    assert {d["attributes"][PARTITION_TYPE]["string"] for d in migs} >= {"gpu-0 1g.10gb@0", "gpu-0 7g.80gb@0"}
    # Without the setting: no attribute, one layout as before.
    plain = gpu_devices(tmp_path, one_gpu_profile(tmp_path))
    assert not any(PARTITION_TYPE in d.attributes for d in plain)


def test_no_partition_type_attribute_where_a_summary_could_not_hold_the_types(tmp_path: Path) -> None:
    # Eight GPUs have far more than 32 partition types (each MIG placement is one): a pool status summary
    # would report an error instead, so the slices name none and say why once.
    devices = gpu_devices(tmp_path, "sim:dgx-h100", partition_type_attribute=True)
    chunks = slices.chunk_devices(devices, compatibility_groups=True,
                                  layout=slices.SliceLayout(partition_type_attribute=ATTR))
    assert not any(isinstance(c, slices.DeviceChunk) and c.partition_type_attribute for c in chunks.slices)
    assert any("partitionTypeAttribute" in m and "more than the 32" in m for m in chunks.dropped)
    assert chunks.errors == []


def test_cpu_and_memory_devices_that_skip_node_operations_get_slices_of_their_own(tmp_path: Path) -> None:
    s = build_settings({"driver_name": DRIVER, "node_name": NODE, "sysfs_root": build_topology(tmp_path / "sys"),
                        "skip_node_operations": "memory"})
    devices = CpuSource(s).scan().devices + MemorySource(s).scan().devices
    layout = dropped.layout(s, NodeInfo(NODE, declared_features=frozenset({OPTIONAL_NODE_OPERATIONS_FEATURE})))
    assert layout.skip_kinds == {Kind.MEMORY}
    objs = valid(slices.build_slices(devices, driver=DRIVER, node=NODE, layout=layout))
    said = {d["name"]: o["spec"].get("skipNodeOperations") for o in objs for d in o["spec"]["devices"]}
    assert said == {**{f"cpu-numa{n}": None for n in range(4)},
                    **{f"memory-numa{n}": ["NodePrepareResources", "NodeUnprepareResources"] for n in range(4)}}
    # A Node that does not declare the feature: the scheduler would never place such a claim there.
    assert dropped.layout(s, NodeInfo(NODE)).skip_kinds == frozenset()
    # And where the API server drops the field, it is not made again.
    gone = dropped.layout(s, NodeInfo(NODE, declared_features=frozenset({OPTIONAL_NODE_OPERATIONS_FEATURE})),
                          {dropped.SKIP_NODE_OPERATIONS, dropped.PARTITION_TYPE_ATTRIBUTE, dropped.LIST_VALUES})
    assert gone == slices.SliceLayout(list_attributes=False)


def test_only_cpu_and_memory_may_skip_node_operations() -> None:
    with pytest.raises(ValueError, match="gpu cannot skip prepare"):
        build_settings({"node_name": NODE, "skip_node_operations": "memory,gpu"})


def slice_of(devices: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"},
            "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1,
                                                                  "resourceSliceCount": 1},
                     "devices": devices, **spec}}


def test_the_api_rules_of_the_two_slice_fields() -> None:
    consumer = {"name": "a", "attributes": {PARTITION_TYPE: {"string": "t"}},
                "consumesCounters": [{"counterSet": "c", "counters": {"x": {"value": "1"}}}]}
    plain = {"name": "b"}
    assert apirules.slice_errors(slice_of([consumer, plain], partitionTypeAttribute=ATTR)) == []
    # The attribute in its full name works as well as bare in the driver's domain.
    full = {**consumer, "attributes": {ATTR: {"string": "t"}}}
    assert apirules.slice_errors(slice_of([full], partitionTypeAttribute=ATTR)) == []
    assert apirules.slice_errors(slice_of([plain], partitionTypeAttribute=ATTR))
    lacking = {**consumer, "attributes": {}}
    assert apirules.slice_errors(slice_of([lacking], partitionTypeAttribute=ATTR))
    not_string = {**consumer, "attributes": {PARTITION_TYPE: {"int": 1}}}
    assert apirules.slice_errors(slice_of([not_string], partitionTypeAttribute=ATTR))
    assert apirules.slice_errors(slice_of([consumer], partitionTypeAttribute=PARTITION_TYPE))  # not qualified
    assert apirules.slice_errors(slice_of([plain], skipNodeOperations=["NodePrepareResources"]))
    assert apirules.slice_errors(slice_of([plain], skipNodeOperations=["NodePrepareResources", "*"])) == []
    assert apirules.slice_errors(slice_of([plain], skipNodeOperations=["Other"]))
    for obj in (slice_of([consumer, plain], partitionTypeAttribute=ATTR),
                slice_of([plain], skipNodeOperations=["NodePrepareResources", "NodeUnprepareResources"])):
        kubernetes_validate.validate(obj, "1.37.0", strict=True)


def refusal(*fields: str) -> ApiError:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 422, "reason": "Invalid",
            "message": "ResourceSlice is invalid", "details": {"causes": [
                {"reason": "FieldValueInvalid", "message": "Invalid value", "field": f} for f in fields]}}
    request = httpx2.Request("POST", "https://api/apis/resource.k8s.io/v1/resourceslices")
    return ApiError(request, httpx2.Response(422, json=body, request=request))


def test_a_refusal_of_list_attributes_is_told_apart_from_other_refusals() -> None:
    lists = {"resource.kubernetes.io/numaNode"}
    assert dropped.refuses_lists(refusal("spec.devices[3].attributes[resource.kubernetes.io/numaNode]"), lists)
    assert dropped.refuses_lists(refusal("spec.devices[0].attributes[resource.kubernetes.io/numaNode]",
                                         "spec.devices[9].attributes[resource.kubernetes.io/numaNode]"), lists)
    assert not dropped.refuses_lists(refusal("spec.devices[3].attributes[resource.kubernetes.io/numaNode]"), set())
    assert not dropped.refuses_lists(refusal("spec.devices[3].attributes[other]"), lists)
    assert not dropped.refuses_lists(refusal("spec.devices[3].attributes[resource.kubernetes.io/numaNode]",
                                             "spec.devices[3].name"), lists)
    assert not dropped.refuses_lists(refusal(), lists)
    assert dropped.list_attributes({"devices": [{"attributes": {"a": {"ints": [1]}, "b": {"int": 1}}}]}) == {"a"}

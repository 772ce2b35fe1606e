"""ResourceSlices built from the inventory: valid for the 1.37 API server, split by its limits, and
planned so that an unchanged inventory writes nothing and a changed one moves the generation."""

from __future__ import annotations

import copy
import json
import logging
import random
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from lightkube.resources.resource_v1 import ResourceSlice

from agent import apirules, quantity
from agent.config import NvmlMode, Settings
from agent.inventory.cpus import cpu_node_allocatable, cpu_request_policy
from agent.inventory.gpus import GpuSource
from agent.inventory.memory import memory_node_allocatable, memory_request_policy
from agent.kinds import Kind
from agent.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, Capacity, Device, Taint, Version
from agent.publish.slices import (
    NodeRef,
    build_slices,
    chunk_devices,
    device_order,
    generate_name,
    new_slice_name,
    plan_pool,
    render_slice,
    same_slice,
)
from agent.sim.nvmlopen import open_sim_nvml

DRIVER = "dra.example.com"
NODE = "node-a"
OWNER = NodeRef(NODE, "6f1d2c3b-0000-4000-8000-000000000001")


def valid(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, "1.37.0", strict=True)
    assert apirules.slice_errors(obj) == []


def gpu(i: int, **extra: Any) -> Device:
    return Device(
        name=f"gpu-{i}", kind=Kind.GPU,
        attributes={"type": "gpu", "index": i, "uuid": f"GPU-{i:08d}-0000-0000-0000-000000000000",
                    "productName": "NVIDIA H100 80GB HBM3", "driverVersion": Version("570.124.6"),
                    "cudaComputeCapability": Version("9.0.0"), "migCapable": True, "migEnabled": False,
                    PCI_BUS_ID: f"0000:{0x18 + i:02x}:00.0", PCIE_ROOT: f"pci0000:{0x17 + i:02x}",
                    NUMA_NODE: i // 4, **extra},
        capacity={"memory": Capacity(quantity.binary(81559 * 1024 * 1024))},
    )


def nic(i: int, **extra: Any) -> Device:
    return Device(
        name=f"nic-{i:03d}", kind=Kind.NIC,
        attributes={"type": "nic", "ifName": f"ens{i}",
                    "macAddress": f"02:00:00:00:{i // 256:02x}:{i % 256:02x}",
                    "mtu": 1500, "linkUp": True, "isVf": False, "rdma": False,
                    PCI_BUS_ID: f"0000:{i // 32 + 1:02x}:{i % 32:02x}.0", **extra},
    )


def cpu(node: int) -> Device:
    return Device(
        name=f"cpu-numa{node}", kind=Kind.CPU,
        attributes={"type": "cpu", NUMA_NODE: node, "socket": node, "smt": True},
        capacity={"cpus": Capacity(quantity.decimal(48), request_policy=cpu_request_policy())},
        allow_multiple_allocations=True, node_allocatable=cpu_node_allocatable(),
    )


def memory(node: int) -> Device:
    return Device(
        name=f"memory-numa{node}", kind=Kind.MEMORY,
        attributes={"type": "memory", NUMA_NODE: node},
        capacity={"memory": Capacity(quantity.binary(512 * 1024**3), request_policy=memory_request_policy())},
        allow_multiple_allocations=True, node_allocatable=memory_node_allocatable(),
    )


XID = Taint(key=f"{DRIVER}/xid", value="79", effect="NoSchedule", time_added="2026-03-01T10:00:00Z")
LOST = Taint(key=f"{DRIVER}/gpu-lost", effect="NoExecute", time_added="2026-03-01T10:00:05Z")


def a_node() -> list[Device]:
    gpus = [gpu(i) for i in range(8)]
    gpus[3].taints = [XID]
    gpus[5].taints = [XID, LOST]
    nics = [nic(i) for i in range(4)]
    nics[1].taints = [Taint(key=f"{DRIVER}/link-down", effect="NoSchedule")]
    return [*gpus, *nics, cpu(0), cpu(1), memory(0), memory(1)]


def names(obj: dict[str, Any]) -> list[str]:
    return [d["name"] for d in obj["spec"]["devices"]]


# -- what gets emitted --------------------------------------------------------------------------

def test_a_whole_node_renders_as_valid_slices() -> None:
    devices = a_node()
    out = build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER)
    assert len(out) == 1
    obj = out[0]
    valid(obj)
    assert obj["apiVersion"] == "resource.k8s.io/v1" and obj["kind"] == "ResourceSlice"
    assert obj["metadata"] == {
        "generateName": f"{DRIVER}-{NODE}-00-",
        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": OWNER.uid,
                             "controller": True}]}
    spec = obj["spec"]
    assert (spec["driver"], spec["nodeName"]) == (DRIVER, NODE)
    assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    # In the pool's order: by kind, the forms asked for most first (`slices.KIND_ORDER`), then by name.
    assert names(obj) == [d.name for d in sorted(devices, key=device_order)]
    by_name = {d["name"]: d for d in spec["devices"]}
    assert by_name["cpu-numa1"]["nodeAllocatableResources"] == cpu_node_allocatable()
    assert by_name["cpu-numa1"]["capacity"]["cpus"] == {"value": "48", "requestPolicy": cpu_request_policy()}
    assert by_name["memory-numa0"]["capacity"]["memory"]["value"] == "512Gi"
    assert by_name["gpu-5"]["taints"] == [XID.wire(), LOST.wire()]
    assert by_name["gpu-0"]["attributes"]["driverVersion"] == {"version": "570.124.6"}


def test_without_a_node_uid_there_is_no_owner_reference() -> None:
    obj = build_slices([gpu(0)], driver=DRIVER, node=NODE, owner=NodeRef(NODE, ""))[0]
    valid(obj)
    assert "ownerReferences" not in obj["metadata"]


def test_simulated_gpus_render_as_valid_slices(tmp_path: Path) -> None:
    settings = Settings(node_name=NODE, nvml=NvmlMode("sim", "dgx-h100"), state_dir=tmp_path / "state")
    source = GpuSource(settings, opener=open_sim_nvml)
    source.open()
    try:
        devices = source.scan().devices
    finally:
        source.close()
    assert devices
    chunks = chunk_devices(devices)
    assert chunks.dropped == []
    for obj in build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER):
        valid(obj)


def test_the_typed_client_model_sends_exactly_what_was_rendered() -> None:
    # The publisher posts through lightkube's typed ResourceSlice and compares what it reads back
    # with what it renders: a field the model lost or added would mean a rewrite on every sync.
    for obj in build_slices(a_node(), driver=DRIVER, node=NODE, owner=OWNER):
        assert ResourceSlice.from_dict(obj).to_dict() == obj


def test_300_nics_make_three_slices() -> None:
    out = build_slices([nic(i) for i in range(300)], driver=DRIVER, node=NODE, owner=OWNER)
    assert [len(o["spec"]["devices"]) for o in out] == [128, 128, 44]
    assert all(o["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 3} for o in out)
    assert [n for o in out for n in names(o)] == [f"nic-{i:03d}" for i in range(300)]
    for obj in out:
        valid(obj)


def test_one_tainted_device_limits_its_slice_to_64() -> None:
    plain = [nic(i) for i in range(101)]
    assert [len(o["spec"]["devices"]) for o in build_slices(plain, driver=DRIVER, node=NODE)] == [101]

    tainted = [nic(i) for i in range(101)]
    tainted[50].taints = [Taint(key=f"{DRIVER}/link-down", effect="NoSchedule")]
    out = build_slices(tainted, driver=DRIVER, node=NODE, owner=OWNER)
    holding = [o for o in out if "nic-050" in names(o)]
    assert len(holding) == 1 and len(holding[0]["spec"]["devices"]) <= 64
    assert sum(len(o["spec"]["devices"]) for o in out) == 101
    for obj in out:
        valid(obj)


def test_bad_values_are_dropped_and_logged_the_rest_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    bad = gpu(1, productName="X" * 65, driverVersion=Version("570.124.06"))
    devices = [gpu(0), bad, gpu(2)]
    with caplog.at_level(logging.WARNING, logger="agent.publish.slices"):
        out = build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER)
    valid(out[0])
    assert names(out[0]) == ["gpu-0", "gpu-1", "gpu-2"]
    published = {d["name"]: d for d in out[0]["spec"]["devices"]}
    assert "productName" not in published["gpu-1"]["attributes"]
    assert "driverVersion" not in published["gpu-1"]["attributes"]
    # Everything else about that device, and every other device, is untouched.
    expected = gpu(1).wire()["attributes"]
    del expected["productName"], expected["driverVersion"]
    assert published["gpu-1"]["attributes"] == expected
    assert published["gpu-1"]["capacity"] == gpu(1).wire()["capacity"]
    assert published["gpu-0"] == gpu(0).wire() and published["gpu-2"] == gpu(2).wire()
    messages = [r.getMessage() for r in caplog.records]
    assert any("gpu-1" in m and "'productName'" in m and "64" in m for m in messages)
    assert any("gpu-1" in m and "'driverVersion'" in m and "semantic version" in m for m in messages)


def test_a_device_with_an_invalid_name_is_dropped_alone(caplog: pytest.LogCaptureFixture) -> None:
    odd = gpu(9)
    odd.name = "GPU_9"
    with caplog.at_level(logging.WARNING, logger="agent.publish.slices"):
        chunks = chunk_devices([gpu(0), odd, gpu(1)])
    assert [d["name"] for d in chunks.slices[0]] == ["gpu-0", "gpu-1"]
    assert any("'GPU_9'" in m for m in chunks.dropped)
    assert any("GPU_9" in r.getMessage() for r in caplog.records)


def test_bad_capacity_taint_and_attribute_name_are_dropped() -> None:
    dev = gpu(0, **{"no/t-valid name": "x", "ok_name": 1})
    dev.capacity["cores"] = Capacity("lots")
    dev.taints = [Taint(key="bad key!", effect="NoSchedule"),
                  Taint(key=f"{DRIVER}/xid", effect="Sometimes"), XID]
    chunks = chunk_devices([dev])
    wire = chunks.slices[0][0]
    assert "no/t-valid name" not in wire["attributes"] and wire["attributes"]["ok_name"] == {"int": 1}
    assert set(wire["capacity"]) == {"memory"}
    assert wire["taints"] == [XID.wire()]
    assert len(chunks.dropped) == 4
    valid(render_slice(chunks.slices[0], driver=DRIVER, node=NODE, owner=OWNER, generation=1, count=1))


def test_too_many_attributes_drop_the_custom_ones_first() -> None:
    extra = {f"extra{i:02d}": i for i in range(40)}
    dev = gpu(0, **extra)
    chunks = chunk_devices([dev])
    wire = chunks.slices[0][0]
    assert len(wire["attributes"]) + len(wire["capacity"]) == apirules.MAX_ATTRIBUTES_AND_CAPACITIES
    for kept in ("type", PCI_BUS_ID, PCIE_ROOT, NUMA_NODE):
        assert kept in wire["attributes"]
    assert "memory" in wire["capacity"]
    # Among the custom attributes the last names go first, the same ones every time.
    dropped_extra = [k for k in extra if k not in wire["attributes"]]
    assert dropped_extra == list(extra)[-len(dropped_extra):]
    assert len(chunks.dropped) == len(set(dev.attributes) - set(wire["attributes"]))
    valid(render_slice(chunks.slices[0], driver=DRIVER, node=NODE, owner=OWNER, generation=1, count=1))


def test_duplicate_device_names_keep_one() -> None:
    chunks = chunk_devices([gpu(0), gpu(0, index=99)])
    assert [d["name"] for d in chunks.slices[0]] == ["gpu-0"]
    assert chunks.dropped == ["device 'gpu-0' dropped: duplicate name"]


def test_same_inventory_gives_identical_objects() -> None:
    devices = [nic(i) for i in range(200)] + a_node()
    shuffled = copy.deepcopy(devices)
    random.Random(7).shuffle(shuffled)
    first = build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER)
    second = build_slices(shuffled, driver=DRIVER, node=NODE, owner=OWNER)
    assert json.dumps(first) == json.dumps(second)


def test_long_node_names_still_give_a_valid_generate_name() -> None:
    node = ("n" * 60 + ".") * 4 + "x"
    base = generate_name(DRIVER, node)
    # The API server appends five characters; the result must be a DNS subdomain of at most 63.
    assert len(base) + 5 <= 63
    assert apirules.dns_subdomain_errors(base + "abcde") == []
    obj = build_slices([gpu(0)], driver=DRIVER, node=node, owner=NodeRef(node, "u"))[0]
    valid(obj)


# -- planning -----------------------------------------------------------------------------------

def served(objs: list[dict[str, Any]], start: int = 0) -> dict[str, dict[str, Any]]:
    """The objects as the API server would hand them back: named, with server metadata."""
    out = {}
    for i, obj in enumerate(objs, start):
        stored = copy.deepcopy(obj)
        stored["metadata"].update(name=f"{obj['metadata']['generateName']}{i:05d}", uid=f"uid-{i}",
                                  resourceVersion=str(100 + i), creationTimestamp="2026-03-01T00:00:00Z")
        out[stored["metadata"]["name"]] = stored
    return out


def plan_for(existing: dict[str, dict[str, Any]], devices: list[Device], **kw: Any) -> Any:
    return plan_pool(existing, chunk_devices(devices).slices, driver=DRIVER, node=NODE,
                     owner=kw.pop("owner", OWNER), **kw)


def test_plan_first_publish_creates_generation_1() -> None:
    plan = plan_for({}, [nic(i) for i in range(300)])
    assert plan.generation == 1 and plan.deletes == []
    assert [w.key for w in plan.writes] == [None, None, None]
    assert all(w.obj["spec"]["pool"]["generation"] == 1 for w in plan.writes)


def test_plan_unchanged_pool_does_nothing() -> None:
    devices = [nic(i) for i in range(300)]
    existing = served(build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER, generation=4))
    plan = plan_for(existing, devices)
    assert plan.noop and plan.generation == 4
    assert sorted(plan.unchanged) == sorted(existing)


def test_plan_changed_device_updates_only_its_slice_in_place() -> None:
    devices = [nic(i) for i in range(300)]
    existing = served(build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER, generation=4))
    devices[200].attributes["linkUp"] = False
    plan = plan_for(existing, devices)
    assert plan.generation == 4 and plan.deletes == []
    assert len(plan.writes) == 1
    (write,) = plan.writes
    assert "nic-200" in names(existing[write.key]) and "nic-200" in names(write.obj)
    assert write.obj["spec"]["pool"] == {"name": NODE, "generation": 4, "resourceSliceCount": 3}


def test_plan_growth_writes_a_new_generation_reusing_objects() -> None:
    existing = served(build_slices([nic(i) for i in range(100)], driver=DRIVER, node=NODE, owner=OWNER))
    plan = plan_for(existing, [nic(i) for i in range(200)])
    assert plan.generation == 2 and plan.deletes == []
    assert [w.key for w in plan.writes] == [next(iter(existing)), None]
    assert all(w.obj["spec"]["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 2}
               for w in plan.writes)


def test_plan_shrink_bumps_generation_and_deletes_the_rest_last() -> None:
    existing = served(build_slices([nic(i) for i in range(300)], driver=DRIVER, node=NODE, owner=OWNER,
                                   generation=2))
    plan = plan_for(existing, [nic(i) for i in range(50)])
    assert plan.generation == 3
    assert len(plan.writes) == 1 and plan.writes[0].key in existing
    assert plan.writes[0].obj["spec"]["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    assert len(plan.deletes) == 2 and plan.writes[0].key not in plan.deletes


def test_plan_devices_moving_between_slices_is_a_new_generation() -> None:
    devices = [nic(i) for i in range(200)]
    existing = served(build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER))
    # Still two slices, but a new name early in the order pushes a device into the second slice.
    plan = plan_for(existing, [*devices[:-1], Device(name="nic-00a", kind=Kind.NIC)])
    assert plan.generation == 2
    assert len(plan.writes) == 2 and all(w.key in existing for w in plan.writes)


def test_plan_leftovers_of_an_older_generation_are_deleted() -> None:
    devices = [nic(i) for i in range(10)]
    current = served(build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER, generation=3))
    stale = served(build_slices([nic(i) for i in range(300)], driver=DRIVER, node=NODE, owner=OWNER,
                                generation=2), start=10)
    plan = plan_for({**current, **stale}, devices)
    assert plan.generation == 3 and plan.writes == []
    assert sorted(plan.deletes) == sorted(stale)


def test_plan_keeps_the_taint_time_the_server_stamped() -> None:
    dev = gpu(0)
    dev.taints = [Taint(key=f"{DRIVER}/xid", value="79", effect="NoSchedule")]
    existing = served(build_slices([dev], driver=DRIVER, node=NODE, owner=OWNER))
    stored = next(iter(existing.values()))
    stored["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2026-03-01T10:00:00Z"
    assert plan_for(existing, [dev]).noop
    dev.attributes["index"] = 7
    (write,) = plan_for(existing, [dev]).writes
    assert write.obj["spec"]["devices"][0]["taints"][0]["timeAdded"] == "2026-03-01T10:00:00Z"


def test_plan_new_node_uid_rewrites_the_owner() -> None:
    devices = [gpu(0)]
    existing = served(build_slices(devices, driver=DRIVER, node=NODE, owner=NodeRef(NODE, "old")))
    (write,) = plan_for(existing, devices).writes
    assert write.obj["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_plan_copies_in_the_current_generation_are_deleted_in_place() -> None:
    devices = [nic(i) for i in range(300)]
    existing = served(build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER, generation=4))
    original = sorted(existing)[1]
    # A create retried after a lost answer (or another agent) left the same slice twice, plus a
    # third copy that says something stale about a device.
    copies = served([existing[original], existing[original]], start=90)
    stale = sorted(copies)[1]
    copies[stale]["spec"]["devices"][0]["attributes"]["mtu"] = {"int": 1}
    plan = plan_for({**existing, **copies}, devices)
    assert plan.generation == 4 and plan.writes == []
    assert sorted(plan.deletes) == sorted(copies)  # one copy stays: the one saying what is wanted
    assert sorted(plan.unchanged) == sorted(existing)


def test_plan_copies_that_all_differ_keep_the_first_and_rewrite_it() -> None:
    devices = [nic(i) for i in range(10)]
    existing = served(build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER) * 2)
    for obj in existing.values():
        obj["spec"]["devices"][0]["attributes"]["mtu"] = {"int": 1}
    plan = plan_for(existing, devices)
    first, second = sorted(existing)
    assert plan.generation == 1 and [w.key for w in plan.writes] == [first] and plan.deletes == [second]


def test_plan_a_device_in_two_different_slices_is_a_new_generation() -> None:
    devices = [nic(i) for i in range(200)]
    existing = served(build_slices(devices, driver=DRIVER, node=NODE, owner=OWNER))
    overlap = served(build_slices(devices[100:150], driver=DRIVER, node=NODE, owner=OWNER), start=50)
    for obj in overlap.values():
        obj["spec"]["pool"]["resourceSliceCount"] = 2
    plan = plan_for({**existing, **overlap}, devices)
    assert plan.generation == 2 and len(plan.writes) == 2 and len(plan.deletes) == 1
    written = sorted(n for w in plan.writes for n in names(w.obj))
    assert written == sorted(d.name for d in devices)
    assert {w.key for w in plan.writes}.isdisjoint(plan.deletes)


def test_new_slice_names_look_like_generated_ones() -> None:
    node = ("n" * 60 + ".") * 4 + "x"
    for place, count in ((0, 1), (7, 12), (99, 100), (100, 101)):
        generate = generate_name(DRIVER, node, place, count)
        drawn = {new_slice_name(generate) for _ in range(50)}
        assert len(drawn) == 50
        for name in drawn:
            assert name.startswith(generate) and len(name) <= 63
            assert apirules.dns_subdomain_errors(name) == []


def test_same_slice_ignores_what_the_server_adds() -> None:
    dev = gpu(0)
    dev.taints = [Taint(key=f"{DRIVER}/xid", value="79", effect="NoSchedule")]
    desired = build_slices([dev], driver=DRIVER, node=NODE, owner=OWNER)[0]
    stored = next(iter(served([desired]).values()))
    stored["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2026-03-01T10:00:00Z"
    assert same_slice(stored, desired)
    assert "timeAdded" not in desired["spec"]["devices"][0]["taints"][0]  # not changed on the way
    stored["spec"]["pool"]["generation"] = 2
    assert not same_slice(stored, desired)


def test_plan_no_devices_deletes_everything() -> None:
    existing = served(build_slices([gpu(0)], driver=DRIVER, node=NODE, owner=OWNER))
    plan = plan_for(existing, [])
    assert plan.writes == [] and plan.deletes == list(existing)


def test_plan_with_fixed_slots_names_every_write() -> None:
    slots = [f"{DRIVER}-{NODE}-{i}" for i in range(3)]
    first = plan_for({}, [nic(i) for i in range(300)], slots=slots)
    assert [w.key for w in first.writes] == slots
    on_disk = {w.key: w.obj for w in first.writes}
    assert plan_for(on_disk, [nic(i) for i in range(300)], slots=slots).noop
    shrunk = plan_for(on_disk, [nic(i) for i in range(10)], slots=slots)
    assert shrunk.generation == 2
    assert [w.key for w in shrunk.writes] == slots[:1] and shrunk.deletes == slots[1:]


def test_a_value_of_an_unsupported_type_is_dropped_not_fatal() -> None:
    dev = gpu(0)
    dev.attributes["clockGHz"] = 1.98  # type: ignore[assignment]
    dev.attributes["zeta"] = "kept"
    chunks = chunk_devices([dev, gpu(1)])
    (first, second) = chunks.slices[0]
    assert "clockGHz" not in first["attributes"] and first["attributes"]["zeta"] == {"string": "kept"}
    assert second == gpu(1).wire()
    assert chunks.dropped == ["device gpu-0: attribute 'clockGHz' dropped: unsupported value type float"]

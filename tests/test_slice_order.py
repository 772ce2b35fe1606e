"""The order of a pool's devices as the scheduler walks them, and slice names that keep it on every node.

The allocator (k8s.io/dynamic-resource-allocation) walks a pool's slices sorted by name and each slice's
devices in order, for every pod and every node, until a device matches and is free. These tests read the
pool that way: the slices as stored (or as the API server would name them), sorted by name.
"""

from __future__ import annotations

import asyncio
import secrets
import string
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubeapi import RESOURCE_SLICES, KubeApi

from agent import apirules
from agent.app import oneshot
from agent.config import Settings, build_settings
from agent.kinds import Kind
from agent.kube import Backoff, NodeInfo, read_node
from agent.model import Device
from agent.publish.apiserver import ApiPublisher, DirectoryPublisher
from agent.publish.slices import KIND_ORDER, SliceLayout, build_slices, chunk_devices, plan_pool

DRIVER = "dra.example.com"
FAST = Backoff(initial=0.01, maximum=0.05, attempts=4)
# The published `type` of each kind, in the order the pool must give them.
TYPE_ORDER = ["cpu", "memory", "gpu", "vfio", "shared", "nic", "vgpu", "mig"]


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> list[Device]:
    """The simulated DGX H100 with every GPU form (whole, passthrough, shares, dynamic MIG), CPUs and memory,
    discovered as the agent does, plus NICs of a fixed inventory (the host's own are excluded)."""
    tmp = tmp_path_factory.mktemp("rich")
    settings = build_settings({"nvml": "sim:dgx-h100", "state_dir": tmp / "state", "offline": tmp / "offline",
                               "node_name": "node-a", "gpu_sharing": True, "dynamic_mig": True, "nic_exclude": "*"})
    devices, _ = asyncio.run(oneshot.discover_once(settings))
    return [*devices, *nics(4)]


def nics(n: int) -> list[Device]:
    # Named to sort before the GPUs: the order must not come from the names.
    return [Device(name=f"a-nic-{i}", kind=Kind.NIC, attributes={"type": "nic", "ifName": f"ens{i}"})
            for i in range(n)]


def walked(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The devices in the order the allocator walks them: slices by name, devices in order."""
    return [d for o in sorted(objs, key=lambda o: o["metadata"]["name"]) for d in o["spec"].get("devices") or []]


def server_name(generate: str) -> str:
    """What the API server makes of a generateName: five random characters after it."""
    return generate + "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))


def as_served(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects named as the API server names them."""
    return [{**o, "metadata": {**o["metadata"], "name": server_name(o["metadata"]["generateName"])}}
            for o in objs]


def types(devices: list[dict[str, Any]]) -> list[str]:
    return [d["attributes"]["type"]["string"] for d in devices]


def test_every_kind_has_its_place() -> None:
    assert sorted(KIND_ORDER) == sorted(Kind) and len(KIND_ORDER) == len(Kind)
    assert [Kind(k).published_type for k in KIND_ORDER] == TYPE_ORDER


def test_the_pool_walks_the_forms_asked_for_most_first_and_partitions_last(rich: list[Device]) -> None:
    devices = rich
    objs = build_slices(devices, driver=DRIVER, node="node-a")
    assert apirules.pool_errors(objs) == []
    for _ in range(20):  # whatever the random characters: the order is the names' places
        order = types(walked(as_served(objs)))
        assert set(order) == {"gpu", "vfio", "shared", "nic", "cpu", "memory", "mig"}
        assert order == sorted(order, key=TYPE_ORDER.index)
    # Within a kind, by name: the same on every node and every publish.
    names = [d["name"] for d in walked(as_served(objs))]
    gpus = [n for n, t in zip(names, order, strict=True) if t == "gpu"]
    assert gpus == sorted(gpus) and len(gpus) == 8
    assert order.count("mig") == 8 * 13  # the many (--mig-profiles): every walk for a whole device stops before them


@pytest.mark.parametrize("partition_type_attribute", [False, True])
def test_partitions_in_slices_of_their_own_stay_last(rich: list[Device], partition_type_attribute: bool) -> None:
    layout = SliceLayout(partition_type_attribute=f"{DRIVER}/partitionType" if partition_type_attribute else "",
                         skip_kinds=frozenset({Kind.CPU, Kind.MEMORY}))
    devices = rich
    objs = build_slices(devices, driver=DRIVER, node="node-a", layout=layout)
    assert apirules.pool_errors(objs) == []
    order = types(walked(as_served(objs)))
    assert order == sorted(order, key=TYPE_ORDER.index)
    # The skipped calls and the partition type are said by slices that hold nothing else.
    for o in objs:
        held = set(types(o["spec"].get("devices") or []))
        if o["spec"].get("skipNodeOperations"):
            assert held <= {"cpu", "memory"}
        if o["spec"].get("partitionTypeAttribute"):
            assert held <= {"mig", "vgpu"}


async def published(kube_api: KubeApi, settings: Settings, node: str, devices: list[Device]) -> list[dict[str, Any]]:
    kube_api.add_node(node, uid=f"uid-{node}")
    info = await read_node(kube_api.client(), node)
    publisher = ApiPublisher(kube_api.client(timeout=1.0), settings, info, backoff=FAST)
    await publisher.sync(devices)
    return [s for s in kube_api.items(RESOURCE_SLICES) if s["spec"]["nodeName"] == node]


async def test_every_node_stores_its_slices_under_names_that_sort_in_the_pools_order(
        kube_api: KubeApi, tmp_path: Path, rich: list[Device]) -> None:
    devices = rich
    settings = Settings(driver_name=DRIVER, node_name="node-a", state_dir=tmp_path / "state")
    long_node = ("n" * 60 + ".") * 3 + "x"  # the node part of the name cut short; the place is kept
    for node in ("node-a", "node-b", "node-c", long_node):
        stored = await published(kube_api, settings, node, devices)
        wanted = [d for o in build_slices(devices, driver=DRIVER, node=node) for d in o["spec"].get("devices") or []]
        assert len(stored) > 3
        assert [d["name"] for d in walked(stored)] == [d["name"] for d in wanted]
        for o in stored:
            assert len(o["metadata"]["name"]) <= 63 and apirules.dns_subdomain_errors(o["metadata"]["name"]) == []


async def test_slices_of_an_older_agent_are_replaced_by_a_new_generation_in_order(
        kube_api: KubeApi, tmp_path: Path, rich: list[Device]) -> None:
    node = "node-a"
    devices = rich
    settings = Settings(driver_name=DRIVER, node_name=node, state_dir=tmp_path / "state")
    # What an older agent left: the same split, generation 3, names with no place (generateName
    # `<driver>-<node>-` and five random characters).
    old = build_slices(devices, driver=DRIVER, node=node, owner=None, generation=3)
    for o in old:
        o["metadata"] = {"generateName": f"{DRIVER}-{node}-"}
        o["metadata"]["name"] = server_name(o["metadata"]["generateName"])
        kube_api.add(o)
    old_names = {o["metadata"]["name"] for o in old}
    kube_api.add_node(node, uid=f"uid-{node}")
    info = await read_node(kube_api.client(), node)
    publisher = ApiPublisher(kube_api.client(timeout=1.0), settings, info, backoff=FAST)
    kube_api.mark()
    result = await publisher.sync(devices)
    # A name cannot change: every slice is created anew in generation 4, and the old ones go only once
    # the whole new generation is stored (the scheduler never sees a pool with devices missing).
    assert result.generation == 4 and len(result.created) == len(old) and set(result.deleted) == old_names
    writes = [r.method for r in kube_api.writes()]
    # (A dry run may go first: the shares' fractional compute is tried before the first write.)
    assert set(writes) == {"POST", "DELETE"} and writes[-len(old):] == ["DELETE"] * len(old)
    assert writes.count("DELETE") == len(old)
    stored = [s for s in kube_api.items(RESOURCE_SLICES) if s["spec"]["nodeName"] == node]
    assert {s["spec"]["pool"]["generation"] for s in stored} == {4}
    assert apirules.pool_errors(stored) == []
    wanted = [d for o in build_slices(devices, driver=DRIVER, node=node) for d in o["spec"].get("devices") or []]
    assert [d["name"] for d in walked(stored)] == [d["name"] for d in wanted]
    # And the next sync finds nothing to do.
    kube_api.mark()
    again = await publisher.sync(devices)
    assert not again.created + again.updated + again.deleted and kube_api.writes() == []


async def test_a_change_of_split_keeps_the_order(kube_api: KubeApi, tmp_path: Path) -> None:
    node = "node-a"
    settings = Settings(driver_name=DRIVER, node_name=node, state_dir=tmp_path / "state")
    many = [Device(name=f"z-nic-{i:03d}", kind=Kind.NIC, attributes={"type": "nic", "ifName": f"ens{i}"})
            for i in range(300)]
    stored = await published(kube_api, settings, node, many)
    assert len(stored) == 3
    info = await read_node(kube_api.client(), node)
    publisher = ApiPublisher(kube_api.client(timeout=1.0), settings, info, backoff=FAST)
    # A whole GPU appears: it goes first and every slice's devices move by one (the same 3 slices, each
    # rewritten in its place); then 100 NICs more: a fourth slice, after the others.
    gpu = Device(name="gpu-0", kind=Kind.GPU, attributes={"type": "gpu"})
    for extra in ([gpu], [gpu, *nics(100)]):
        devices = many + extra
        result = await publisher.sync(devices)
        # The objects already named for the places are rewritten (a new generation); only the new place
        # gets a new object.
        assert len(result.updated) == 3 and len(result.created) == len(extra) // 100 and not result.deleted
        stored = [s for s in kube_api.items(RESOURCE_SLICES) if s["spec"]["nodeName"] == node]
        assert len({s["spec"]["pool"]["generation"] for s in stored}) == 1
        wanted = [d["name"] for c in chunk_devices(devices).slices for d in c]
        assert [d["name"] for d in walked(stored)] == wanted
        assert wanted[0] == "gpu-0"


async def test_the_directory_publisher_gives_each_file_its_place(tmp_path: Path, rich: list[Device]) -> None:
    node = "node-a"
    devices = rich
    settings = Settings(driver_name=DRIVER, node_name=node, state_dir=tmp_path / "state")
    out = tmp_path / "out" / "resourceslices"
    out.mkdir(parents=True)
    # Files an older agent wrote: the same slices, generateName with no place.
    old = build_slices(devices, driver=DRIVER, node=node, generation=2)
    for i, o in enumerate(old):
        o["metadata"]["generateName"] = f"{DRIVER}-{node}-"
        (out / f"{DRIVER}-{node}-{i}.yaml").write_text(yaml.safe_dump(o))
    result = await DirectoryPublisher(tmp_path / "out", settings, NodeInfo(node)).sync(devices)
    assert result.generation == 2 and len(result.updated) == len(old)
    objs = [yaml.safe_load((out / f"{DRIVER}-{node}-{i}.yaml").read_text()) for i in range(len(old))]
    # Created from these files, the slices sort by name in the files' order.
    assert [o["metadata"]["generateName"] for o in objs] == [f"{DRIVER}-{node}-{i:02d}-" for i in range(len(old))]
    order = types(walked(as_served(objs)))
    assert order == sorted(order, key=TYPE_ORDER.index)


def test_a_slice_stored_under_another_places_name_is_rewritten_in_a_new_generation() -> None:
    # Two slices whose devices sit under each other's place (what no agent of this version writes, but a
    # pool may hold: someone's edit, a split that moved): the devices are right, the order is not.
    node = "node-a"
    many = [Device(name=f"nic-{i:03d}", kind=Kind.NIC, attributes={"type": "nic", "ifName": f"ens{i}"})
            for i in range(200)]
    objs = as_served(build_slices(many, driver=DRIVER, node=node, generation=5))
    first, second = objs
    swapped = {first["metadata"]["name"]: {**second, "metadata": first["metadata"]},
               second["metadata"]["name"]: {**first, "metadata": second["metadata"]}}
    plan = plan_pool(swapped, chunk_devices(many).slices, driver=DRIVER, node=node)
    # Each object keeps its name and gets the devices of its place, in generation 6; nothing is deleted.
    assert plan.generation == 6 and not plan.deletes
    assert [w.key for w in plan.writes] == [first["metadata"]["name"], second["metadata"]["name"]]
    rewritten = [{**w.obj, "metadata": {**w.obj["metadata"], "name": w.key}} for w in plan.writes]
    assert [d["name"] for d in walked(rewritten)] == [d.name for d in many]

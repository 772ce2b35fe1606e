"""NUMA alignment and KubeVirt's CPU names: the list form of the standard numaNode attribute, the CPU
devices `--kubevirt-cpu` publishes, and the published form the Node's declared features switch."""

from __future__ import annotations

from pathlib import Path

import pytest
from agentkit import DRIVER, NODE
from topology import build_topology

from agent import apirules
from agent.app.assembly import PublishedForm, numa_lists, set_node_features
from agent.config import build_settings
from agent.inventory import Inventory
from agent.inventory.cpus import KUBEVIRT_CPU_CAPACITY, KUBEVIRT_SOCKET, CpuSource
from agent.inventory.memory import MemorySource
from agent.inventory.numa import NumaTopology, numa_topology
from agent.kinds import Kind
from agent.kube import LIST_ATTRIBUTES_FEATURE, NodeInfo
from agent.model import NUMA_NODE, Capacity, Device, IntList, attribute_from_wire, attribute_wire
from agent.publish import slices


def settings(root: Path, **extra: object):  # type: ignore[no-untyped-def]
    return build_settings({"driver_name": DRIVER, "node_name": NODE, "sysfs_root": root, **extra})


def test_the_list_form_is_the_node_then_its_sockets_nearest_nodes(tmp_path: Path) -> None:
    topo = numa_topology(build_topology(tmp_path / "sys"))
    assert topo.sockets == {0: 0, 1: 0, 2: 1, 3: 1}
    assert [topo.numa_list(n) for n in range(4)] == [(0, 1), (1, 0), (2, 3), (3, 2)]
    # A node nearer than the socket's others, but on another socket, does not count; the same-socket
    # nodes further away do not either: only those at the smallest distance of any node.
    skewed = NumaTopology({0: (10, 12, 11, 21), 1: (12, 10, 21, 21), 2: (11, 21, 10, 21), 3: (21, 21, 21, 10)},
                          {0: 0, 1: 0, 2: 1, 3: 1})
    assert skewed.numa_list(0) == (0,)
    # A CPU-less memory node (socket unknown) at the nearest distance is included, from either socket
    # (a deliberate over-approximation of the standard rule); a known other socket is not.
    memory_only = NumaTopology({0: (10, 11, 21), 1: (11, 10, 21), 2: (21, 21, 10)}, {0: 0, 2: 1})
    assert memory_only.numa_list(0) == (0, 1) and memory_only.numa_list(2) == (2, 1)
    # No distances: the node alone.
    assert NumaTopology({}, {}).numa_list(5) == (5,)


def test_list_values_on_the_wire_and_back() -> None:
    value = IntList((1, 0))
    assert attribute_wire(value) == {"ints": [1, 0]} and attribute_from_wire({"ints": [1, 0]}) == value
    assert apirules.attribute_value_errors(value) == [] and apirules.attribute_value_errors(IntList(())) != []
    dev = Device("cpu-numa1", Kind.CPU, attributes={"type": "cpu", NUMA_NODE: value})
    assert apirules.device_wire_errors(dev.wire()) == []
    assert apirules.device_wire_errors({"name": "x", "attributes": {"a": {"ints": []}}}) != []
    # A slice holding a list attribute takes 64 devices at most, like one with taints or counters.
    many = [Device(f"d{i}", Kind.MEMORY, attributes={"type": "memory", NUMA_NODE: value}) for i in range(100)]
    sizes = [len(c) for c in slices.chunk_devices(many).slices]
    assert sizes == [64, 36]
    # Published where lists are not taken: the scalar form, the node itself, and 128 to a slice.
    scalar = slices.chunk_devices(many, layout=slices.SliceLayout(list_attributes=False)).slices
    assert [len(c) for c in scalar] == [100]
    assert scalar[0][0]["attributes"][NUMA_NODE] == {"int": 1}


@pytest.mark.parametrize(("mode", "declared", "lists"), [
    ("auto", (), False), ("auto", (LIST_ATTRIBUTES_FEATURE,), True), ("true", (), True),
    ("false", (LIST_ATTRIBUTES_FEATURE,), False)])
def test_the_form_follows_the_setting_and_the_nodes_declared_features(tmp_path: Path, mode: str,
                                                                       declared: tuple[str, ...], lists: bool) -> None:
    s = settings(build_topology(tmp_path / "sys"), numa_node_list=mode)
    node = NodeInfo(NODE, declared_features=frozenset(declared))
    assert numa_lists(s, node) is lists
    inventory = Inventory([CpuSource(s), MemorySource(s)], refine=PublishedForm(s))
    set_node_features(inventory, node, s)
    import asyncio

    asyncio.run(inventory.scan())
    got = {d.name: d.attributes[NUMA_NODE] for d in inventory.devices()}
    if lists:
        assert got["cpu-numa0"] == IntList((0, 1)) and got["memory-numa3"] == IntList((3, 2))
    else:
        assert got["cpu-numa0"] == 0 and got["memory-numa3"] == 3
    # Switched back (a Node that stops declaring it), the next scan publishes the scalar again.
    set_node_features(inventory, NodeInfo(NODE), settings(s.sysfs_root, numa_node_list="auto"))
    asyncio.run(inventory.scan())
    assert inventory.get("cpu-numa0").attributes[NUMA_NODE] == 0  # type: ignore[union-attr]


def test_kubevirt_cpu_devices_speak_kubevirts_names(tmp_path: Path) -> None:
    root = build_topology(tmp_path / "sys")
    plain = {d.name: d for d in CpuSource(settings(root)).scan().devices}
    kubevirt = {d.name: d for d in CpuSource(settings(root, kubevirt_cpu=True)).scan().devices}
    assert sorted(kubevirt) == [f"cpu-numa{n}" for n in range(4)]
    for name, dev in kubevirt.items():
        node = int(name.removeprefix("cpu-numa"))
        assert dev.attributes[KUBEVIRT_SOCKET] == dev.attributes["socket"] == (0 if node < 2 else 1)
        # One capacity counts the CPUs, in KubeVirt's name; shared by claims, whole CPUs at a time.
        assert dev.capacity == {KUBEVIRT_CPU_CAPACITY: Capacity("4", request_policy={
            "default": "1", "validRange": {"min": "1", "step": "1"}})}
        assert dev.allow_multiple_allocations and dev.node_allocatable is None
        assert apirules.device_wire_errors(dev.wire()) == []
        assert dev.node is not None and dev.node.cores == ((2 * node, 8 + 2 * node), (2 * node + 1, 9 + 2 * node))
        assert KUBEVIRT_SOCKET not in plain[name].attributes and plain[name].capacity == {"cpus": Capacity("4")}
    # On a Node with node-allocatable resources, the mapping names the capacity KubeVirt's claims take.
    source = CpuSource(settings(root, kubevirt_cpu=True))
    source.node_allocatable = True
    dev = source.scan().devices[0]
    assert dev.node_allocatable == {"cpu": {"mapping": {"capacityKey": KUBEVIRT_CPU_CAPACITY,
                                                        "capacityMultiplier": "1"}}}
    assert apirules.device_wire_errors(dev.wire()) == []


def test_no_socket_id_for_cpus_of_two_sockets(tmp_path: Path) -> None:
    # Without NUMA in the kernel the whole machine is one device: its CPUs are on both packages, and a
    # distinct socket per request could not be kept by a device that spans them.
    root = build_topology(tmp_path / "sys", numa=False)
    (dev,) = CpuSource(settings(root, kubevirt_cpu=True)).scan().devices
    assert dev.name == "cpu-numa0" and dev.capacity[KUBEVIRT_CPU_CAPACITY].value == "16"
    assert KUBEVIRT_SOCKET not in dev.attributes and dev.attributes["socket"] == 0

"""A node moving off a device plugin, on the real API server and scheduler, the agent as a process, and the
kubelet's pod resources service as a stand-in (tests/podresources.py) that lists the device-plugin devices of
pods: while the Node's allocatable shows `nvidia.com/gpu`, every GPU and every form of it is published with the
agent's `device-plugin` taint and no claim gets one; once it is 0, only the GPUs a device-plugin pod still has
stay tainted, a claim gets another, and the last is free once its pod is gone; a health taint on the same GPU
stays. The same through the real kubelet, with a device plugin registered there:
tests/cluster/test_cluster_kubelet.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from podresources import Pod, PodResourcesStandIn, socket_of

from .clusterkit import DRIVER, AgentRuns, Cluster, eventually
from .workloads import Namespace, NodeAgent, claim_spec, published, request, results_of

pytestmark = pytest.mark.cluster

NODE = "dra-device-plugin"
NODES = itertools.count(1)
HOLD = f"{DRIVER}/device-plugin"
XID = f"{DRIVER}/xid"
BUS = "resource.kubernetes.io/pciBusID"


def set_extended(cluster: Cluster, node: str, count: str) -> None:
    """The Node's status as the kubelet writes it while a device plugin serves `count` GPUs (0: it stopped)."""
    cluster.admin.merge_patch(f"/api/v1/nodes/{node}/status", {"status": {
        "capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": count}}})


def gpu_buses(devices: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Whole GPU name -> its PCI address (every form of it has the same)."""
    return {name: d["attributes"][BUS]["string"] for name, d in devices.items()
            if d["attributes"].get("type", {}).get("string") == "gpu"}


def hold_of(device: dict[str, Any]) -> str | None:
    """The device-plugin taint's value on a published device, or None."""
    return next((t.get("value", "") for t in device.get("taints") or [] if t["key"] == HOLD), None)


def held(agent: NodeAgent) -> dict[str, str]:
    """Published device -> why it is held, for each held one."""
    return {name: why for name, d in published(agent).items() if (why := hold_of(d)) is not None}


def forms_of(devices: dict[str, dict[str, Any]], bus: str) -> set[str]:
    return {name for name, d in devices.items() if d["attributes"].get(BUS, {}).get("string") == bus}


@pytest.fixture
def moving(cluster: Cluster, cluster_root: Path) -> Iterator[NodeAgent]:
    """A node (of the test's own) whose kubelet runs a device plugin serving 8 GPUs, and a pod of it that has the
    GPU of NVML index 3 (the device plugin's `index` IDs), before the agent starts there."""
    node = f"{NODE}-{next(NODES)}"
    cluster.add_node(node)
    set_extended(cluster, node, "8")
    base = cluster_root / "device-plugin"
    running = NodeAgent(cluster, node, base / node, (), AgentRuns(base))
    running.kubeconfig = cluster.agent_kubeconfig(node)
    running.kubelet = PodResourcesStandIn(socket_of(running.root / "kubelet")).start()
    running.kubelet.pods = [Pod("legacy", "trainer", plugin_devices=(("nvidia.com/gpu", ("3",)),))]
    try:
        yield running
    finally:
        running.stop()
        running.kubelet.stop()
        cluster.admin.delete(f"/api/v1/nodes/{node}")


def test_a_node_moves_off_its_device_plugin_and_no_gpu_is_given_out_twice(moving: NodeAgent,
                                                                          ns: Namespace) -> None:
    agent = moving
    agent.start()
    devices = published(agent)
    buses = gpu_buses(devices)
    gpu_forms = {name for bus in buses.values() for name in forms_of(devices, bus)}
    assert len(buses) == 8 and len(gpu_forms) > 8  # the dgx-h100: MIG placements, passthrough twins
    # The first slices already hold every GPU and every form of it, and nothing else.
    assert held(agent) == {name: "serving" for name in gpu_forms}
    assert agent.proc is not None and agent.proc.metric("dra_agent_device_plugin_held_gpus") == 8
    # `doctor` says which and why, and what to do.
    report = agent.cli("doctor", check=False).stdout
    assert "8 GPUs held, published with taint dra.example.com/device-plugin (NoSchedule): a device plugin serves " \
           "nvidia.com/gpu (allocatable 8) on this node" in report, report

    ns.claim("one-gpu", claim_spec(request("gpu", "gpu")))
    ns.pod("wants-a-gpu", agent.node, claims={"gpu": "one-gpu"})
    ns.unschedulable("wants-a-gpu")

    # The device plugin stops: allocatable 0. GPU index 3 stays held for the pod that has it; a claim gets another.
    (trainer_gpu,) = (name for name, d in devices.items() if name in buses
                      and d["attributes"]["index"]["int"] == 3)
    trainer_forms = forms_of(devices, buses[trainer_gpu])
    agent.cli("sim", "xid", trainer_gpu, "48")  # a health taint on the same GPU, which no hold may take away
    set_extended(agent.cluster, agent.node, "0")
    eventually(lambda: held(agent) == {name: "in-use" for name in trainer_forms},
               "only the GPU the device plugin's pod has, and its forms, held")
    ns.scheduled("wants-a-gpu")
    (result,) = results_of(ns.claims_of("wants-a-gpu")["gpu"])
    assert result["device"] in buses and result["device"] != trainer_gpu

    # Its pod ends: the GPU is free of the hold, and keeps its XID taint.
    assert agent.kubelet is not None
    agent.kubelet.pods = []
    eventually(lambda: held(agent) == {}, "no GPU held once the device plugin's pod is gone")
    assert XID in {t["key"] for t in published(agent)[trainer_gpu].get("taints") or []}
    # Each change said on the Node, where `kubectl describe node` shows it.
    reasons = {e["reason"] for e in agent.cluster.admin.get("/apis/events.k8s.io/v1/namespaces/default/events")[
        "items"] if e["regarding"].get("name") == agent.node}
    assert {"DevicePluginHoldsGpus", "GpusReleasedByDevicePlugin"} <= reasons


def test_a_device_plugin_coming_back_holds_every_gpu_again_and_a_restart_keeps_the_holds(
        moving: NodeAgent) -> None:
    agent = moving
    assert agent.kubelet is not None
    agent.kubelet.pods = []
    set_extended(agent.cluster, agent.node, "0")
    agent.start()
    assert held(agent) == {}
    set_extended(agent.cluster, agent.node, "8")
    eventually(lambda: set(held(agent).values()) == {"serving"} and len(held(agent)) > 8,
               "every GPU held again while the device plugin serves")
    # Restarted mid-way, with a device-plugin pod on a GPU by its UUID: what the first slices say is right.
    devices = published(agent)
    gpu = "gpu-5"
    uuid = devices[gpu]["attributes"]["uuid"]["string"]
    agent.kubelet.pods = [Pod("legacy", "inference", plugin_devices=(("nvidia.com/gpu", (f"{uuid}::1",)),))]
    agent.stop()
    set_extended(agent.cluster, agent.node, "0")
    agent.start()
    forms = forms_of(devices, devices[gpu]["attributes"][BUS]["string"])
    assert held(agent) == {name: "in-use" for name in forms}

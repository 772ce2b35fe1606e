"""Binding conditions with the real scheduler (`--binding-conditions vfio`, DRADeviceBindingConditions).

The agent publishes its passthrough devices with `bindingConditions: [HostPrepared]` and
`bindingFailureConditions: [HostPrepareFailed]`. kube-scheduler allocates a pod's claim for one, reserves it
and then waits in PreBind: the pod stays unbound (no `spec.nodeName`) while no agent has prepared the claim,
and is bound once the agent, watching the claims, has bound the GPU to vfio-pci and said HostPrepared in the
claim's status; the kubelet's NodePrepareResources is then answered from that prepare. A GPU the agent
cannot take from the host (a process of the simulated machine holds it open) gets HostPrepareFailed: the
scheduler fails that binding, deallocates the claim and allocates again, and never binds the pod to the
node while the GPU stays held; once it is let go, the next allocation is prepared and the pod bound."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.bindingconditions import BINDING_CONDITION, BINDING_FAILURE_CONDITION

from .clusterkit import DRIVER, Cluster, eventually
from .workloads import (
    BUS,
    Namespace,
    NodeAgent,
    allocated,
    claim_spec,
    node_agent,
    our_status,
    prepared,
    published,
    request,
    results_of,
)

pytestmark = pytest.mark.cluster

BINDING_NODE = "dra-binding"
SECOND_NODE = "dra-binding-b"
GPU_BUS = "0000:18:00.0"  # gpu-0 of dgx-h100, minor 0
VARIANT = "gpu-0000-18-00-0-vfio"


@pytest.fixture(scope="module")
def binding_agent(cluster: Cluster, cluster_root: Path) -> Iterator[NodeAgent]:
    with node_agent(cluster, BINDING_NODE, cluster_root / "binding", "--binding-conditions=vfio",
                    "--gc-grace-period=1") as running:
        yield running


@pytest.fixture
def agent(binding_agent: NodeAgent) -> Iterator[NodeAgent]:
    if binding_agent.proc is None:
        binding_agent.start()
    yield binding_agent
    if binding_agent.proc is None:
        binding_agent.start()
    eventually(lambda: not binding_agent.prepared(), "the agent unprepares what the test left")


@pytest.fixture(scope="module")
def second_agent(cluster: Cluster, cluster_root: Path) -> Iterator[NodeAgent]:
    with node_agent(cluster, SECOND_NODE, cluster_root / "binding", "--binding-conditions=vfio",
                    "--gc-grace-period=1") as running:
        yield running


def hold_gpu(agent: NodeAgent) -> Path:
    """A process of the agent's simulated machine (its /proc) with the GPU open: it cannot leave the NVIDIA
    driver. Remove the returned directory to let it go."""
    holder = agent.state / "nvml-sim" / "proc" / "4343"
    (holder / "fd").mkdir(parents=True)
    (holder / "comm").write_text("python3\n")
    (holder / "fd" / "7").symlink_to("/dev/nvidia0")
    return holder


def conditions(claim: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The conditions of our status entry for the GPU's passthrough variant, by type."""
    return {c["type"]: c for e in our_status(claim) if e["device"] == VARIANT for c in e.get("conditions") or []}


def is_true(claim: dict[str, Any], kind: str) -> bool:
    return conditions(claim).get(kind, {}).get("status") == "True"


def sim_driver(agent: NodeAgent) -> str:
    """The driver the simulated machine's GPU is bound to now."""
    link = agent.state / "nvml-sim" / "sys" / "bus" / "pci" / "devices" / GPU_BUS / "driver"
    return Path(link).resolve().name


def vm_pod(ns: Namespace, name: str) -> None:
    ns.claim(name, claim_spec(request("vm", "gpu-passthrough", selectors=[f"{BUS} == '{GPU_BUS}'"])))
    ns.pod(name, BINDING_NODE, claims={"vm": name})


def test_the_pod_is_bound_only_once_the_agent_has_prepared_its_passthrough_gpu(agent: NodeAgent,
                                                                                ns: Namespace) -> None:
    device = published(agent)[VARIANT]
    assert device["bindingConditions"] == [BINDING_CONDITION]
    assert device["bindingFailureConditions"] == [BINDING_FAILURE_CONDITION]
    assert "bindingConditions" not in published(agent)["gpu-0"]

    # No agent on the node: the scheduler allocates and reserves the claim, then waits for the condition.
    agent.stop()
    vm_pod(ns, "vm")
    eventually(lambda: any(e["reason"] == "BindingConditionsPending" for e in ns.events_of("vm")),
               "the scheduler waits for the binding conditions")
    claim = ns.get("resourceclaims", "vm")
    assert [r["device"] for r in results_of(claim)] == [VARIANT]
    (result,) = results_of(claim)
    assert result["bindingConditions"] == [BINDING_CONDITION]
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["vm"]
    assert not ns.get("pods", "vm")["spec"].get("nodeName")
    assert not is_true(claim, BINDING_CONDITION)

    # The agent comes: it sees the claim, binds the GPU to vfio-pci, says so; then the pod is bound.
    agent.start()
    pod = ns.scheduled("vm")
    assert pod["spec"]["nodeName"] == BINDING_NODE
    claim = ns.get("resourceclaims", "vm")
    assert is_true(claim, BINDING_CONDITION) and is_true(claim, "Ready")
    assert sim_driver(agent) == "vfio-pci"
    assert claim["metadata"]["uid"] in agent.prepared()

    # The kubelet's prepare once the pod is bound: the devices the scheduler allocated, from the record.
    answer = agent.prepare(claim)[claim["metadata"]["uid"]]
    assert prepared(answer) == allocated(claim)
    assert agent.unprepare(claim)[claim["metadata"]["uid"]].get("error", "") == ""
    assert sim_driver(agent) == "nvidia"


def test_a_failed_prepare_makes_the_scheduler_give_the_allocation_up(agent: NodeAgent, ns: Namespace) -> None:
    holder = hold_gpu(agent)
    try:
        vm_pod(ns, "busy")
        seen = {"failed": 0, "deallocated": 0}

        def probe() -> bool:
            assert not ns.get("pods", "busy")["spec"].get("nodeName"), "bound although the GPU is held"
            claim = ns.get("resourceclaims", "busy")
            if is_true(claim, BINDING_FAILURE_CONDITION):
                failed = conditions(claim)[BINDING_FAILURE_CONDITION]
                assert failed["reason"] == "PrepareFailed" and f"GPU {GPU_BUS} is in use on the host" in \
                    failed["message"], failed
                seen["failed"] += seen["failed"] == seen["deallocated"]
            elif not results_of(claim) and seen["failed"] > seen["deallocated"]:
                seen["deallocated"] += 1
            # The failure said, the claim given up, allocated again and failed again: the scheduler retries.
            return seen["failed"] >= 2 and seen["deallocated"] >= 1

        # Each try costs a PreBind poll (5 s) and the scheduler's backoff (up to 10 s): a bound, not a duration.
        eventually(probe, "the scheduler gives a failed allocation up and tries again", limit=180, interval=0.05)
        assert any(e["reason"] == "FailedScheduling" and "binding failed" in e["message"]
                   for e in ns.events_of("busy")), ns.events_of("busy")
        assert sim_driver(agent) == "nvidia" and not agent.prepared()
    finally:
        shutil.rmtree(holder)

    # The GPU let go of: the next allocation is prepared, and the pod bound.
    assert eventually(lambda: ns.get("pods", "busy")["spec"].get("nodeName"), "the pod bound", limit=180) == \
        BINDING_NODE
    assert is_true(ns.get("resourceclaims", "busy"), BINDING_CONDITION) and sim_driver(agent) == "vfio-pci"
    assert DRIVER in {r["driver"] for r in results_of(ns.get("resourceclaims", "busy"))}


def test_a_failed_prepare_sends_the_pod_to_another_node(agent: NodeAgent, second_agent: NodeAgent,
                                                        ns: Namespace) -> None:
    """Two nodes may take the pod, and at first each has its GPU held. Once the first node's agent has been
    allocated the claim and reported its failure, the second node's GPU is let go of: the pod is never bound
    to the first node and ends up bound to the second."""
    holder, second_holder = hold_gpu(agent), hold_gpu(second_agent)
    try:
        ns.claim("either", claim_spec(request("vm", "gpu-passthrough", selectors=[f"{BUS} == '{GPU_BUS}'"])))
        ns.cluster.admin.post(ns.path("pods"), {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "either"},
            "spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{
                    "key": "kubernetes.io/hostname", "operator": "In", "values": [BINDING_NODE, SECOND_NODE]}]}]}}},
                "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0,
                "resourceClaims": [{"name": "vm", "resourceClaimName": "either"}],
                "containers": [{"name": "work", "image": "registry.example/work:1",
                                "resources": {"claims": [{"name": "vm"}]}}]}})

        def unbound() -> None:
            assert not ns.get("pods", "either")["spec"].get("nodeName"), "bound although every GPU is held"

        def failed_on_first() -> bool:
            unbound()
            claim = ns.get("resourceclaims", "either")
            return {r["pool"] for r in results_of(claim)} == {BINDING_NODE} and \
                is_true(claim, BINDING_FAILURE_CONDITION)

        # The scheduler picks among equal nodes at random: each try costs a PreBind poll (5 s) and its backoff.
        # A bound well beyond what a few unlucky draws take, never an expected duration.
        eventually(failed_on_first, "the first node's agent reports its failure", limit=300, interval=0.05)
        shutil.rmtree(second_holder)

        def bound() -> str:
            node = str(ns.get("pods", "either")["spec"].get("nodeName") or "")
            assert node != BINDING_NODE, "bound to the node whose GPU is held"
            return node

        assert eventually(bound, "the pod bound to the second node", limit=120) == SECOND_NODE
        claim = ns.get("resourceclaims", "either")
        assert {r["pool"] for r in results_of(claim)} == {SECOND_NODE}
        assert is_true(claim, BINDING_CONDITION) and sim_driver(second_agent) == "vfio-pci"
        assert sim_driver(agent) == "nvidia" and not agent.prepared()
    finally:
        shutil.rmtree(holder)
        shutil.rmtree(second_holder, ignore_errors=True)
    ns.clean()
    eventually(lambda: not second_agent.prepared(), "the second agent unprepares the deleted claim")

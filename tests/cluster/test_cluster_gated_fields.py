"""The gated 1.37 additions against real API servers: a pool whose MIG and vGPU slices name their partition
type (`--partition-type-attribute`), whose memory slices skip node operations (`--skip-node-operations`,
a Node declaring DRAOptionalNodeOperations) and whose numaNode is a list (`--numa-node-list`); what the
real scheduler and the ResourcePoolStatusRequest controller make of it, and `dra-agent pool status`
showing it beside the node's own view; a shared GPU's compute in fractions. Then the same agent against
an API server with those gates off (a second, small control plane): it publishes without the fields
(compute in whole percentages), says so once each, never rewrites a slice for them, and
`dra-agent pool status` says the API is not served."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from topology import build_topology

from agent.sim.profiles import BUILTIN

from .clusterkit import DRIVER, VENV_BIN, AgentProcess, AgentRuns, ApiFailure, Cluster, devices_of, slices_of
from .controlplane import RUNTIME_CONFIG, start_plane
from .pki import Pki
from .podclaims import allocated, by_request, create_claim, namespace, pod_using, request

pytestmark = pytest.mark.cluster

NUMA = "resource.kubernetes.io/numaNode"
PARTITION_ATTRIBUTE = f"{DRIVER}/partitionType"
SKIP = ["NodePrepareResources", "NodeUnprepareResources"]
OPTIONAL_OPERATIONS = "DRAOptionalNodeOperations"
GATES_OFF = {"DRAListTypeAttributes": False, "DRAPartitionableDevicesType": False, "DRAResourcePoolStatus": False,
             "DRAOptionalNodeOperations": False, "DRAFractionalCapacityRange": False}
FRACTIONS = {"value": "1",
             "requestPolicy": {"default": "100m", "validRange": {"min": "50m", "max": "1", "step": "50m"}}}
PERCENT = {"value": "100", "requestPolicy": {"default": "10", "validRange": {"min": "5", "max": "100", "step": "5"}}}
# Without resource.k8s.io/v1alpha3 (off by default in 1.37): ResourcePoolStatusRequests are not served. (With
# v1alpha3 on they are served even with DRAResourcePoolStatus off, and no controller answers them.)
WITHOUT_V1ALPHA3 = ",".join(p for p in RUNTIME_CONFIG.split(",") if "v1alpha3" not in p)


def flags(base: Path) -> tuple[str, ...]:
    """One H100 (MIG placements and every vGPU type: few enough partition types for one summary), a
    sysfs tree of two sockets for CPUs and memory, every gated field asked for."""
    profile = dict(BUILTIN["dgx-h100"])
    profile["gpus"] = profile["gpus"][:1]
    path = base / "one-gpu.json"
    if not path.exists():
        path.write_text(json.dumps(profile))
        build_topology(base / "sys")
    return (f"--nvml=sim:{path}", f"--sysfs-root={base / 'sys'}", "--nic-exclude=*", "--dynamic-mig=true",
            "--vgpu-types=auto", "--compatibility-groups=true", "--partition-type-attribute=true",
            "--skip-node-operations=memory", "--numa-node-list=true", "--gpu-sharing=true")


def writes(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("dra_agent_slice_writes_total") and v}


def pool_status(agent: AgentProcess, kubeconfig: Path, node: str, base: Path) -> tuple[int, dict[str, Any], str]:
    """`dra-agent pool status -o json` with the agent's settings and credentials (the agent stopped: its
    discovery and the command's would share the simulated machine)."""
    root = agent.root
    nvml, *rest = flags(base)
    done = subprocess.run([str(VENV_BIN / "dra-agent"), "pool", "status", "-o", "json", f"--kubeconfig={kubeconfig}",
                           f"--node-name={node}", nvml, *rest, f"--state-dir={root / 'state'}",
                           f"--kubelet-dir={root / 'kubelet'}", f"--cdi-dir={root / 'cdi'}", "--timeout=60"],
                          capture_output=True, text=True, timeout=180, check=False)
    return done.returncode, json.loads(done.stdout), done.stderr


def summary(status: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {p["type"]: (p["allocatable"], p["total"]) for p in status.get("partitionSummary") or []}


def test_gated_fields_are_kept_and_summarised(cluster: Cluster, agent_runs: AgentRuns) -> None:
    node = "dra-gated"
    cluster.add_node(node, declared=[OPTIONAL_OPERATIONS])
    kubeconfig = cluster.agent_kubeconfig(node)
    base = agent_runs.base
    with agent_runs.run(node, kubeconfig, *flags(base), node=node) as agent:
        agent.wait_published()
        metrics = agent.metrics()
        assert agent.messages("error") == [] and metrics.get('dra_agent_publish_syncs_total{result="failure"}', 0) == 0
        assert not [w for w in agent.messages("warning") if "dropped" in w or "refused" in w]
    stored = slices_of(cluster.admin, node)
    said = {d["name"]: o["spec"] for o in stored for d in o["spec"].get("devices") or []}
    devices = devices_of(stored)
    kinds = {n: d["attributes"]["type"]["string"] for n, d in devices.items()}
    for name, spec in said.items():
        assert (spec.get("partitionTypeAttribute") == PARTITION_ATTRIBUTE) == (kinds[name] in ("mig", "vgpu")), name
        assert (spec.get("skipNodeOperations") == SKIP) == (kinds[name] == "memory"), name
    assert devices["cpu-numa0"]["attributes"][NUMA] == {"ints": [0, 1]}
    assert devices["gpu-0"]["attributes"][NUMA] == {"ints": [0, 1]}
    # A shared GPU's compute in fractions of it, kept as sent (DRAFractionalCapacityRange).
    assert devices["gpu-0-shared"]["capacity"]["compute"] == FRACTIONS
    with agent_runs.run(node, kubeconfig, *flags(base), node=node) as again:
        again.wait_published()
        assert writes(again.metrics()) == {}  # nothing the server dropped, nothing rewritten

    # A memory claim's allocation carries the slice's skipNodeOperations: the kubelet makes no call for it.
    ns = namespace(cluster, "gated-fields")
    create_claim(cluster, ns, "memory", [request("mem", f"memory.{DRIVER}")])
    pod_using(cluster, ns, "memory-pod", "memory", node)
    (mem,) = allocated(cluster, ns, "memory")
    assert mem["device"].startswith("memory-numa") and mem["skipNodeOperations"] == SKIP

    # The cluster's view through the ResourcePoolStatusRequest controller, beside the node's.
    code, out, err = pool_status(again, kubeconfig, node, base)
    assert code == 0, (out, err)
    status, mine = out["cluster"], out["node"]
    assert status["totalDevices"] == len(devices) == mine["devices"] and status["allocatedDevices"] == 1
    assert mine["prepared"] == [] and status["resourceSliceCount"] == len(stored)
    before = summary(status)
    assert before["gpu-0 1g.10gb@0"] == (1, 1) and before["gpu-0 7g.80gb@0"] == (1, 1)
    assert before["gpu-0 GRID H100-8C"][1] > 1  # the instances of one vGPU type are one type
    assert {p["attribute"] for p in status["partitionSummary"]} == {PARTITION_ATTRIBUTE}

    # The whole GPU's MIG instance takes every memory slice: no partition of the GPU fits any more.
    create_claim(cluster, ns, "mig", [request("mig", f"mig.{DRIVER}",
                                              selectors=(f"device.attributes['{DRIVER}'].profile == '7g.80gb'",))])
    pod_using(cluster, ns, "mig-pod", "mig", node)
    assert by_request(allocated(cluster, ns, "mig"))["mig"]["device"] == "gpu-0-mig-7g80gb-0"
    code, out, err = pool_status(again, kubeconfig, node, base)
    assert code == 0, (out, err)
    after = summary(out["cluster"])
    assert out["cluster"]["allocatedDevices"] == 2 and set(after) == set(before)
    assert all(allocatable == 0 for allocatable, _ in after.values()), after


def test_the_agent_may_ask_only_for_its_own_pool(cluster: Cluster) -> None:
    node = "dra-pool-asker"
    cluster.add_node(node)
    rest = cluster.rest(cluster.token(pod=cluster.pod_on(node, f"dra-agent-{node}")))
    path = "/apis/resource.k8s.io/v1alpha3/resourcepoolstatusrequests"
    try:
        body = {"apiVersion": "resource.k8s.io/v1alpha3", "kind": "ResourcePoolStatusRequest",
                "metadata": {"generateName": "probe-"}, "spec": {"driver": DRIVER, "poolName": "dra-node-2"}}
        with pytest.raises(ApiFailure) as refused:
            rest.post(path, body)
        assert refused.value.status == 403 and "dra-agent-resourcepoolstatusrequests" in refused.value.message
        own = rest.post(path, {**body, "spec": {"driver": DRIVER, "poolName": node}})
        rest.delete(f"{path}/{own['metadata']['name']}")
    finally:
        rest.close()


@pytest.fixture(scope="module")
def gates_off(components: Path, cluster_root: Path, pki: Pki) -> Iterator[Cluster]:
    plane = start_plane(components, cluster_root / "gated-off", pki, gates=GATES_OFF, full=False,
                        runtime_config=WITHOUT_V1ALPHA3)
    c = Cluster(plane, cluster_root / "gated-off")
    try:
        yield c
    finally:
        c.close()
        plane.stop()
        shutil.rmtree(plane.root, ignore_errors=True)


def test_without_the_gates_the_fields_are_left_out_once(gates_off: Cluster, agent_runs: AgentRuns) -> None:
    node = "dra-gated-off"
    gates_off.add_node(node, declared=[OPTIONAL_OPERATIONS])
    kubeconfig = gates_off.plane.admin_kubeconfig
    assert kubeconfig is not None
    base = agent_runs.base
    with agent_runs.run(node, kubeconfig, *flags(base), node=node) as agent:
        agent.wait_published()
        metrics = agent.metrics()
        warnings = agent.messages("warning")
    assert metrics.get('dra_agent_publish_syncs_total{result="failure"}', 0) == 0
    stored = slices_of(gates_off.admin, node)
    assert not any("partitionTypeAttribute" in s["spec"] or "skipNodeOperations" in s["spec"] for s in stored)
    devices = devices_of(stored)
    assert devices["cpu-numa2"]["attributes"][NUMA] == {"int": 2} and devices["gpu-0"]["attributes"][NUMA] == {"int": 0}
    # This server would read 0.05 to 1 as 1 to 1: the same policy in whole percentages instead.
    capacity = devices["gpu-0-shared"]["capacity"]
    assert "compute" not in capacity and capacity["computePercent"] == PERCENT
    for field, gate in (("whole units", "DRAFractionalCapacityRange"), ("list values", "DRAListTypeAttributes"),
                        ("partitionTypeAttribute", "DRAPartitionableDevicesType"),
                        ("skipNodeOperations", "DRAOptionalNodeOperations")):
        said = [w for w in warnings if field in w]
        assert len(said) == 1 and gate in said[0], (field, warnings)
    before = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in stored}
    with agent_runs.run(node, kubeconfig, *flags(base), node=node) as again:
        again.wait_published()
        assert writes(again.metrics()) == {}
    assert {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(gates_off.admin, node)} == before

    code, out, err = pool_status(again, kubeconfig, node, base)
    assert code == 1 and out["cluster"] is None, (out, err)
    assert "does not serve ResourcePoolStatusRequests" in out["clusterError"]
    assert out["node"]["devices"] == len(devices)

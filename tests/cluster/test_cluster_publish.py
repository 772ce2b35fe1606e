"""`dra-agent run` publishing to the real API server, as the DaemonSet's pod does: its own
ServiceAccount, a token bound to a pod on its node, the shipped RBAC and admission policy.

Every form the agent publishes is on (MIG placements, passthrough variants, every vGPU type, shared
GPUs, compatibility groups, CPU and memory as node-allocatable resources on a Node that declares
them) for both simulated machines, with this host's NICs. The server must take every write and
store exactly what was sent; a restart must find the pool current and write nothing."""

from __future__ import annotations

import collections
import subprocess
from typing import Any

import pytest

from .clusterkit import NODE_ALLOCATABLE, VENV_BIN, AgentRuns, Cluster, devices_of, eventually, slices_of

pytestmark = pytest.mark.cluster

# The published `type` of each kind in the pool's order (`slices.KIND_ORDER`).
WALK_ORDER = ["cpu", "memory", "gpu", "vfio", "shared", "nic", "vgpu", "mig"]  # agent.publish.slices.KIND_ORDER
EVERY_FORM = ("--dynamic-mig=true", "--vgpu-types=auto", "--gpu-sharing=true", "--compatibility-groups=true")


def snapshot(slices: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    """Each slice's resourceVersion and pool generation, by name."""
    return {s["metadata"]["name"]: (s["metadata"]["resourceVersion"], s["spec"]["pool"]["generation"])
            for s in slices}


def writes(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("dra_agent_slice_writes_total") and v}


@pytest.mark.parametrize("profile", ["dgx-h100", "hgx-16"])
def test_every_form_is_accepted_and_a_restart_writes_nothing(cluster: Cluster, agent_runs: AgentRuns,
                                                              profile: str) -> None:
    node = f"dra-{profile}"
    cluster.add_node(node, declared=[NODE_ALLOCATABLE])
    kubeconfig = cluster.agent_kubeconfig(node)

    with agent_runs.run(node, kubeconfig, *EVERY_FORM, node=node, nvml=f"sim:{profile}") as agent:
        agent.wait_published()
        metrics = agent.metrics()
        errors = agent.messages("error")
    assert metrics.get('dra_agent_publish_syncs_total{result="failure"}', 0) == 0, errors
    assert metrics['dra_agent_publish_syncs_total{result="success"}'] >= 1
    assert metrics["dra_agent_publish_dropped_values"] == 0
    assert errors == []

    stored = slices_of(cluster.admin, node)
    assert len(stored) == metrics["dra_agent_published_slices"]
    assert len({s["spec"]["pool"]["generation"] for s in stored}) == 1
    assert all(s["spec"]["pool"]["resourceSliceCount"] == len(stored) for s in stored)
    devices = devices_of(stored)
    assert len(devices) == metrics["dra_agent_published_devices"]
    kinds = collections.Counter(d["attributes"]["type"]["string"] for d in devices.values())
    gpus = 8 if profile == "dgx-h100" else 16
    assert kinds["gpu"] == gpus and kinds["shared"] == gpus and kinds["mig"] > 0 and kinds["vgpu"] > 0
    assert kinds["vfio"] >= gpus and kinds["cpu"] >= 1 and kinds["memory"] >= 1 and kinds["nic"] >= 1
    # What only the gates on this cluster keep: the server stored them as sent.
    groups = {g for d in devices.values() for c in d.get("consumesCounters") or []
              for g in c.get("compatibilityGroups") or []}
    assert "mig" in groups and any(g.startswith("vgpu-") for g in groups)
    assert devices["cpu-numa0"]["nodeAllocatableResources"]["cpu"]["mapping"]["capacityKey"]
    assert devices["gpu-0"]["nodeAllocatableResources"]["memory"]["overhead"]["perContainer"]
    assert devices["gpu-0-shared"]["allowMultipleAllocations"] is True
    # As the scheduler's allocator walks the pool (slices by name, devices in order): the forms asked for
    # most first, the partitions last, whatever the names' random characters.
    walked = [d["attributes"]["type"]["string"] for s in sorted(stored, key=lambda s: s["metadata"]["name"])
              for d in s["spec"].get("devices") or []]
    assert walked == sorted(walked, key=WALK_ORDER.index)
    before = snapshot(stored)

    with agent_runs.run(node, kubeconfig, *EVERY_FORM, node=node, nvml=f"sim:{profile}") as agent:
        agent.wait_published()
        again = agent.metrics()
    # Nothing rewritten, no new generation, no copy of a slice.
    assert writes(again) == {}
    assert snapshot(slices_of(cluster.admin, node)) == before


def test_a_taint_is_written_once_and_its_time_kept(cluster: Cluster, agent_runs: AgentRuns) -> None:
    # The API server stamps a taint's timeAdded; the agent keeps the server's stamp instead of sending
    # the taint again without it at every sync, and a restart finds nothing to write.
    node = "dra-taints"
    cluster.add_node(node)
    kubeconfig = cluster.agent_kubeconfig(node)
    with agent_runs.run(node, kubeconfig, node=node) as agent:
        agent.wait_published()
        done = subprocess.run([str(VENV_BIN / "dra-agent"), "sim", "xid", "gpu-2", "79", f"--node-name={node}",
                               "--nvml=sim:dgx-h100", f"--state-dir={agent.root / 'state'}"],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr

        def tainted() -> list[dict[str, Any]]:
            return devices_of(slices_of(cluster.admin, node))["gpu-2"].get("taints") or []

        (taint,) = eventually(tainted, "the XID taint on gpu-2")
        assert taint["effect"] == "NoExecute" and taint["timeAdded"]  # XID 79: off the bus
        agent.wait_published()
        before = snapshot(slices_of(cluster.admin, node))
    with agent_runs.run(node, kubeconfig, node=node) as agent:
        agent.wait_published()
        assert writes(agent.metrics()) == {}
    assert snapshot(slices_of(cluster.admin, node)) == before
    assert tainted() == [taint]

"""One claim, a GPU, a NIC and CPUs on one NUMA node, against the real scheduler: a `matchAttribute`
constraint over the standard `resource.kubernetes.io/numaNode` every device of the agent carries.

The machine: a sysfs tree of two sockets with two NUMA nodes each (distances 10, 11 within a socket, 21
across) for CPUs, and a simulated one with three GPUs, on nodes 0, 1 and 2, and a NIC with SR-IOV VFs on
node 1. With the scalar attribute (any cluster) the claim gets the one GPU on the NIC's node; with the list
form (`DRAListTypeAttributes`, published where the Node declares it) "one NUMA node" widens to the nearest
nodes of one socket, so a GPU on node 0 goes with the NIC on node 1, and never the GPU across the sockets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from topology import build_topology

from agent.sim.profiles import BUILTIN

from .clusterkit import DRIVER, AgentRuns, Cluster, devices_of, slices_of
from .podclaims import allocated, by_request, create_claim, namespace, pod_using, request, unschedulable

pytestmark = pytest.mark.cluster

NUMA = "resource.kubernetes.io/numaNode"
LIST_FEATURE = "DRAListTypeAttributes"


def machine(directory: Path) -> str:
    """Three H100s on NUMA nodes 0, 1 and 2, and the ConnectX-7 with its VFs on node 1."""
    profile = dict(BUILTIN["dgx-h100"])
    profile["gpus"] = [{"busId": f"0000:{bus}:00.0", "numaNode": n} for bus, n in (("18", 0), ("2a", 1), ("3a", 2))]
    profile["nics"] = [{**BUILTIN["dgx-h100"]["nics"][0], "numaNode": 1}]
    path = directory / "three-gpus.json"
    path.write_text(json.dumps(profile))
    return f"sim:{path}"


def aligned_claim(cluster: Cluster, ns: str, name: str, node: str, *, gpu_selectors: tuple[str, ...] = ()) -> str:
    requests = [request("gpu", f"gpu.{DRIVER}", selectors=gpu_selectors),
                request("nic", f"nic-passthrough.{DRIVER}"),
                request("cpu", f"cpu.{DRIVER}")]
    create_claim(cluster, ns, name, requests, [{"requests": ["gpu", "nic", "cpu"], "matchAttribute": NUMA}])
    pod_using(cluster, ns, f"{name}-pod", name, node)
    return name


def run_agent(cluster: Cluster, agent_runs: AgentRuns, node: str, declared: tuple[str, ...]) -> Any:
    cluster.add_node(node, declared=declared)
    sysfs = build_topology(agent_runs.base / f"{node}-sys", sockets=(0, 0, 1, 1))
    # (This host's NICs are not in the tree: they go unpublished. The simulated NIC's VFs are published.)
    return agent_runs.run(node, cluster.agent_kubeconfig(node), f"--sysfs-root={sysfs}", "--dynamic-mig=false",
                          node=node, nvml=machine(agent_runs.base))


def numa_of(device: dict[str, Any]) -> Any:
    return next(iter(device["attributes"][NUMA].values()))


def test_gpu_nic_and_cpus_on_the_nics_numa_node(cluster: Cluster, agent_runs: AgentRuns) -> None:
    node = "dra-numa-scalar"
    with run_agent(cluster, agent_runs, node, ()) as agent:
        agent.wait_published()
        devices = devices_of(slices_of(cluster.admin, node))
        assert {n: numa_of(d) for n, d in devices.items() if n.startswith(("gpu-0", "gpu-1", "gpu-2", "cpu-"))
                and "vfio" not in n} == {"gpu-0": 0, "gpu-1": 1, "gpu-2": 2, "cpu-numa0": 0, "cpu-numa1": 1,
                                         "cpu-numa2": 2, "cpu-numa3": 3}
        ns = namespace(cluster, "numa-scalar")
        results = by_request(allocated(cluster, ns, aligned_claim(cluster, ns, "aligned", node)))
        assert results["gpu"]["device"] == "gpu-1" and results["cpu"]["device"] == "cpu-numa1"
        assert results["nic"]["device"].startswith("nic-0000-4b-00-")
        assert numa_of(devices[results["nic"]["device"]]) == 1
        # The GPU on node 0 has no NIC on its node: a claim that wants that GPU cannot be allocated.
        aligned_claim(cluster, ns, "gpu0", node, gpu_selectors=(f"device.attributes['{DRIVER}'].index == 0",))
        assert unschedulable(cluster, ns, "gpu0-pod")


def test_the_list_form_aligns_within_a_socket_where_the_node_declares_it(cluster: Cluster,
                                                                          agent_runs: AgentRuns) -> None:
    node = "dra-numa-list"
    with run_agent(cluster, agent_runs, node, (LIST_FEATURE,)) as agent:
        agent.wait_published()
        devices = devices_of(slices_of(cluster.admin, node))
        assert numa_of(devices["gpu-0"]) == [0, 1] and numa_of(devices["gpu-2"]) == [2, 3]
        assert numa_of(devices["cpu-numa1"]) == [1, 0] and numa_of(devices["memory-numa3"]) == [3, 2]
        ns = namespace(cluster, "numa-list")
        results = by_request(allocated(cluster, ns, aligned_claim(
            cluster, ns, "gpu0", node, gpu_selectors=(f"device.attributes['{DRIVER}'].index == 0",))))
        assert results["gpu"]["device"] == "gpu-0" and results["cpu"]["device"] in ("cpu-numa0", "cpu-numa1")
        # Across the sockets nothing matches: the GPU on node 2 has no NIC within its socket.
        aligned_claim(cluster, ns, "gpu2", node, gpu_selectors=(f"device.attributes['{DRIVER}'].index == 2",))
        assert unschedulable(cluster, ns, "gpu2-pod")
        assert agent.messages("error") == []

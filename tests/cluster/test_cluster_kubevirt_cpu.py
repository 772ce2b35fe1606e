"""KubeVirt VMs get their CPUs through DRA (CPUsWithDRA), against the real scheduler: the claim KubeVirt makes
for a VM with dedicated CPUs (`<vmi>-cpu-claim`: a request `req-cpu-socket-<i>` per guest socket, each one
device of class `dra.cpu` with `capacity: {dra.cpu/cpu: N}`, and a distinct socket per request when there
are several) is allocated from the CPU devices `dra-agent run --kubevirt-cpu` publishes (one per NUMA
node), the scheduler keeps count of the CPUs every VM took, and the agent prepares each share over its DRA
socket with CPUs of its own. The node's CPU topology is a sysfs tree of one socket, then of two
(`--sysfs-root`); the GPUs are the simulated machine's."""

from __future__ import annotations

from typing import Any

import pytest
from topology import build_topology

from .clusterkit import AgentRuns, ApiFailure, Cluster, devices_of, slices_of
from .podclaims import (
    allocated,
    by_request,
    claim_env,
    claim_of,
    create_claim,
    kubelet_prepare,
    metadata_files,
    namespace,
    pod_using,
    request,
    unschedulable,
)

pytestmark = pytest.mark.cluster

CAPACITY = "dra.cpu/cpu"
SOCKET = "dra.cpu/socketID"
CLASS = "dra.cpu"
LABELS = {"kubevirt.io/resource": "cpu-dra", "app": "virt-launcher"}


def vm_claim(cluster: Cluster, ns: str, vmi: str, node: str, sockets: list[int], *,
             socket_attribute: str = SOCKET) -> str:
    """The claim KubeVirt makes for VMI `vmi` (N CPUs per guest socket), and a virt-launcher pod on `node`
    using it; the claim's name."""
    name = f"{vmi}-cpu-claim"
    requests = [request(f"req-cpu-socket-{i}", CLASS, capacity={CAPACITY: str(n)}) for i, n in enumerate(sockets)]
    constraints = [{"requests": [r["name"] for r in requests], "distinctAttribute": socket_attribute}] \
        if len(sockets) > 1 else []
    create_claim(cluster, ns, name, requests, constraints, labels=LABELS)
    pod_using(cluster, ns, f"virt-launcher-{vmi}", name, node)
    return name


def start(cluster: Cluster, agent_runs: AgentRuns, node: str, sockets: tuple[int, ...]) -> Any:
    cluster.add_node(node)
    sysfs = build_topology(agent_runs.base / f"{node}-sys", sockets=sockets)
    kubeconfig = cluster.agent_kubeconfig(node)
    return kubeconfig, agent_runs.run(node, kubeconfig, "--kubevirt-cpu=true", f"--sysfs-root={sysfs}",
                                      "--nic-exclude=*", node=node)


def cpus_of(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def test_one_socket_vms_share_the_node_and_get_cpus_of_their_own(cluster: Cluster, agent_runs: AgentRuns) -> None:
    node = "dra-kubevirt-1s"
    kubeconfig, running = start(cluster, agent_runs, node, (0,))
    with running as agent:
        agent.wait_published()
        cpu = devices_of(slices_of(cluster.admin, node))["cpu-numa0"]
        assert cpu["capacity"] == {CAPACITY: {"value": "4", "requestPolicy": {
            "default": "1", "validRange": {"min": "1", "step": "1"}}}}
        assert cpu["allowMultipleAllocations"] is True and cpu["attributes"][SOCKET] == {"int": 0}

        ns = namespace(cluster, "kubevirt-one-socket")
        claims = [vm_claim(cluster, ns, vmi, node, [2]) for vmi in ("vm-a", "vm-b")]
        results = {c: by_request(allocated(cluster, ns, c)) for c in claims}
        shares = set()
        for c in claims:
            (r,) = results[c].values()
            assert r["request"] == "req-cpu-socket-0" and r["device"] == "cpu-numa0" and r["pool"] == node
            assert r["consumedCapacity"] == {CAPACITY: "2"} and r["shareID"]
            shares.add(r["shareID"])
        assert len(shares) == 2
        # The node's four CPUs are taken: a third VM's claim is not allocated, however small.
        third = vm_claim(cluster, ns, "vm-c", node, [1])
        assert unschedulable(cluster, ns, "virt-launcher-vm-c")
        assert not (claim_of(cluster, ns, third).get("status") or {}).get("allocation")

        # Prepared over the agent's DRA socket: each VM gets two CPUs, a whole core, none of the other's.
        got = []
        for c in claims:
            uid = claim_of(cluster, ns, c)["metadata"]["uid"]
            answer = kubelet_prepare(agent, kubeconfig, node, ns, c)
            assert not answer["claims"][uid].get("error"), answer
            (meta,) = metadata_files(agent, uid).values()
            (entry,) = meta["requests"][0]["devices"]
            assert entry["name"] == "cpu-numa0" and entry["consumedCapacity"] == {CAPACITY: "2"}
            assert cpus_of(claim_env(agent, uid)["DRA_CPU_NUMA0_CPUS"]) == cpus_of(entry["cpuset"])
            got.append(cpus_of(entry["cpuset"]))
        assert sorted(map(sorted, got)) == [[0, 2], [1, 3]]  # the tree's two cores, (0,2) and (1,3)


def test_two_socket_vm_gets_one_share_on_each_socket(cluster: Cluster, agent_runs: AgentRuns) -> None:
    node = "dra-kubevirt-2s"
    kubeconfig, running = start(cluster, agent_runs, node, (0, 1))
    with running as agent:
        agent.wait_published()
        devices = devices_of(slices_of(cluster.admin, node))
        assert {n: d["attributes"][SOCKET]["int"] for n, d in devices.items() if n.startswith("cpu-")} == {
            "cpu-numa0": 0, "cpu-numa1": 1}

        ns = namespace(cluster, "kubevirt-two-sockets")
        claim = vm_claim(cluster, ns, "vm-2s", node, [2, 2])
        results = by_request(allocated(cluster, ns, claim))
        assert {r["device"] for r in results.values()} == {"cpu-numa0", "cpu-numa1"}
        assert all(r["consumedCapacity"] == {CAPACITY: "2"} for r in results.values())

        uid = claim_of(cluster, ns, claim)["metadata"]["uid"]
        answer = kubelet_prepare(agent, kubeconfig, node, ns, claim)
        assert not answer["claims"][uid].get("error"), answer
        env = claim_env(agent, uid)
        files = metadata_files(agent, uid)
        assert sorted(files) == ["req-cpu-socket-0", "req-cpu-socket-1"]
        node_cpus = {"cpu-numa0": {0, 1, 4, 5}, "cpu-numa1": {2, 3, 6, 7}}
        for req, meta in files.items():
            (entry,) = meta["requests"][0]["devices"]
            assert entry["name"] == results[req]["device"]
            mine = cpus_of(entry["cpuset"])
            assert len(mine) == 2 and mine <= node_cpus[entry["name"]]
            variable = "DRA_" + entry["name"].upper().replace("-", "_") + "_CPUS"
            assert cpus_of(env[variable]) == mine

        # A guest of three sockets cannot have three distinct ones on this node.
        vm_claim(cluster, ns, "vm-3s", node, [1, 1, 1])
        assert unschedulable(cluster, ns, "virt-launcher-vm-3s")


def test_a_socket_attribute_named_socket_id_is_refused_by_the_api_server(cluster: Cluster) -> None:
    # Why the socket attribute is dra.cpu/socketID: after the domain an attribute name must be a C
    # identifier, in a slice and in a claim's constraint alike.
    ns = namespace(cluster, "kubevirt-names")
    with pytest.raises(ApiFailure) as refused:
        create_claim(cluster, ns, "vm-x-cpu-claim",
                     [request("req-cpu-socket-0", CLASS, capacity={CAPACITY: "1"}),
                      request("req-cpu-socket-1", CLASS, capacity={CAPACITY: "1"})],
                     [{"requests": ["req-cpu-socket-0", "req-cpu-socket-1"], "distinctAttribute": "dra.cpu/socket-id"}])
    assert refused.value.status == 422 and "distinctAttribute" in refused.value.message, refused.value.message


def test_the_class_kubevirt_names_selects_only_cpus_counted_in_its_capacity(cluster: Cluster) -> None:
    classes = {c["metadata"]["name"]: c for c in cluster.applied["kubevirt"] if c["kind"] == "DeviceClass"}
    assert CLASS in classes
    stored = cluster.admin.get(f"/apis/resource.k8s.io/v1/deviceclasses/{CLASS}")
    assert stored["spec"]["selectors"] == classes[CLASS]["spec"]["selectors"]

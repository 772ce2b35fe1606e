"""The fleet's API cost: N agents as N nodes (simulated GPUs, each its own Node, token, state and
kubelet directory) against one real 1.37 API server, etcd and kube-apiserver as the cluster tests
build them (`make cluster-components`), read from the API server's own `apiserver_request_total`.

No scheduler and no controller-manager run: what the API server counts for the agents' resources in
each window is the agents' (the bench's own requests happen between windows). Claims are made
allocated by the bench through the status subresource, as the scheduler would, and prepared through
each agent's DRA socket, as the kubelet would. Each node has a stand-in of the kubelet's pod resources
service (tests/podresources.py) whose pods use that node's claims, as a node's running pods would: what
garbage collection asks instead of the API server.

Figures (per agent; `fleet_*` keys):
- requests to come up (Node read, the pool published, the first garbage collection sweep);
- reads and writes in an idle window with `claims` prepared claims each, scaled to an hour;
- requests, and writes, for a restart of every agent at once (each stopped in order, as a rolling
  restart stops one);
- watches held while idle: every watch, and watches of every namespace's claims (cluster-wide).

Run alone: `.venv/bin/python bench/fleet.py --agents 20 --claims 100 --idle-seconds 600`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from podresources import PodResourcesStandIn, socket_of  # noqa: E402

from agent.kubelet import client as kc  # noqa: E402
from agent.names import ClaimRef  # noqa: E402

# What the agents read and write; the API server's own background requests (leases, its identity)
# touch none of these.
AGENT_RESOURCES = {"resourceslices", "resourceclaims", "nodes", "events"}
WRITES = {"CREATE", "UPDATE", "PATCH", "DELETE", "APPLY", "POST", "PUT"}
DRIVER = "dra.example.com"
NVML = "sim:dgx-h100"
CLAIMS_PER_CALL = 50
Count = collections.Counter[tuple[str, str]]  # (verb, resource[/subresource]) -> requests


def _cluster_kit() -> tuple[ModuleType, ModuleType, ModuleType, ModuleType]:
    """The cluster tests' kit (tests/cluster): its build, control plane, PKI and agent runner."""
    spec = importlib.util.spec_from_file_location("dra_cluster_build", ROOT / "tests" / "cluster" / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build  # its dataclasses look their module up
    spec.loader.exec_module(build)
    kit = [importlib.import_module(f"cluster.{name}") for name in ("clusterkit", "controlplane", "pki")]
    return build, kit[0], kit[1], kit[2]


def requests(metrics_text: str) -> Count:
    """apiserver_request_total summed by (verb, resource[/subresource]) over the agents' resources."""
    out: Count = collections.Counter()
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            labels = sample.labels
            if sample.name != "apiserver_request_total" or labels.get("resource") not in AGENT_RESOURCES:
                continue
            resource = labels["resource"] + (f"/{labels['subresource']}" if labels.get("subresource") else "")
            out[labels.get("verb", ""), resource] += int(sample.value)
    return out


def watches(metrics_text: str) -> tuple[int, int]:
    """(watches open on the agents' resources, of which those of every namespace's claims)."""
    every = cluster_wide = 0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "apiserver_longrunning_requests":
            continue
        for sample in family.samples:
            labels = sample.labels
            if labels.get("verb") != "WATCH" or labels.get("resource") not in AGENT_RESOURCES:
                continue
            every += int(sample.value)
            if labels.get("resource") == "resourceclaims" and labels.get("scope") == "cluster":
                cluster_wide += int(sample.value)
    return every, cluster_wide


def allocated(node: str, device: str, *, waits: bool = False) -> dict[str, Any]:
    """A claim's status as the scheduler allocates `device` of `node`: the node selector is what lets the
    node's agent write the claim's status (1.37's authorization of status.devices by the associated
    node); `waits` adds the binding conditions of a passthrough device."""
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": node, "device": device}
    if waits:
        result |= {"bindingConditions": ["HostPrepared"], "bindingFailureConditions": ["HostPrepareFailed"]}
    return {"allocation": {
        "devices": {"results": [result]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process (its threads included), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def split(delta: Count) -> tuple[int, int]:
    """(reads, writes) of a window."""
    writes = sum(n for (verb, _), n in delta.items() if verb in WRITES)
    return sum(delta.values()) - writes, writes


class Fleet:
    def __init__(self, work: Path, agents: int) -> None:
        build, self.kit, self.plane_mod, pki = _cluster_kit()
        components = build.ensure(build_missing=False)
        self.plane = self.plane_mod.start_plane(Path(components.bin), work / "plane", pki.Pki(work / "pki"),
                                                full=False)
        self.cluster = self.kit.Cluster(self.plane, work)
        self.work = work
        self.nodes = [f"fleet-{i:03d}" for i in range(agents)]
        self.running: dict[str, Any] = {}
        self.kubeconfigs: dict[str, Path] = {}
        self.kubelets: dict[str, PodResourcesStandIn] = {}  # per node, for the fleet's life (across restarts)
        self._stack = contextlib.ExitStack()

    def prepare_cluster(self) -> None:
        self.cluster.apply_deploy()
        for node in self.nodes:
            self.cluster.add_node(node)
            self.kubeconfigs[node] = self.cluster.agent_kubeconfig(node)
            self.kubelets[node] = PodResourcesStandIn(socket_of(self.work / node / "kubelet")).start()

    def snapshot(self) -> Count:
        return requests(str(self.cluster.admin.get("/metrics")))

    def watches(self) -> tuple[int, int]:
        return watches(str(self.cluster.admin.get("/metrics")))

    def start_all(self) -> None:
        for node in self.nodes:
            self.running[node] = self._stack.enter_context(self._agent(node))
        for node in self.nodes:
            self.running[node].wait_published(limit=300)
            self.kit.eventually(lambda n=node: self.running[n].metric("dra_agent_gc_sweeps_total") >= 1,
                                f"{node}: the first garbage collection sweep", 120)

    @contextlib.contextmanager
    def _agent(self, node: str, *flags: str) -> Iterator[Any]:
        with self.kit.agent(self.work / node, self.kubeconfigs[node], *flags, node=node, nvml=NVML,
                            own_kubelet=node not in self.kubelets) as proc:
            yield proc

    def binding_cost(self, foreign: int, r: dict[str, Any]) -> None:
        """CPU seconds that `--binding-conditions` costs an agent for `foreign` claims allocated to other
        nodes (made, allocated with binding conditions, deleted): one agent with it and one without, on
        Nodes of their own, the difference of their CPU time over the same window. Every agent with it
        watches every claim of the cluster: no field selector of ResourceClaims reaches the allocation."""
        pair = {"on": "fleet-bc-on", "off": "fleet-bc-off"}
        for node in pair.values():
            self.cluster.add_node(node)
            self.kubeconfigs[node] = self.cluster.agent_kubeconfig(node)
        with contextlib.ExitStack() as stack:
            procs = {k: stack.enter_context(self._agent(node, *(["--binding-conditions=vfio"] if k == "on" else [])))
                     for k, node in pair.items()}
            for proc in procs.values():
                proc.wait_published(limit=300)
            time.sleep(5)  # the watch of claims under way (it is started after the first publish)
            before = {k: cpu_seconds(p.proc.pid) for k, p in procs.items()}
            namespace = "fleet-far"
            self._namespace(namespace)
            base = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
            for i in range(foreign):
                node = self.nodes[i % len(self.nodes)] if self.nodes else "elsewhere"
                made = self._claim(base, namespace, f"far-{i:05d}")
                made["status"] = allocated(node, f"gpu-{i % 8}", waits=True)
                self.cluster.admin.put(f"{base}/far-{i:05d}/status", made)
            for i in range(foreign):
                self.cluster.admin.delete(f"{base}/far-{i:05d}")
            time.sleep(5)  # the last events delivered and handled
            after = {k: cpu_seconds(p.proc.pid) for k, p in procs.items()}
        used = {k: after[k] - before[k] for k in pair}
        r["fleet_binding_conditions_foreign_claims"] = foreign
        r["fleet_binding_conditions_cpu_s"] = used["on"]
        r["fleet_without_binding_conditions_cpu_s"] = used["off"]
        r["fleet_binding_conditions_cpu_s_per_1000_foreign_claims"] = (used["on"] - used["off"]) * 1000 / foreign

    def stop_all(self) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self.running.clear()

    def _namespace(self, name: str) -> None:
        with contextlib.suppress(Exception):  # there already
            self.cluster.admin.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                           "metadata": {"name": name}})

    def _claim(self, base: str, namespace: str, name: str) -> dict[str, Any]:
        return dict(self.cluster.admin.post(base, {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}}}))

    def make_claims(self, node: str, count: int) -> list[ClaimRef]:
        """`count` claims allocated a GPU of `node` each, in the node's own namespace."""
        namespace = node
        self._namespace(namespace)
        base = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
        refs = []
        for i in range(count):
            name = f"c-{i:04d}"
            made = self._claim(base, namespace, name)
            made["status"] = allocated(node, f"gpu-{i % 8}")
            self.cluster.admin.put(f"{base}/{name}/status", made)
            refs.append(ClaimRef(namespace, name, made["metadata"]["uid"]))
        self.kubelets[node].use(*refs, pod="fleet")  # a pod on the node uses them
        return refs

    async def prepare(self, node: str, refs: list[ClaimRef]) -> None:
        socket = self.work / node / "kubelet" / "plugins" / DRIVER / "dra.sock"
        async with kc.DRAClient(socket) as client:
            for i in range(0, len(refs), CLAIMS_PER_CALL):
                answer = kc.to_dict(await client.prepare(refs[i:i + CLAIMS_PER_CALL]))
                failed = {uid: c["error"] for uid, c in (answer.get("claims") or {}).items() if c.get("error")}
                if failed:
                    raise RuntimeError(f"{node}: prepare failed: {failed}")

    def settled(self) -> None:
        """Until every agent has written every claim status it owes."""
        for node, proc in self.running.items():
            self.kit.eventually(lambda p=proc: p.metric("dra_agent_claim_status_queue") == 0,
                                f"{node}: claim status written", 300)

    def close(self) -> None:
        self.stop_all()
        for kubelet in self.kubelets.values():
            kubelet.stop()
        self.cluster.close()
        self.plane.stop()


def diff(after: Count, before: Count) -> Count:
    return collections.Counter({k: after[k] - before[k] for k in after if after[k] - before[k]})


def run(agents: int, claims: int, idle_seconds: float, r: dict[str, Any], progress: Any = print,
        foreign: int = 1000) -> None:
    """The fleet's figures into `r`."""
    with tempfile.TemporaryDirectory(prefix="drafleet-", dir="/tmp") as tmp:
        fleet = Fleet(Path(tmp), agents)
        try:
            progress(f"fleet: {agents} nodes registered, deploy/ applied")
            fleet.prepare_cluster()
            watches_before = fleet.watches()
            progress(f"fleet: {agents} agents come up")
            before = fleet.snapshot()
            fleet.start_all()
            start = diff(fleet.snapshot(), before)
            r["fleet_agents"] = agents
            r["fleet_requests_per_agent_start"] = sum(start.values()) / agents
            r["fleet_start_requests"] = {f"{v} {res}": n / agents for (v, res), n in sorted(start.items())}
            progress(f"fleet: {claims} claims made and prepared on each node")
            for node in fleet.nodes:
                refs = fleet.make_claims(node, claims)
                asyncio.run(fleet.prepare(node, refs))
            fleet.settled()
            r["fleet_claims_per_agent"] = claims
            progress(f"fleet: idle for {idle_seconds:.0f} s")
            before = fleet.snapshot()
            time.sleep(idle_seconds)
            idle = diff(fleet.snapshot(), before)
            every, cluster_wide = fleet.watches()
            reads, writes = split(idle)
            hour = 3600.0 / idle_seconds
            r["fleet_idle_seconds"] = idle_seconds
            r["fleet_reads_per_agent_idle_hour"] = reads * hour / agents
            r["fleet_writes_per_agent_idle_hour"] = writes * hour / agents
            r["fleet_idle_requests"] = {f"{v} {res}": n / agents for (v, res), n in sorted(idle.items())}
            r["fleet_watches_per_agent"] = (every - watches_before[0]) / agents
            r["fleet_cluster_wide_watches_per_agent"] = (cluster_wide - watches_before[1]) / agents
            progress("fleet: every agent restarted at once")
            before = fleet.snapshot()
            fleet.stop_all()
            fleet.start_all()
            fleet.settled()
            restart = diff(fleet.snapshot(), before)
            reads, writes = split(restart)
            r["fleet_requests_per_agent_restart"] = (reads + writes) / agents
            r["fleet_writes_per_agent_restart"] = writes / agents
            r["fleet_restart_requests"] = {f"{v} {res}": n / agents for (v, res), n in sorted(restart.items())}
            if foreign:
                progress(f"fleet: {foreign} claims allocated to other nodes, with and without --binding-conditions")
                fleet.binding_cost(foreign, r)
        finally:
            fleet.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=20)
    p.add_argument("--claims", type=int, default=100, help="prepared claims per agent (default: 100)")
    p.add_argument("--idle-seconds", type=float, default=600.0,
                   help="the idle window, one default garbage collection period (default: 600)")
    p.add_argument("--foreign-claims", type=int, default=1000,
                   help="claims allocated to other nodes for the --binding-conditions figure (default: 1000; 0: none)")
    args = p.parse_args()
    r: dict[str, Any] = {}
    run(args.agents, args.claims, args.idle_seconds, r, progress=lambda m: print(m, file=sys.stderr, flush=True),
        foreign=args.foreign_claims)
    sys.stdout.buffer.write(orjson.dumps(r, option=orjson.OPT_INDENT_2) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

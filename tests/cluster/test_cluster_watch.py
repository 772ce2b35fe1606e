"""A claim no decoder can read, on the real API server (1.37.2) with the real scheduler: a tenant's
ResourceClaim whose opaque parameters nest 1,500 levels deep (3 KB), which the API server stores, allocated a
passthrough GPU on the node of an agent with `--binding-conditions vfio`. The agent says once that it skips
that claim, and prepares the next one ahead of its pod's binding from the same watch: its own count of its
requests (`dra_agent_api_requests_total`) has one WATCH of resourceclaims throughout, the one that listed the
claims at its start. Before, the claim ended the watch, which started again without a resourceVersion about
once a second (every claim of the cluster sent again each time), and the pod of the next claim, whose name
comes after the poisoned one, was never bound.

Python's json recurses once per nesting level as msgspec does, so this test writes, reads and deletes the
poisoned claim as text, never parsed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.bindingconditions import BINDING_CONDITION

from .clusterkit import DRIVER, AgentProcess, Cluster, eventually
from .workloads import Namespace, NodeAgent, claim_spec, node_agent, our_status, request

pytestmark = pytest.mark.cluster

WATCH_NODE = "dra-watch"
DEPTH = 1500
WATCHES = 'dra_agent_api_requests_total{resource="resourceclaims",verb="WATCH"}'
POISONED = "a-poisoned"  # before the next claim in the API server's order (namespace, then name)


@pytest.fixture
def agent(cluster: Cluster, cluster_root: Path) -> Iterator[NodeAgent]:
    with node_agent(cluster, WATCH_NODE, cluster_root / "watch", "--binding-conditions=vfio") as running:
        yield running


def post_poisoned(ns: Namespace, name: str) -> None:
    spec = claim_spec(request("vm", "gpu-passthrough"),
                      config=[{"opaque": {"driver": DRIVER, "parameters": {"nested": "DEEP"}}}])
    body = json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                       "spec": spec}, separators=(",", ":"), sort_keys=True)
    deep = "[" * DEPTH + "]" * DEPTH
    assert len(deep) == 3000
    answer = ns.cluster.admin.client.post(ns.path("resourceclaims"), content=body.replace('"DEEP"', deep),
                                          headers={"Content-Type": "application/json"})
    assert answer.status_code == 201, answer.text[:500]
    assert deep in answer.text  # stored as sent


def remove_poisoned(ns: Namespace, name: str) -> None:
    """The pod and the claim gone (`Namespace.clean` parses what it lists)."""
    ns.remove_pod(name)
    http = ns.cluster.admin.client
    http.delete(ns.path("resourceclaims", name))
    eventually(lambda: http.get(ns.path("resourceclaims", name)).status_code == 404, f"claim {name} is gone")


def skipped(proc: AgentProcess, name: str) -> list[str]:
    return [m for m in proc.messages("warning") if f"{name} (uid" in m and "does not decode" in m]


def host_prepared(claim: dict[str, Any]) -> bool:
    return any(c["type"] == BINDING_CONDITION and c["status"] == "True"
               for e in our_status(claim) for c in e.get("conditions") or [])


def test_a_claim_no_decoder_can_read_is_skipped_and_the_next_claim_is_prepared(agent: NodeAgent,
                                                                                ns: Namespace) -> None:
    proc = agent.proc
    assert proc is not None
    eventually(lambda: proc.metric(WATCHES) >= 1, "the agent watches the claims")
    try:
        post_poisoned(ns, POISONED)
        ns.pod(POISONED, WATCH_NODE, claims={"vm": POISONED})
        ns.claim("b-next", claim_spec(request("vm", "gpu-passthrough")))
        ns.pod("b-next", WATCH_NODE, claims={"vm": "b-next"})

        # The next claim is delivered, prepared ahead and said HostPrepared: the scheduler binds its pod.
        assert ns.scheduled("b-next")["spec"]["nodeName"] == WATCH_NODE
        claim = ns.get("resourceclaims", "b-next")
        assert host_prepared(claim) and claim["metadata"]["uid"] in agent.prepared()
        # One watch of the claims: they were listed once.
        assert proc.metric(WATCHES) == 1
        # The poisoned claim was allocated here (its pod waits for its binding conditions), said once
        # whatever its changes, and never prepared.
        raw = ns.cluster.admin.client.get(ns.path("resourceclaims", POISONED)).text
        assert f'"pool":"{WATCH_NODE}"' in raw and '"reservedFor"' in raw
        (said,) = skipped(proc, POISONED)
        assert "RecursionError" in said, said
        assert not ns.get("pods", POISONED)["spec"].get("nodeName")
        assert len(agent.prepared()) == 1
    finally:
        remove_poisoned(ns, POISONED)

"""An unreadable claim record on a node in a cluster: the agent sets it aside and says so where operators look,
a Warning Event on its Node that the real API server stores (and `kubectl describe node` lists), posted with
the agent's own ServiceAccount and the RBAC deploy/ ships."""

from __future__ import annotations

from typing import Any

import pytest

from .clusterkit import NODE, AgentRuns, Cluster, eventually

pytestmark = pytest.mark.cluster

UID = "5e7a51de-0000-4000-8000-00000000c0de"


def quarantine_events(cluster: Cluster) -> list[dict[str, Any]]:
    found = cluster.admin.get("/apis/events.k8s.io/v1/namespaces/default/events")["items"]
    return [e for e in found if e.get("reason") == "ClaimRecordQuarantined" and UID in e.get("note", "")]


def test_an_unreadable_record_becomes_an_event_on_the_node(cluster: Cluster, agent_runs: AgentRuns,
                                                           agent_kubeconfig: Any) -> None:
    records = agent_runs.base / "records" / "state" / "claims"
    records.mkdir(parents=True)
    (records / f"{UID}.rec").write_bytes(b"DRAREC 1 0000 12\nnot a record")  # its checksum does not match

    with agent_runs.run("records", agent_kubeconfig) as agent:
        (event,) = eventually(lambda: quarantine_events(cluster), "the Event about the record set aside")
        corrupt = records / f"{UID}.rec.corrupt"
        assert corrupt.exists() and not (records / f"{UID}.rec").exists()
        assert event["type"] == "Warning" and event["action"] == "SetAside"
        assert str(corrupt) in event["note"], event["note"]
        node = cluster.admin.get(f"/api/v1/nodes/{NODE}")
        assert event["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node["metadata"]["uid"]}
        assert event["reportingController"] == "dra.example.com/dra-agent"
        # What `kubectl describe node` reads: the core/v1 view of the same Event.
        core = cluster.admin.get("/api/v1/namespaces/default/events",
                                 fieldSelector=f"involvedObject.kind=Node,involvedObject.name={NODE}")["items"]
        assert [e["reason"] for e in core if UID in e.get("message", "")] == ["ClaimRecordQuarantined"]
        assert agent.metric("dra_agent_records_quarantined_total") == 1
        assert not [m for m in agent.messages("warning") if "could not post Event" in m]

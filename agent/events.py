"""Kubernetes Events about this node (events.k8s.io/v1, regarding the Node): what an operator must see
without reading the agent's logs (`kubectl describe node`, `kubectl get events`).

An Event is best effort: it is posted in the background, retried a few times while the API server's
answer says it may heal, and a failure is logged, never raised to what reported it.

An Event is created in the namespace of the object it is about (`namespace_of`), never in another: a
cluster-scoped object's (the Node's) live in `default`, where the kubelet records its own Events about its
Node (the Kubernetes recorders put an Event whose object has no namespace there;
tests/cluster/test_cluster_kubelet.py sees the real kubelet's there). deploy/ grants `create` on Events in
`default` alone, a Role rather than the ClusterRole, so the agent's token cannot post Events about a
tenant's objects in the tenant's namespaces (docs/deployment.md, "RBAC").
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from agent import kube

if TYPE_CHECKING:  # the API client is loaded by the first Event posted
    import lightkube

log = logging.getLogger(__name__)

NAMESPACE = "default"  # where the Events of a cluster-scoped object live
NOTE_MAX = 1024  # bytes the API server takes in a note
ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class NodeEvent:
    reason: str  # UpperCamelCase, what happened (`ClaimRecordQuarantined`)
    action: str  # what the agent did about it (`SetAside`)
    note: str  # for a person: what, where, what it means
    type: str = "Warning"


@dataclass(frozen=True, slots=True)
class Regarding:
    """The object an Event is about (its `regarding`)."""

    kind: str
    name: str
    uid: str = ""
    namespace: str = ""  # none: a cluster-scoped object (a Node)
    api_version: str = "v1"


def namespace_of(regarding: Regarding) -> str:
    """The namespace an Event about `regarding` is created in: the object's own, or for a cluster-scoped one
    `default`."""
    return regarding.namespace or NAMESPACE


class NodeEvents:
    """Posts Events regarding this node, reported by `<driver>/dra-agent` from the instance `<node>`."""

    def __init__(self, client: lightkube.AsyncClient, node: str, node_uid: str, driver: str) -> None:
        self.client = client
        self.node = node
        self.node_uid = node_uid
        self.controller = f"{driver}/dra-agent"
        self.instance = f"dra-agent-{node}"[:128]
        self.backoff = kube.Backoff(initial=0.5, maximum=10.0, attempts=ATTEMPTS)

    @property
    def regarding(self) -> Regarding:
        return Regarding("Node", self.node, self.node_uid)

    def body(self, event: NodeEvent) -> dict[str, object]:
        note = event.note.encode()[:NOTE_MAX].decode(errors="ignore")
        about = self.regarding
        regarding: dict[str, str] = {"apiVersion": about.api_version, "kind": about.kind, "name": about.name}
        if about.namespace:
            regarding["namespace"] = about.namespace
        if about.uid:
            regarding["uid"] = about.uid
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"apiVersion": "events.k8s.io/v1", "kind": "Event",
                "metadata": {"name": f"{self.node}.{secrets.token_hex(8)}", "namespace": namespace_of(about)},
                "eventTime": now, "reportingController": self.controller, "reportingInstance": self.instance,
                "action": event.action, "reason": event.reason, "type": event.type, "note": note,
                "regarding": regarding}

    async def post(self, event: NodeEvent) -> bool:
        """Create the Event (retried while that may help); whether it was created."""
        from lightkube.resources.events_v1 import Event

        for failures in range(1, ATTEMPTS + 1):
            try:
                await self.client.create(cast(Event, Event.from_dict(self.body(event))))
                return True
            except Exception as exc:
                if failures == ATTEMPTS or not kube.is_retryable(exc):
                    log.warning("could not post Event %s about node %s: %s", event.reason, self.node,
                                kube.describe(exc))
                    return False
                await asyncio.sleep(self.backoff.delay(failures, exc))
        return False

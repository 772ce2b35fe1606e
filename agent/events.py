"""Kubernetes Events about this node (events.k8s.io/v1, regarding the Node): what an operator must see
without reading the agent's logs (`kubectl describe node`, `kubectl get events`).

An Event is best effort: it is posted in the background, retried a few times while the API server's
answer says it may heal, and a failure is logged, never raised to what reported it. Events of a
cluster-scoped object live in the `default` namespace, as the kubelet's of the Node do.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from dataclasses import dataclass
from typing import cast

import lightkube

from agent import kube

log = logging.getLogger(__name__)

NAMESPACE = "default"
NOTE_MAX = 1024  # bytes the API server takes in a note
ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class NodeEvent:
    reason: str  # UpperCamelCase, what happened (`ClaimRecordQuarantined`)
    action: str  # what the agent did about it (`SetAside`)
    note: str  # for a person: what, where, what it means
    type: str = "Warning"


class NodeEvents:
    """Posts Events regarding this node, reported by `<driver>/dra-agent` from the instance `<node>`."""

    def __init__(self, client: lightkube.AsyncClient, node: str, node_uid: str, driver: str) -> None:
        self.client = client
        self.node = node
        self.node_uid = node_uid
        self.controller = f"{driver}/dra-agent"
        self.instance = f"dra-agent-{node}"[:128]
        self.backoff = kube.Backoff(initial=0.5, maximum=10.0, attempts=ATTEMPTS)

    def body(self, event: NodeEvent) -> dict[str, object]:
        note = event.note.encode()[:NOTE_MAX].decode(errors="ignore")
        regarding: dict[str, str] = {"apiVersion": "v1", "kind": "Node", "name": self.node}
        if self.node_uid:
            regarding["uid"] = self.node_uid
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"apiVersion": "events.k8s.io/v1", "kind": "Event",
                "metadata": {"name": f"{self.node}.{secrets.token_hex(8)}", "namespace": NAMESPACE},
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

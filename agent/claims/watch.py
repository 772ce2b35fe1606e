"""ResourceClaims as they change: a watch of every namespace's claims on the API server, for the claims
prepared before their pods are bound (`agent.engine.prebind`, with `--binding-conditions`).

The watch starts without a resource version, so the API server first sends every claim it holds as
ADDED, then each change. lightkube resumes a watch that times out from the last version it saw and
starts over when that version is too old (410); any other failure ends the watch here, and it starts
over after a backoff (every claim sent again: the consumer's work is idempotent). A deletion missed
between two watches is caught by garbage collection (`agent.engine.gc`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from agent import kube
from agent.kube import Backoff

if TYPE_CHECKING:  # the API client is imported when the watch starts (a cluster only)
    import lightkube

EventType = Literal["ADDED", "MODIFIED", "DELETED"]
_TYPES: Mapping[str, EventType] = {"ADDED": "ADDED", "MODIFIED": "MODIFIED", "DELETED": "DELETED"}
WATCH_TIMEOUT = 300  # seconds the API server keeps one watch request open


@dataclass(frozen=True, slots=True)
class ClaimEvent:
    type: EventType
    claim: Mapping[str, Any]  # the claim as JSON (a deleted one as it was last)


async def watch_claims(client: lightkube.AsyncClient, *, backoff: Backoff | None = None) -> AsyncIterator[ClaimEvent]:
    """Every claim, then every change, for ever (the caller cancels it)."""
    import lightkube
    from lightkube.resources.resource_v1 import ResourceClaim

    async for kind, obj in kube.watch_forever(client, ResourceClaim, "ResourceClaims", backoff=backoff,
                                              namespace=lightkube.ALL_NS, server_timeout=WATCH_TIMEOUT):
        if (known := _TYPES.get(kind)) is not None:  # not BOOKMARK, ERROR
            yield ClaimEvent(known, kube.plain(obj))

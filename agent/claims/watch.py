"""ResourceClaims as they change: a watch of every namespace's claims on the API server, for the claims
prepared before their pods are bound (`agent.engine.prebind`, with `--binding-conditions`).

The watch (`agent.kube.watch`) starts without a resource version, so the API server first sends every claim it
holds as ADDED, then each change. It reads each event's head first (`ClaimHead`: the claim's metadata and
its allocation's driver and pool per result) and hands it to the consumer's filter: the claims of other
nodes, nearly all of them on a large cluster, are dropped there, their configuration never decoded. A claim
the consumer wants is decoded whole; one that does not decode is logged once and skipped, and the watch
goes on. A watch that fails starts again from the last version it saw (after a backoff); a deletion missed
while none runs is caught by garbage collection (`agent.engine.gc`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from agent.kube import Backoff
from agent.kube import watch as kubewatch
from agent.kube.watch import EventType

if TYPE_CHECKING:  # the API client is imported when the watch starts (a cluster only)
    import lightkube

WATCH_TIMEOUT = 300  # seconds the API server keeps one watch request open


class _Result(msgspec.Struct, frozen=True):
    driver: str | None = None
    pool: str | None = None


class _Devices(msgspec.Struct, frozen=True):
    results: tuple[_Result, ...] | None = None


class _Allocation(msgspec.Struct, frozen=True):
    devices: _Devices | None = None


class _Status(msgspec.Struct, frozen=True):
    allocation: _Allocation | None = None


class ClaimHead(kubewatch.Head, frozen=True):
    """What the watch reads of every claim before deciding whether to decode it whole."""

    status: _Status | None = None

    def allocated_on(self, driver: str, pool: str) -> bool:
        """Whether a result of `driver` in `pool` (a node's own pool is named after the node) is allocated."""
        allocation = self.status.allocation if self.status is not None else None
        devices = allocation.devices if allocation is not None else None
        return any(r.driver == driver and r.pool == pool for r in (devices.results if devices else None) or ())


@dataclass(frozen=True, slots=True)
class ClaimEvent:
    type: EventType
    claim: Mapping[str, Any]  # the claim as JSON (a deleted one as it was last)


async def watch_claims(client: lightkube.AsyncClient, *, wanted: Callable[[ClaimHead], bool],
                       backoff: Backoff | None = None) -> AsyncIterator[ClaimEvent]:
    """Every claim `wanted` accepts, then every change of one, for ever (the caller cancels it)."""
    import lightkube
    from lightkube.resources.resource_v1 import ResourceClaim

    async for event in kubewatch.watch_forever(client, ResourceClaim, "ResourceClaims", head=ClaimHead,
                                               wanted=wanted, whole=True, backoff=backoff,
                                               namespace=lightkube.ALL_NS, server_timeout=WATCH_TIMEOUT):
        if event.object is not None:
            yield ClaimEvent(event.type, event.object)

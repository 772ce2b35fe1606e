"""Claims prepared as soon as they are allocated on this node, for their devices' binding conditions
(`agent.bindingconditions`, `--binding-conditions`).

The scheduler reserves such a claim for its pod and then waits, before binding the pod, until the
claim's `status.devices` entry of each such device says the binding condition is True. `PreBinder`
watches the claims (`agent.claims.watch`) and, for one allocated here whose results carry binding
conditions, runs the very prepare the kubelet's NodePrepareResources runs (`PrepareEngine.prepare_ahead`:
the claim's host side effects, each step recorded before it happens, its files and its record, marked
`ahead`); the claim status writer then says the binding condition is True (`agent.health.claimstatus`).
When the kubelet calls NodePrepareResources after the pod is bound, the record answers at once.

A prepare that fails writes the binding failure condition instead (`ClaimStatusWriter.binding_failed`):
the scheduler gives the binding up, deallocates the claim and allocates again, perhaps elsewhere. Each
allocation is tried once: one seen again (the scheduler's reservation, our own status) is left as it is,
and once the claim has been seen without it, a new allocation is tried anew.

A claim prepared ahead whose allocation goes away (deallocated after a failed or timed-out binding,
allocated again to other devices) or that is deleted before its pod ran is unprepared (the kubelet's
own unprepare path, every host effect undone in recorded steps); one missed while the agent was away
is unprepared at the next start's watch, or by garbage collection once the claim is gone. A record the
kubelet's prepare made (not `ahead`) is never unprepared here: a pod may use it.

Each claim's events are handled in order, one at a time; different claims concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agent.claims.book import ClaimSummary
from agent.claims.watch import ClaimEvent, ClaimHead, watch_claims
from agent.engine.prepare import PrepareEngine
from agent.health.bindingstatus import BindingFailure
from agent.names import ClaimRef

if TYPE_CHECKING:  # a cluster's only: the watch imports the API client when it starts
    import lightkube

log = logging.getLogger(__name__)

DeviceKey = tuple[str, str, str]  # (pool, device, shareID or "")


class BindingStatus(Protocol):
    """Where a failed prepare ahead of binding is reported (`ClaimStatusWriter`)."""

    def binding_failed(self, target: ClaimRef, failure: BindingFailure) -> None: ...


@dataclass(frozen=True, slots=True)
class Allocated:
    """What the pre-binder reads of a claim: its devices of this driver on this node, and whether any of
    them waits for its binding conditions."""

    ref: ClaimRef
    devices: frozenset[DeviceKey]
    waits: bool  # a device's allocation result carries binding conditions
    allocated_at: str  # status.allocation.allocationTimestamp: which allocation this is

    @classmethod
    def of(cls, claim: Mapping[str, Any], driver: str, node: str) -> Allocated | None:
        meta = claim.get("metadata")
        if not isinstance(meta, Mapping):
            return None
        ref = ClaimRef(str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", "")))
        allocation = (claim.get("status") or {}).get("allocation") or {}
        results = (allocation.get("devices") or {}).get("results") or []
        ours = [r for r in results if isinstance(r, Mapping) and r.get("driver") == driver and r.get("pool") == node]
        devices = frozenset((str(r.get("pool")), str(r.get("device")), str(r.get("shareID") or "")) for r in ours)
        waits = any(r.get("bindingConditions") for r in ours)
        return cls(ref, devices, waits, str(allocation.get("allocationTimestamp") or ""))


def _held(summary: ClaimSummary) -> frozenset[DeviceKey]:
    return frozenset((d.pool, d.device, d.share_id) for d in summary.devices)


class PreBinder:
    def __init__(self, engine: PrepareEngine, status: BindingStatus) -> None:
        self.engine = engine
        self.status = status
        self.driver = engine.settings.driver_name
        self.node = engine.settings.node_name
        self._latest: dict[str, ClaimEvent] = {}  # per claim UID: the event not yet handled
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Per claim UID: the allocation (its time, its devices) prepared or failed ahead, until the claim is seen
        # without it (the API's times are in seconds: a claim deallocated and allocated again within one
        # second has the same time).
        self._tried: dict[str, tuple[str, frozenset[DeviceKey]]] = {}

    async def run(self, events: AsyncIterable[ClaimEvent]) -> None:
        try:
            async for event in events:
                self.observe(event)
        finally:
            await self.stop()

    def observe(self, event: ClaimEvent) -> None:
        """Queue the claim's latest event; its handler takes it when the one before is done."""
        uid = str((event.claim.get("metadata") or {}).get("uid", ""))
        if not uid:
            return
        self._latest[uid] = event
        if uid not in self._tasks:
            self._tasks[uid] = asyncio.get_running_loop().create_task(self._claim(uid), name=f"prebind-{uid}")

    def wants(self, head: ClaimHead) -> bool:
        """Whether a claim's event can change anything here, from its head alone (the watch's filter: the
        watch sends every claim of the cluster, almost all of them allocated elsewhere, and drops those this
        refuses before their configuration is decoded): it is allocated a device of this driver on this
        node, or it is one this agent is handling, holds a record of (prepared ahead: it may have lost its
        allocation) or tried an allocation of (seen without it, the next allocation is tried anew)."""
        uid = head.metadata.uid
        if not uid:
            return False
        if uid in self._tasks or uid in self._tried or self.engine.book.record_of(uid) is not None:
            return True
        return head.allocated_on(self.driver, self.node)

    async def idle(self) -> None:
        """Until every event observed so far is handled (tests)."""
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _claim(self, uid: str) -> None:
        try:
            while (event := self._latest.pop(uid, None)) is not None:
                try:
                    await self.handle(event)
                except Exception:
                    log.exception("claim %s: handling its %s event for binding conditions failed", uid, event.type)
        finally:
            self._tasks.pop(uid, None)

    async def handle(self, event: ClaimEvent) -> None:
        claim = Allocated.of(event.claim, self.driver, self.node)
        if claim is None:
            return
        uid = claim.ref.uid
        summary = self.engine.book.record_of(uid)
        current = frozenset() if event.type == "DELETED" else claim.devices
        if summary is not None and summary.ahead and _held(summary) != current:
            # Prepared for an allocation the claim no longer has (or the claim is gone): its pod will not run
            # here with it.
            log.info("%s lost the allocation it was prepared for ahead of binding: unpreparing it", claim.ref)
            await self.engine.unprepare_claim(ClaimRef(summary.namespace, summary.name, uid))
            summary = None
        allocation = (claim.allocated_at, claim.devices)
        if event.type == "DELETED" or not claim.waits:
            self._tried.pop(uid, None)
            return
        if summary is not None or self._tried.get(uid) == allocation:
            return
        self._tried[uid] = allocation
        result = await self.engine.prepare_ahead(claim.ref, event.claim)
        if result.error:
            self.status.binding_failed(claim.ref, BindingFailure(tuple(sorted(claim.devices)), result.error,
                                                                 time.time()))


async def prebind_claims(engine: PrepareEngine, status: BindingStatus, client: lightkube.AsyncClient) -> None:
    """The daemon's task (`--binding-conditions` in a cluster): every claim watched, for ever."""
    binder = PreBinder(engine, status)
    await binder.run(watch_claims(client, wanted=binder.wants))

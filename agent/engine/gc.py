"""Garbage collection of prepared claims whose ResourceClaim is gone.

The kubelet unprepares a claim when its pod goes; if that call never comes (the kubelet lost its
state, the node was drained while the agent was down), the claim's record and files would stay
forever. `ClaimCollector` looks up the ResourceClaim of every prepared claim at start and then
every `interval` seconds (the grace period, at least 0.1 s), through the same claim source prepare
reads (the API server, or `DIR/resourceclaims` offline).

What a sweep costs the API server does not grow with the claims: a source that lists
(`ClaimLister`, the API server's) answers one metadata-only LIST per namespace holding prepared
claims, a few hundred bytes a claim, where a GET per claim every minute was over 6,000 requests a
node-hour with 100 claims. Only a claim that has been gone for the whole grace period is read once
more by itself, just before it is collected. Sweeping once a grace period is as often as the
guarantee needs: a claim deleted without an unprepare is collected by the second sweep that finds it
gone, between one and two grace periods (and a sweep) after its deletion, never before one.

A claim counts as gone when the source answers ClaimNotFound (a list: does not hold it), or when it
holds a claim of that namespace/name with another UID (deleted and re-created). Once a claim has
been observed gone continuously for longer than `--gc-grace-period`, and a last look just before
still finds it gone, it is unprepared through the engine's normal path
(`PrepareEngine.unprepare_claim`): that takes the claim's locks and treats the record as the truth,
so it is safe beside a kubelet call for the same claim and beside a second agent on the node.

- A claim the source answers with the same UID is never collected, and its clock is reset.
- A source error (ClaimSourceError: the API server down, a file that cannot be read or parsed)
  is no answer: the claim is not collected on it, and it resets nothing either. The grace period
  counts from the first observation of "gone"; a later "present" starts it over.
- Where the first observation of "gone" is kept: in memory. A restart therefore starts every
  grace period over, which only ever delays a collection, never hastens one; the records stay
  what prepare and unprepare alone write (no extra fsync'd writes, no format change, nothing two
  agents could disagree about).
- A collected claim whose host changes cannot be undone (the hardware is gone) is unprepared all the
  same, as a kubelet unprepare is (`agent.claims.leftovers`); the undoing of such leftovers is tried
  again every sweep, and between sweeps every LEFTOVERS_INTERVAL (local work, no API request).
- An agent that fell back to offline (`--offline-fallback`: no cluster configured, reachable, or
  knowing the node at start) collects nothing. Claims it prepared while the API server answered
  are not in the offline directory, and a record does not say which source its claim came from:
  "not in the directory" is no answer about them. With `--offline DIR` every claim came from DIR,
  and collection runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent.claims.book import ClaimSummary
from agent.claims.sources import ClaimLister, ClaimNotFound, ClaimSource, ClaimSourceError
from agent.config import Settings
from agent.engine.prepare import PrepareEngine
from agent.metrics import Metrics
from agent.names import ClaimRef

log = logging.getLogger(__name__)

MIN_INTERVAL = 0.1
LEFTOVERS_INTERVAL = 60.0  # seconds between tries of undoing leftover host changes, sweeps or not
# Lookups a sweep has in flight at most. A sweep reads every prepared claim (10,000 on a busy node):
# all at once, its reads (worker threads, offline) would queue ahead of the kubelet's prepares in the
# default executor for seconds, and hold thousands of tasks and parsed claims in memory at once.
SWEEP_WINDOW = 8

PRESENT, GONE, UNKNOWN = "present", "gone", "unknown"


def collection_off(settings: Settings, offline: Path | None) -> str | None:
    """Why the running agent must not collect claims, or None. `offline`: the directory the agent
    reads claims from now (`agent.app.connection.Connection.offline`)."""
    if offline is not None and settings.offline is None:
        return (f"the agent fell back to offline ({offline}, --offline-fallback): claims prepared while "
                "the API server answered are not in that directory, and a record does not say where its "
                "claim came from")
    return None


def gc_interval(grace: float) -> float:
    """Seconds between sweeps: the grace period, at least 0.1 s."""
    return max(MIN_INTERVAL, grace)


class ClaimCollector:
    """Unprepares prepared claims whose ResourceClaim has been gone for longer than `grace` seconds.

    `sweep()` is one pass (tests call it with an injected `clock`); `run()` sweeps at once and then
    every `interval` seconds, for the daemon's background task.
    """

    def __init__(self, engine: PrepareEngine, grace: float, *, source: ClaimSource | None = None,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic,
                 interval: float | None = None) -> None:
        self.engine = engine
        self.source: ClaimSource = source if source is not None else engine.claims
        self.grace = grace
        self.interval = gc_interval(grace) if interval is None else interval
        self.metrics = metrics
        self.clock = clock
        self.gone_since: dict[str, float] = {}  # claim UID -> first observed gone (clock time)
        self.collected = 0

    async def run(self) -> None:
        log.info("garbage collection of claims whose ResourceClaim is gone: grace %gs, every %gs",
                 self.grace, self.interval)
        due = 0.0
        while True:
            try:
                if time.monotonic() >= due:
                    await self.sweep()
                    due = time.monotonic() + self.interval
                else:
                    await self._retry_leftovers()
            except Exception:
                log.exception("garbage collection sweep failed")
            await asyncio.sleep(max(MIN_INTERVAL, min(due - time.monotonic(), LEFTOVERS_INTERVAL)))

    async def sweep(self) -> list[str]:
        """One pass over the prepared claims; the UIDs unprepared in it."""
        records = self.engine.records
        for uid in set(self.gone_since) - set(records):  # unprepared meanwhile (the kubelet, another agent)
            del self.gone_since[uid]
        collected: list[str] = []
        todo = list(records.values())
        del records
        if isinstance(self.source, ClaimLister):
            await self._sweep_by_namespace(self.source, todo, collected)
        else:
            for i in range(0, len(todo), SWEEP_WINDOW):
                window = [rec for rec in todo[i:i + SWEEP_WINDOW] if self._still_prepared(rec)]
                found = await asyncio.gather(*(self.observe(rec) for rec in window))
                await self._judge(window, found, collected)
        await self._retry_leftovers()
        if self.metrics is not None:
            self.metrics.gc_sweeps.inc()
        return collected

    def _still_prepared(self, rec: ClaimSummary) -> bool:
        """A claim unprepared since the sweep began (the kubelet, another agent) is not looked up."""
        return self.engine.book.record_of(rec.uid) is not None

    async def _sweep_by_namespace(self, source: ClaimLister, todo: list[ClaimSummary], collected: list[str]) -> None:
        by_namespace: dict[str, list[ClaimSummary]] = {}
        for rec in todo:
            by_namespace.setdefault(rec.namespace, []).append(rec)
        namespaces = sorted(by_namespace)
        for i in range(0, len(namespaces), SWEEP_WINDOW):
            window = namespaces[i:i + SWEEP_WINDOW]
            listed = await asyncio.gather(*(self._uids(source, ns) for ns in window))
            for namespace, uids in zip(window, listed, strict=True):
                recs = [rec for rec in by_namespace[namespace] if self._still_prepared(rec)]
                await self._judge(recs, [self._seen_in(rec, uids) for rec in recs], collected)

    @staticmethod
    async def _uids(source: ClaimLister, namespace: str) -> dict[str, str] | str:
        """The namespace's claims (name -> UID), or why they could not be read (never taken for gone)."""
        try:
            return await source.uids(namespace)
        except ClaimSourceError as exc:
            return str(exc)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _seen_in(rec: ClaimSummary, uids: dict[str, str] | str) -> tuple[str, str]:
        if isinstance(uids, str):
            return UNKNOWN, uids
        uid = uids.get(rec.name)
        if uid is None:
            return GONE, f"ResourceClaim {rec.namespace}/{rec.name} not found"
        if uid == rec.uid:
            return PRESENT, ""
        return GONE, f"the ResourceClaim {rec.namespace}/{rec.name} now has UID {uid}"

    async def _retry_leftovers(self) -> None:
        # Host changes an unprepare (this collector's too) could not undo: tried again, so a device whose
        # hardware came back loses its undo-failed taint without an operator.
        try:
            await asyncio.to_thread(self.engine.retry_leftovers)
        except Exception:
            log.exception("undoing leftover host changes failed")

    async def _judge(self, window: list[ClaimSummary], found: list[tuple[str, str]], collected: list[str]) -> None:
        for rec, (seen, why) in zip(window, found, strict=True):
            if seen == PRESENT:
                if self.gone_since.pop(rec.uid, None) is not None:
                    log.info("claim %s/%s (%s) exists again: not collected", rec.namespace, rec.name, rec.uid)
                continue
            if seen == UNKNOWN:
                log.debug("claim %s/%s (%s): %s; not judged this time", rec.namespace, rec.name, rec.uid, why)
                continue
            now = self.clock()
            since = self.gone_since.get(rec.uid)
            if since is None:
                since = self.gone_since[rec.uid] = now
                log.info("claim %s/%s (%s) is gone (%s): unprepared in %gs unless it comes back",
                         rec.namespace, rec.name, rec.uid, why, self.grace)
            if now - since > self.grace and await self.collect(rec, now - since):
                collected.append(rec.uid)

    async def observe(self, rec: ClaimSummary) -> tuple[str, str]:
        """(PRESENT | GONE | UNKNOWN, why) for the record's ResourceClaim."""
        try:
            obj = await self.source.get(rec.namespace, rec.name)
        except ClaimNotFound as exc:
            return GONE, str(exc)
        except ClaimSourceError as exc:
            return UNKNOWN, str(exc)
        except Exception as exc:  # never "gone" on anything but a clear answer
            return UNKNOWN, f"{type(exc).__name__}: {exc}"
        uid = _uid_of(obj)
        if uid == rec.uid:
            return PRESENT, ""
        if uid is None:
            return UNKNOWN, "the claim has no metadata.uid"
        return GONE, f"the ResourceClaim {rec.namespace}/{rec.name} now has UID {uid}"

    async def collect(self, rec: ClaimSummary, gone_for: float) -> bool:
        ref = ClaimRef(rec.namespace, rec.name, rec.uid)
        seen, why = await self.observe(rec)  # a last look, right before acting
        if seen != GONE:
            if seen == PRESENT:
                self.gone_since.pop(rec.uid, None)
            return False
        error = await self.engine.unprepare_claim(ref)
        if error:
            log.warning("garbage collection of %s failed: %s (tried again in %gs)", ref, error, self.interval)
            return False
        self.gone_since.pop(rec.uid, None)
        self.collected += 1
        if self.metrics is not None:
            self.metrics.claims_garbage_collected.inc()
        log.warning("garbage-collected %s: its ResourceClaim has been gone for %.0fs (%s)", ref, gone_for, why,
                    extra={"claim": f"{rec.namespace}/{rec.name}", "uid": rec.uid,
                           "devices": [d.device for d in rec.devices]})
        return True


def _uid_of(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    if isinstance(meta, Mapping) and isinstance(uid := meta.get("uid"), str) and uid:
        return uid
    return None

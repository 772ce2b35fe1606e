"""Garbage collection of prepared claims that no pod uses any more and whose ResourceClaim is gone.

The kubelet unprepares a claim when its pod goes; if that call never comes (the kubelet lost its
state, the node was drained while the agent was down), the claim's record and files would stay
forever. `ClaimCollector` sweeps the prepared claims at start and then every `interval` seconds (the
grace period, at least 0.1 s).

In a cluster a sweep asks the node, not the API server: the kubelet's pod resources service
(`PodClaims`, `agent.kube.podresources`) says which claims the pods on this node use now, by
namespace and name. A prepared claim a pod uses is left alone and costs no request. One that no pod
has used for the whole grace period is looked up by itself, one GET of that claim, just before it
would be collected: gone (not found, or that name now holds another UID: deleted and re-created) it is
unprepared; still there (a claim prepared ahead of its pod's binding, one the pod names but none of its
containers, one whose pod has ended but which the API server still holds) it is left prepared and its
clock starts over. So the agent never lists or watches claims for this: it reads only the claims it
prepared, and only those no pod on its node uses. Before, a sweep listed the claims of every namespace
holding claims prepared here, which needed `list` on every namespace's claims (docs/security.md).

When the kubelet does not answer (its socket absent: the pod resources directory is not mounted, or
the kubelet is not up), a sweep observes nothing and collects nothing: "no pod uses it" is never
guessed. The failure is logged once per streak, with what to do, and `dra-agent doctor` says it too.

Offline (`--offline DIR`) there is no kubelet to ask: every prepared claim is looked up in the claim
source (`DIR/resourceclaims`), a window at a time.

A claim deleted without an unprepare is so collected by the second sweep that finds it unused, between
one and two grace periods (and a sweep) after its pod went, never before one.

- A claim a pod uses, or that the API server (or the offline directory) holds with the same UID, is
  never collected, and its clock is reset.
- A failure (the kubelet not answering, ClaimSourceError: the API server down, a file that cannot be
  read or parsed) is no answer: the claim is not collected on it, and it resets nothing either. The
  grace period counts from the first observation of "unused" (offline: "gone").
- Where the first observation is kept: in memory. A restart therefore starts every grace period over,
  which only ever delays a collection, never hastens one; the records stay what prepare and unprepare
  alone write (no extra fsync'd writes, no format change, nothing two agents could disagree about).
- A collected claim is unprepared through the engine's normal path (`PrepareEngine.unprepare_claim`):
  it takes the claim's locks and treats the record as the truth, so it is safe beside a kubelet call
  for the same claim and beside a second agent on the node. One whose host changes cannot be undone
  (the hardware is gone) is unprepared all the same, as a kubelet unprepare is (`agent.claims.leftovers`);
  the undoing of such leftovers is tried again every sweep, and between sweeps every LEFTOVERS_INTERVAL
  (local work, no API request).
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
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

from agent.claims.book import ClaimSummary
from agent.claims.sources import ClaimNotFound, ClaimSource, ClaimSourceError
from agent.config import Settings
from agent.engine.prepare import PrepareEngine
from agent.metrics import Metrics
from agent.names import ClaimName, ClaimRef

log = logging.getLogger(__name__)

MIN_INTERVAL = 0.1
LEFTOVERS_INTERVAL = 60.0  # seconds between tries of undoing leftover host changes, sweeps or not
# Lookups a sweep has in flight at most. Offline a sweep reads every prepared claim (10,000 on a busy node):
# all at once, its reads (worker threads) would queue ahead of the kubelet's prepares in the default
# executor for seconds, and hold thousands of tasks and parsed claims in memory at once.
SWEEP_WINDOW = 8

PRESENT, GONE, UNKNOWN = "present", "gone", "unknown"


class PodClaims(Protocol):
    """Which claims the pods on this node use now (`agent.kube.podresources.PodResourcesClient`)."""

    async def claims_in_use(self) -> Collection[ClaimName]:
        """Every claim some pod on the node uses; raises, saying why, when that cannot be known now."""
        ...


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
    """Unprepares prepared claims no pod has used (offline: whose claim file has been gone) for longer
    than `grace` seconds, once a look at the claim finds it gone.

    `pods`: the kubelet's view (in a cluster); None reads every claim from `source` (offline).
    `sweep()` is one pass (tests call it with an injected `clock`); `run()` sweeps at once and then
    every `interval` seconds, for the daemon's background task.
    """

    def __init__(self, engine: PrepareEngine, grace: float, *, source: ClaimSource | None = None,
                 pods: PodClaims | None = None, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic, interval: float | None = None) -> None:
        self.engine = engine
        self.source: ClaimSource = source if source is not None else engine.claims
        self.pods = pods
        self.grace = grace
        self.interval = gc_interval(grace) if interval is None else interval
        self.metrics = metrics
        self.clock = clock
        # Claim UID -> first observed unused by every pod (offline: gone), clock time.
        self.gone_since: dict[str, float] = {}
        self.collected = 0
        self.blind: str | None = None  # why the last sweep could not ask the kubelet (logged once a streak)

    async def run(self) -> None:
        log.info("garbage collection of claims no pod uses and whose ResourceClaim is gone: grace %gs, every %gs "
                 "(%s)", self.grace, self.interval, "the kubelet's pod resources service says which claims pods "
                 "use" if self.pods is not None else "every claim looked up offline")
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
        if self.pods is not None:
            if not await self._sweep_by_pods(self.pods, todo, collected):
                return collected
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

    async def _sweep_by_pods(self, pods: PodClaims, todo: list[ClaimSummary], collected: list[str]) -> bool:
        """The claims no pod on the node uses, judged; False when the kubelet could not say (nothing judged)."""
        try:
            used = await pods.claims_in_use()
        except Exception as exc:  # never "unused" on anything but the kubelet's answer
            why = str(exc) or type(exc).__name__
            if self.blind is None:
                log.warning("garbage collection cannot tell which claims the pods on this node use, and collects "
                            "nothing until it can: %s", why)
            self.blind = why
            if self.metrics is not None:
                self.metrics.gc_skipped.inc()
            return False
        if self.blind is not None:
            log.info("garbage collection reads which claims the pods on this node use again")
            self.blind = None
        unused = []
        for rec in todo:
            if ClaimName(rec.namespace, rec.name) in used:
                if self.gone_since.pop(rec.uid, None) is not None:
                    log.info("%s is used by a pod on this node again: not collected", _ref(rec))
            else:
                unused.append(rec)
        now = self.clock()
        due = []
        for rec in unused:
            since = self.gone_since.get(rec.uid)
            if since is None:
                since = self.gone_since[rec.uid] = now
                log.info("%s is used by no pod on this node: looked up in %gs, and unprepared if its ResourceClaim "
                         "is gone, unless a pod uses it again", _ref(rec), self.grace)
            if now - since > self.grace:
                due.append((rec, now - since))
        for i in range(0, len(due), SWEEP_WINDOW):
            window = [(rec, unused_for) for rec, unused_for in due[i:i + SWEEP_WINDOW] if self._still_prepared(rec)]
            done = await asyncio.gather(*(self.collect(rec, unused_for) for rec, unused_for in window))
            collected += [rec.uid for (rec, _), ok in zip(window, done, strict=True) if ok]
        return True

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
        """(PRESENT | GONE | UNKNOWN, why) for the record's ResourceClaim: one read of that claim."""
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
        ref = _ref(rec)
        seen, why = await self.observe(rec)  # a last look, right before acting
        if seen != GONE:
            # Kept by the API server: whoever holds it (a pod not bound yet, a claim only the pod names), it is
            # not collected, and looked up again once unused for another grace period.
            if seen == PRESENT and self.gone_since.pop(rec.uid, None) is not None and self.pods is not None:
                log.info("%s is used by no pod on this node, but its ResourceClaim exists: left prepared", ref)
            return False
        error = await self.engine.unprepare_claim(ref)
        if error:
            log.warning("garbage collection of %s failed: %s (tried again in %gs)", ref, error, self.interval)
            return False
        self.gone_since.pop(rec.uid, None)
        self.collected += 1
        if self.metrics is not None:
            self.metrics.claims_garbage_collected.inc()
        said = ("no pod on this node has used it for %.0fs, and its ResourceClaim is gone (%s)" if self.pods is not None
                else "its ResourceClaim has been gone for %.0fs (%s)")
        log.warning("garbage-collected %s: " + said, ref, gone_for, why,
                    extra={"claim": f"{rec.namespace}/{rec.name}", "uid": rec.uid,
                           "devices": [d.device for d in rec.devices]})
        return True


def _ref(rec: ClaimSummary) -> ClaimRef:
    return ClaimRef(rec.namespace, rec.name, rec.uid)


def _uid_of(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    if isinstance(meta, Mapping) and isinstance(uid := meta.get("uid"), str) and uid:
        return uid
    return None

"""Keeping the inventory published: what a publisher is, and the loop that drives one.

`Publisher` is what the loop needs of a destination (`ApiPublisher` in `publisher.py`,
`DirectoryPublisher` in `publish_dir.py`); `SyncResult` is what one sync did and
`PublishError` a sync that did not complete. `PublishLoop` keeps the latest inventory
published whatever the API server does meanwhile. `log_result` and `owner_ref` are the
bits both publishers share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agent.kube import Backoff, NodeInfo
from agent.metrics import Metrics
from agent.model import Device
from agent.publish import slices

# The one logger of publishing, as before the publishers had modules of their own.
log = logging.getLogger("agent.publish.apiserver")


# Seconds between verifications of a watched pool (a LIST): a backstop for a watch that went quiet.
WATCHED_VERIFY_INTERVAL = 3600.0


class PublishError(RuntimeError):
    """A sync that did not complete; the next one starts from what is there."""


@dataclass(slots=True)
class SyncResult:
    generation: int = 0
    slices: int = 0
    devices: int = 0
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # validation problems, see slices.sanitize_device

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.deleted)


class Publisher(Protocol):
    async def sync(self, devices: Sequence[Device]) -> SyncResult: ...

    async def close(self) -> None: ...


@runtime_checkable
class WatchedPublisher(Publisher, Protocol):
    """A destination others may change too (the API server), whose changes can be watched: the loop then
    verifies when someone else changed the pool, not on a timer."""

    def versions(self) -> Mapping[str, str]:
        """name -> version of the pool's slices as the last completed sync left them."""
        ...

    def changes(self) -> AsyncIterator[tuple[str, str | None]]:
        """(name, version; None when deleted) of each change seen to the pool's slices, for ever."""
        ...


def owner_ref(node: NodeInfo) -> slices.NodeRef | None:
    return slices.NodeRef(node.name, node.uid) if node.uid else None


def log_result(where: str, result: SyncResult) -> None:
    if result.changed:
        log.info("published %d devices in %d slices to %s", result.devices, result.slices, where, extra={
            "generation": result.generation, "slices_created": len(result.created),
            "slices_updated": len(result.updated), "slices_deleted": len(result.deleted)})
    else:
        log.debug("slices in %s up to date (generation %d)", where, result.generation)


class PublishLoop:
    """Republishes on every inventory change, retries failures, and re-checks now and then.

    `run()` never returns on its own and survives any API failure: the agent keeps
    serving the kubelet while the API server is away, and catches up when it is back.
    """

    def __init__(self, publisher: Publisher, *, verify_interval: float = 300.0,
                 watched_verify_interval: float = WATCHED_VERIFY_INTERVAL,
                 backoff: Backoff | None = None, metrics: Metrics | None = None) -> None:
        self.publisher = publisher
        self.metrics = metrics
        # With a watch of the pool's slices, the timer is a backstop only (a watch that went quiet without
        # an error): what others change is seen as it happens.
        self.verify_interval = watched_verify_interval if isinstance(publisher, WatchedPublisher) \
            else verify_interval
        # Between syncs, not within one: attempts are unlimited, only the delay is capped.
        self.backoff = backoff or Backoff(initial=1.0, maximum=60.0)
        self._devices: list[Device] | None = None
        self._version = 0  # of the desired inventory
        self.published_version = 0
        self.last_result: SyncResult | None = None
        self.last_error: str = ""
        self.failures = 0
        self._wake = asyncio.Event()
        self._done = asyncio.Condition()
        # Told the devices of each sync that completed (the health stream stops reporting a device
        # that is gone from discovery once the published pool no longer holds it).
        self.on_published: Callable[[Sequence[Device]], None] | None = None
        self._syncing = False
        self._seen: dict[str, str | None] = {}  # slice changes seen during a sync, judged after it
        self._watch: asyncio.Task[None] | None = None
        # Run before a pool someone else changed is verified: the daemon rescans the devices. Another agent of
        # the node (a rolling update, docs/architecture.md "Overlapping agents") wrote what it scanned; were
        # this agent's inventory older (a GPU's MIG mode changed by the other's prepare since it scanned), the
        # verification would write it back over the other's, each would take the other's write for someone
        # else's, and the two would rewrite the pool for as long as they overlap. Both read the same devices.
        self.before_verify: Callable[[], Awaitable[object]] | None = None
        self._refresh: asyncio.Task[None] | None = None
        self._refresh_again = False

    def update(self, devices: Sequence[Device]) -> None:
        self._devices = list(devices)
        self._version += 1
        self._wake.set()

    def verify_now(self) -> None:
        """Compare what the API server holds with the inventory now, not at the next verification
        (someone else may have deleted the slices: a kubelet does at its start)."""
        self._wake.set()

    def seen(self, name: str, version: str | None) -> None:
        """A change to one of the pool's slices (version None: deleted). One that is not the pool as the
        last sync left it is someone else's (a kubelet at its start deletes its node's slices; an admin,
        another agent): verified now. Seen during a sync, it is judged once the sync is done, when our own
        writes' versions are known."""
        self._seen[name] = version
        if not self._syncing:
            self._judge_seen()

    def _judge_seen(self) -> None:
        if not isinstance(self.publisher, WatchedPublisher):
            return
        ours = self.publisher.versions()
        if any(ours.get(name) != version for name, version in self._seen.items()):
            log.info("the pool's ResourceSlices were changed by someone else: verifying them")
            self._verify_foreign()
        self._seen.clear()

    def _verify_foreign(self) -> None:
        if self.before_verify is None:
            self.verify_now()
        elif self._refresh is not None and not self._refresh.done():
            self._refresh_again = True  # a change seen during a refresh may postdate its scan
        else:
            self._refresh = asyncio.get_running_loop().create_task(self._refreshed(self.before_verify),
                                                                   name="slice-refresh")

    async def _refreshed(self, before: Callable[[], Awaitable[object]]) -> None:
        while True:
            self._refresh_again = False
            try:
                await before()
            except Exception:  # the verification still runs, with the inventory as it is
                log.exception("refreshing the inventory before verifying the pool failed")
            self.verify_now()
            if not self._refresh_again:
                return

    async def _watching(self, publisher: WatchedPublisher) -> None:
        async for name, version in publisher.changes():
            self.seen(name, version)

    @property
    def up_to_date(self) -> bool:
        return self._devices is not None and self.published_version == self._version

    async def wait_published(self) -> SyncResult:
        """Until the latest inventory given to `update` is published."""
        async with self._done:
            await self._done.wait_for(lambda: self.up_to_date)
        assert self.last_result is not None
        return self.last_result

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            for task in (self._watch, self._refresh):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            self._watch = self._refresh = None

    async def _run(self) -> None:
        delay: float | None = None
        while True:
            if delay is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake.clear()
            if self._devices is None:
                delay = None
                continue
            version, devices = self._version, self._devices
            started = time.monotonic()
            self._syncing = True
            try:
                result = await self.publisher.sync(devices)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._syncing = False
                self._seen.clear()  # the retry reads the slices anyway
                if self.metrics is not None:
                    self.metrics.published(time.monotonic() - started, ok=False)
                self.failures += 1
                self.last_error = str(exc)
                if not isinstance(exc, PublishError):
                    log.exception("publishing ResourceSlices failed unexpectedly")
                delay = self.backoff.delay(self.failures)
                log.warning("will retry publishing in %.1fs (%d failures in a row)", delay, self.failures)
                continue
            if self.metrics is not None:
                self.metrics.published(time.monotonic() - started, len(result.created), len(result.updated),
                                       len(result.deleted))
            self._syncing = False
            self._judge_seen()
            if self._watch is None and isinstance(self.publisher, WatchedPublisher):
                # Started once the pool is published: the watch's first events are then the pool as it is.
                self._watch = asyncio.get_running_loop().create_task(self._watching(self.publisher),
                                                                     name="slice-watch")
            self.failures = 0
            self.last_error = ""
            self.last_result = result
            self.published_version = version
            if self.on_published is not None:
                self.on_published(devices)
            async with self._done:
                self._done.notify_all()
            delay = self.verify_interval

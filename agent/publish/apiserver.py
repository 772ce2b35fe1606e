"""ResourceSlices out: to the API server, or to a directory when the agent runs offline.

Both publishers read what is there, let `slices.plan_pool` decide, and carry the
plan out: writes first (the new generation), deletes after, so a scheduler never
sees a pool with devices missing. An unchanged inventory costs one LIST and
writes nothing. `PublishLoop` keeps the latest inventory published whatever the
API server does meanwhile.

Creating a slice is idempotent. A create whose answer never came (a timeout, a
dropped connection, a 5xx) may still have been stored, and with `generateName` a
retry would store a second copy of the same devices. So the agent picks the name
itself, in the shape generateName would give it (`<driver>-<node>-` and five
random characters, `slices.new_slice_name`), and a retry sends the same name:
the API server's name uniqueness makes the retry a no-op (409 AlreadyExists) if
the first try was stored, however late that happened. Re-listing before the
retry would not do: a first try still in flight at the server is not listed yet
and is stored after the retry. A 409 on a retry is taken as our own first try
only when the stored object says what we sent; a 409 on a first try (or on
someone else's object) is a name collision, and a fresh name is drawn.

Copies that got in anyway (another agent, an older version of this one) are
removed by the next sync: `plan_pool` keeps one slice per chunk of the current
generation and deletes the others.

This module is the API-server publisher, `ApiPublisher`. The offline one,
`DirectoryPublisher`, is in `publish_dir.py`; `Publisher`, `SyncResult`,
`PublishError` and `PublishLoop` are in `publish_loop.py`. All of them are
importable from here too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import lightkube
from lightkube.resources.resource_v1 import ResourceSlice

from agent import kube
from agent.config import Settings
from agent.kube import Backoff, NodeInfo
from agent.model import Device
from agent.publish import slices
from agent.publish.directory import DirectoryPublisher
from agent.publish.loop import Publisher, PublishError, PublishLoop, SyncResult, log_result, owner_ref

__all__ = ["CONFLICT_ROUNDS", "ApiPublisher", "DirectoryPublisher", "PublishError", "PublishLoop", "Publisher",
           "SyncResult"]

log = logging.getLogger(__name__)

T = TypeVar("T")
CONFLICT_ROUNDS = 5  # re-reads after a 409 before a sync gives up


class _Conflict(Exception):
    pass


class ApiPublisher:
    def __init__(self, client: lightkube.AsyncClient, settings: Settings, node: NodeInfo, *,
                 backoff: Backoff | None = None) -> None:
        self.client = client
        self.driver = settings.driver_name
        self.groups = settings.compatibility_groups  # the cluster runs DRADeviceCompatibilityGroups
        self.node = node
        self.backoff = backoff or Backoff()
        self._reported: set[str] = set()

    async def sync(self, devices: Sequence[Device]) -> SyncResult:
        chunks = slices.chunk_devices(devices, reported=self._reported,
                                      compatibility_groups=self.groups)
        if chunks.errors:  # the API server would refuse the pool: the published one stays
            raise self._failed("the pool's slices break API rules: " + "; ".join(chunks.errors))
        for _ in range(CONFLICT_ROUNDS):
            try:
                result = await self._sync_once(chunks.slices)
            except _Conflict as exc:
                log.debug("ResourceSlice conflict, re-reading: %s", exc)
                continue
            result.devices, result.dropped = chunks.device_count, chunks.dropped
            log_result("the API server", result)
            return result
        raise self._failed(f"still conflicting after {CONFLICT_ROUNDS} re-reads")

    async def close(self) -> None:
        """The client belongs to the caller; slices stay published across restarts."""

    def _failed(self, why: str) -> PublishError:
        msg = f"publishing ResourceSlices of node {self.node.name} failed: {why}"
        log.error(msg)
        return PublishError(msg)

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One API request, retried while the failure is transient; 409 goes up as _Conflict."""
        failures = 0
        while True:
            try:
                return await fn()
            except Exception as exc:
                if kube.is_conflict(exc):
                    raise _Conflict(f"{what}: {kube.describe(exc)}") from exc
                failures += 1
                await self._pause(what, exc, failures)

    async def _pause(self, what: str, exc: Exception, failures: int) -> None:
        """Wait before the next try after a transient failure; PublishError for any other."""
        if not kube.is_retryable(exc):
            raise self._failed(f"{what}: {kube.describe(exc)}") from exc
        if failures >= self.backoff.attempts:
            raise self._failed(f"{what}: {kube.describe(exc)} ({failures} tries)") from exc
        delay = self.backoff.delay(failures, exc)
        log.warning("%s: %s; retrying in %.2fs", what, kube.describe(exc), delay)
        await asyncio.sleep(delay)

    async def _create(self, desired: Mapping[str, Any]) -> str:
        """Create one slice under a name chosen here (see the module docstring); its name."""
        what = "creating a ResourceSlice"
        name = slices.new_slice_name(self.driver, self.node.name)
        maybe_stored = False  # an earlier try under `name` got no clear answer
        failures = 0
        while True:
            try:
                # lightkube annotates from_dict as returning DictMixin; it returns an instance of the class.
                created = await self.client.create(cast(ResourceSlice, ResourceSlice.from_dict(_named(desired, name))))
            except Exception as exc:
                failures += 1
                if not kube.is_conflict(exc):
                    await self._pause(what, exc, failures)
                    maybe_stored = True
                    continue
                if maybe_stored and await self._holds(name, desired):
                    log.info("ResourceSlice %s was stored by an earlier try whose answer was lost", name)
                    return name
                # The name is someone else's: draw another (bounded, though a second clash is
                # already a one-in-millions event).
                if failures >= self.backoff.attempts:
                    raise self._failed(f"{what}: name {name} taken ({failures} tries)") from exc
                log.debug("ResourceSlice name %s is taken; drawing another", name)
                name, maybe_stored = slices.new_slice_name(self.driver, self.node.name), False
                continue
            return str(created.metadata.name) if created.metadata and created.metadata.name else name

    async def _holds(self, name: str, desired: Mapping[str, Any]) -> bool:
        """Whether the slice stored as `name` is `desired` (our own create, answered too late)."""
        async def read() -> dict[str, Any] | None:
            try:
                return kube.plain(await self.client.get(ResourceSlice, name))
            except Exception as exc:
                if kube.is_not_found(exc):
                    return None  # deleted meanwhile: the name is free again, a new one is as good
                raise

        found = await self._call(f"reading ResourceSlice {name}", read)
        return found is not None and slices.is_ours(found, driver=self.driver, node=self.node.name) \
            and slices.same_slice(found, desired)

    async def existing(self) -> dict[str, dict[str, Any]]:
        """This pool's slices by name, as the API server has them."""
        async def list_ours() -> list[dict[str, Any]]:
            found = self.client.list(ResourceSlice, fields={"spec.nodeName": self.node.name,
                                                            "spec.driver": self.driver})
            return [kube.plain(s) async for s in found]

        items = await self._call("listing ResourceSlices", list_ours)
        return {o["metadata"]["name"]: o for o in items
                if slices.is_ours(o, driver=self.driver, node=self.node.name)}

    async def _sync_once(self, chunks: list[slices.Chunk]) -> SyncResult:
        existing = await self.existing()
        plan = slices.plan_pool(existing, chunks, driver=self.driver, node=self.node.name,
                                owner=owner_ref(self.node))
        result = SyncResult(generation=plan.generation, slices=len(chunks))
        for write in plan.writes:
            if write.key is None:
                result.created.append(await self._create(write.obj))
            else:
                obj = _with_identity(write.obj, existing[write.key])
                await self._call(f"replacing ResourceSlice {write.key}", _bind(
                    self.client.replace, ResourceSlice.from_dict(obj)))
                result.updated.append(write.key)
        for name in plan.deletes:
            if await self._call(f"deleting ResourceSlice {name}", _bind(self._delete, name)):
                result.deleted.append(name)
        return result

    async def _delete(self, name: str) -> bool:
        try:
            await self.client.delete(ResourceSlice, name)
        except Exception as exc:
            if kube.is_not_found(exc):
                return False  # someone was quicker; gone is gone
            raise
        return True


def _bind(fn: Callable[..., Awaitable[T]], *args: Any) -> Callable[[], Awaitable[T]]:
    return lambda: fn(*args)


def _named(desired: Mapping[str, Any], name: str) -> dict[str, Any]:
    """`desired` under an explicit name; generateName stays, the API server ignores it next to a name."""
    obj = dict(desired)
    obj["metadata"] = {**(desired.get("metadata") or {}), "name": name}
    return obj


def _with_identity(desired: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """`desired` as a PUT over `current`: its name, and the resourceVersion we read (else 409)."""
    obj = dict(desired)
    meta = dict(desired.get("metadata") or {})
    cur = current.get("metadata") or {}
    meta["name"] = cur["name"]
    if cur.get("resourceVersion"):
        meta["resourceVersion"] = cur["resourceVersion"]
    obj["metadata"] = meta
    return obj

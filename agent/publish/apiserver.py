"""ResourceSlices out: to the API server, or to a directory when the agent runs offline.

Both publishers read what is there, let `slices.plan_pool` decide, and carry the
plan out: writes first (the new generation), deletes after, so a scheduler never
sees a pool with devices missing. An unchanged inventory costs one LIST and
writes nothing. `PublishLoop` keeps the latest inventory published whatever the
API server does meanwhile.

Creating a slice is idempotent. A create whose answer never came (a timeout, a
dropped connection, a 5xx) may still have been stored, and with `generateName` a
retry would store a second copy of the same devices. So the agent picks the name
itself, in the shape generateName would give it (`<driver>-<node>-<NN>-`, NN the
slice's place in the pool, and five random characters, `slices.new_slice_name`),
and a retry sends the same name:
the API server's name uniqueness makes the retry a no-op (409 AlreadyExists) if
the first try was stored, however late that happened. Re-listing before the
retry would not do: a first try still in flight at the server is not listed yet
and is stored after the retry. A 409 on a retry is taken as our own first try
only when the stored object says what we sent; a 409 on a first try (or on
someone else's object) is a name collision, and a fresh name is drawn.

Copies that got in anyway (another agent, an older version of this one) are
removed by the next sync: `plan_pool` keeps one slice per chunk of the current
generation and deletes the others.

What the API server stores is compared with what was sent (`agent.publish.dropped`):
a field it drops (its feature gate off) is logged once and no longer sent, so no
slice is rewritten for want of a field the server will not keep. A pool that
carries a field of a gate off by default is tried in a dry run before the first
write of the process, so that a slice without such a field never reaches a
scheduler next to devices that relied on it. A slice whose content was sent
before and is stored as the server stored it then is not sent again, whatever the
server changed in it.

This module is the API-server publisher, `ApiPublisher`. The offline one,
`DirectoryPublisher`, is in `publish_dir.py`; `Publisher`, `SyncResult`,
`PublishError` and `PublishLoop` are in `publish_loop.py`. All of them are
importable from here too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import lightkube
from lightkube.resources.resource_v1 import ResourceSlice

from agent import kube
from agent.computeshare import COMPUTE, COMPUTE_PERCENT
from agent.config import Settings
from agent.inventory import gpushare
from agent.kube import Backoff, NodeInfo
from agent.kube import watch as kubewatch
from agent.model import Device
from agent.publish import dropped, slices
from agent.publish.directory import DirectoryPublisher
from agent.publish.loop import Publisher, PublishError, PublishLoop, SyncResult, log_result, owner_ref

__all__ = ["CONFLICT_ROUNDS", "ApiPublisher", "DirectoryPublisher", "PublishError", "PublishLoop", "Publisher",
           "SyncResult"]

log = logging.getLogger(__name__)

T = TypeVar("T")
CONFLICT_ROUNDS = 5  # re-reads after a 409 before a sync gives up
# Seconds the API server keeps one watch of the node's slices open before it ends it and lightkube resumes:
# two requests an hour, where the slices were LISTed every minute.
WATCH_TIMEOUT = 1800


class _Conflict(Exception):
    pass


class _NewDrops(Exception):
    """The API server dropped a field not known to be dropped: the pool is planned again without it."""


class ApiPublisher:
    def __init__(self, client: lightkube.AsyncClient, settings: Settings, node: NodeInfo, *,
                 backoff: Backoff | None = None) -> None:
        self.client = client
        self.settings = settings
        self.driver = settings.driver_name
        self.groups = settings.compatibility_groups  # the cluster runs DRADeviceCompatibilityGroups
        self.vgpu_types = settings.vgpu_types
        self.node = node
        self.backoff = backoff or Backoff()
        self._reported: set[str] = set()
        self.dropped: set[str] = set()  # spec fields the API server drops (`dropped.dropped_fields` paths)
        self._probed = False  # a dry run has shown what the API server keeps of what is sent
        # Whether the API server counts fractional request policies in thousandths (DRAFractionalCapacityRange;
        # None: not asked yet). False: shared GPUs offer computePercent instead of compute (`agent.computeshare`).
        self.fractions: bool | None = None
        # Slice name -> what was last sent and what the server stored of it (`slices.comparable`).
        self._stored_as: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        self._said: set[str] = set()
        self._lists: set[str] = set()  # the attributes the pool sends as lists
        # Slice name -> the resourceVersion of the pool's slices as the last sync left them: the watch of
        # the node's slices (`changes`) tells a change of someone else's from the echo of our own writes.
        self._versions: dict[str, str] = {}

    async def sync(self, devices: Sequence[Device]) -> SyncResult:
        conflicts = 0
        while True:
            chunks = self._chunks(devices)
            if chunks.errors:  # the API server would refuse the pool: the published one stays
                raise self._failed("the pool's slices break API rules: " + "; ".join(chunks.errors))
            try:
                result = await self._sync_once(chunks.slices)
            except _Conflict as exc:
                conflicts += 1
                if conflicts >= CONFLICT_ROUNDS:
                    raise self._failed(f"still conflicting after {CONFLICT_ROUNDS} re-reads") from exc
                log.debug("ResourceSlice conflict, re-reading: %s", exc)
                continue
            except _NewDrops:
                continue  # planned again without the field; each field is learnt once, so this ends
            result.devices, result.dropped = chunks.device_count, chunks.dropped
            log_result("the API server", result)
            return result

    def _chunks(self, devices: Sequence[Device]) -> slices.Chunks:
        """The pool's slices, without the fields the API server drops."""
        groups = self.groups and dropped.COMPATIBILITY_GROUPS not in self.dropped
        if self.groups and not groups:
            devices = dropped.exact_without_groups(devices, self.vgpu_types)
        if self.fractions is False:
            devices = gpushare.percent_compute(devices)
        chunks = slices.chunk_devices(devices, reported=self._reported, compatibility_groups=groups,
                                      layout=dropped.layout(self.settings, self.node, self.dropped))
        self._lists = {name for chunk in chunks.slices if not isinstance(chunk, slices.CounterChunk)
                       for name in dropped.list_attributes({"devices": list(chunk)})}
        for chunk in chunks.slices if self.dropped else ():
            if isinstance(chunk, slices.CounterChunk):
                dropped.strip_counter_sets(chunk.sets, self.dropped)
            else:
                dropped.strip_devices(chunk, self.dropped)
        return chunks

    def _learn(self, sent: Mapping[str, Any], stored: Mapping[str, Any], what: str) -> None:
        """Compare what the API server stored (or would store) with what was sent; _NewDrops when it
        dropped a field not known to be dropped."""
        new = dropped.dropped_fields(sent.get("spec") or {}, stored.get("spec") or {}) - self.dropped
        for path in sorted(new):
            log.warning("the API server dropped spec.%s from %s (is its %s feature gate off?): not publishing "
                        "it any more", path, what, dropped.gate_of(path))
            if path == dropped.COMPATIBILITY_GROUPS and self.groups:
                log.warning("without compatibility groups, vGPU devices are published as --vgpu-types %r allows "
                            "on a cluster without them (none for auto; one type, and never beside MIG placements)",
                            self.vgpu_types)
        self.dropped |= new
        if new:
            raise _NewDrops()
        if not slices.same_slice(stored, sent):
            where = dropped.first_difference(slices.comparable(sent), slices.comparable(stored)) or "?"
            if where not in self._said:
                self._said.add(where)
                log.warning("the API server stored %s differently from what was sent (at %s); it is not sent "
                            "again while what would be sent stays the same", what, where)

    async def _probe(self, writes: Sequence[slices.SliceWrite]) -> None:
        """A dry run of each write before the first real one of this process (when they carry a field of
        a gate off by default): the fields the API server drops are known before a slice without them
        reaches a scheduler."""
        for write in writes:
            obj = dict(write.obj)
            obj["metadata"] = {k: v for k, v in (write.obj.get("metadata") or {}).items()
                               if k not in ("name", "resourceVersion")}
            async def dry_run(obj: dict[str, Any] = obj) -> ResourceSlice:
                return await self.client.create(cast(ResourceSlice, ResourceSlice.from_dict(obj)), dry_run=True)

            answer = await self._call("a dry run of a ResourceSlice", dry_run)
            self._learn(write.obj, kube.plain(answer), "a dry run of a ResourceSlice")
        self._probed = True

    async def _ask_fractions(self, like: Mapping[str, Any]) -> None:
        """Ask the API server, by a dry run, whether it counts fractional request policies in thousandths: it
        keeps the fields either way, and only its arithmetic tells (`dropped.FRACTION_PROBE`). Before the
        first write of a pool that has a fractional policy; _NewDrops when it does not, so the pool is
        planned again with whole numbers."""
        obj = {**like, "metadata": {k: v for k, v in (like.get("metadata") or {}).items()
                                    if k not in ("name", "resourceVersion")},
               "spec": {**{k: v for k, v in (like.get("spec") or {}).items() if k in ("driver", "pool", "nodeName")},
                        "devices": [dropped.FRACTION_PROBE]}}

        async def dry_run() -> dict[str, Any] | None:
            try:
                created = await self.client.create(cast(ResourceSlice, ResourceSlice.from_dict(obj)), dry_run=True)
            except Exception as exc:
                fields = kube.status_cause_fields(exc) if kube.status_code(exc) == 422 else []
                if fields and all(".requestPolicy" in f for f in fields):
                    return None  # refused for the probe's policy alone
                raise
            return kube.plain(created)

        answer = await self._call("a dry run of a ResourceSlice with a fractional request policy", dry_run)
        # Accepted: thousandths (or, with the policy left out of the answer, no request policies at all, with
        # DRAConsumableCapacity off, which the pool's own writes show). Refused: whole units.
        self.fractions = answer is not None
        if not self.fractions:
            log.warning("the API server counts request policies in whole units (is its %s feature gate off?): "
                        "shared GPUs offer %s (whole percentages) instead of %s", dropped.FRACTIONS_GATE,
                        COMPUTE_PERCENT, COMPUTE)
            raise _NewDrops()

    async def close(self) -> None:
        """The client belongs to the caller; slices stay published across restarts."""

    def _failed(self, why: str) -> PublishError:
        msg = f"publishing ResourceSlices of node {self.node.name} failed: {why}"
        log.error(msg)
        return PublishError(msg)

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One API request, retried while the failure is transient. 409, and 404 for a slice that was
        read (someone deleted it since: a kubelet does at its start), go up as _Conflict: the pool is
        read again and the sync planned again."""
        failures = 0
        while True:
            try:
                return await fn()
            except Exception as exc:
                if kube.is_conflict(exc) or kube.is_not_found(exc):
                    raise _Conflict(f"{what}: {kube.describe(exc)}") from exc
                failures += 1
                await self._pause(what, exc, failures)

    async def _pause(self, what: str, exc: Exception, failures: int) -> None:
        """Wait before the next try after a transient failure; PublishError for any other, and _NewDrops
        for the refusal of list attributes (`dropped.refuses_lists`)."""
        if dropped.refuses_lists(exc, self._lists):
            log.warning("the API server refused list values of %s in %s (is its %s feature gate off?): "
                        "publishing them in their scalar form", ", ".join(sorted(self._lists)), what,
                        dropped.gate_of(dropped.LIST_VALUES))
            self.dropped.add(dropped.LIST_VALUES)
            raise _NewDrops()
        if not kube.is_retryable(exc):
            raise self._failed(f"{what}: {kube.describe(exc)}") from exc
        if failures >= self.backoff.attempts:
            raise self._failed(f"{what}: {kube.describe(exc)} ({failures} tries)") from exc
        delay = self.backoff.delay(failures, exc)
        log.warning("%s: %s; retrying in %.2fs", what, kube.describe(exc), delay)
        await asyncio.sleep(delay)

    async def _create(self, desired: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """Create one slice under a name chosen here (see the module docstring); its name and the slice
        as stored."""
        what = "creating a ResourceSlice"
        # The slice's generateName holds its place in the pool (`slices.generate_name`): the name drawn
        # keeps it, so the pool's slices sort by name in the order they were split in.
        generate = str(desired["metadata"]["generateName"])
        name = slices.new_slice_name(generate)
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
                if maybe_stored and (found := await self._holds(name, desired)) is not None:
                    log.info("ResourceSlice %s was stored by an earlier try whose answer was lost", name)
                    return name, found
                # The name is someone else's: draw another (bounded, though a second clash is
                # already a one-in-millions event).
                if failures >= self.backoff.attempts:
                    raise self._failed(f"{what}: name {name} taken ({failures} tries)") from exc
                log.debug("ResourceSlice name %s is taken; drawing another", name)
                name, maybe_stored = slices.new_slice_name(generate), False
                continue
            stored = kube.plain(created)
            return str((stored.get("metadata") or {}).get("name") or name), stored

    async def _holds(self, name: str, desired: Mapping[str, Any]) -> dict[str, Any] | None:
        """The slice stored as `name` when it is `desired` (our own create, answered too late)."""
        async def read() -> dict[str, Any] | None:
            try:
                return kube.plain(await self.client.get(ResourceSlice, name))
            except Exception as exc:
                if kube.is_not_found(exc):
                    return None  # deleted meanwhile: the name is free again, a new one is as good
                raise

        found = await self._call(f"reading ResourceSlice {name}", read)
        ours = found is not None and slices.is_ours(found, driver=self.driver, node=self.node.name) \
            and slices.same_slice(found, desired)
        return found if ours else None

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
        for name in set(self._stored_as) - set(existing):
            del self._stored_as[name]
        writes = [w for w in plan.writes if not self._sent_before(w, existing)]
        if writes and self.fractions is None and any(dropped.fractional_policies(w.obj.get("spec") or {})
                                                     for w in writes):
            await self._ask_fractions(writes[0].obj)
        if writes and not self._probed and any(dropped.OFF_BY_DEFAULT & dropped.fields_of(w.obj.get("spec") or {})
                                                for w in writes):
            await self._probe(writes)
        result = SyncResult(generation=plan.generation, slices=len(chunks))
        written: dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
        for write in writes:
            if write.key is None:
                name, stored = await self._create(write.obj)
                result.created.append(name)
            else:
                obj = _with_identity(write.obj, existing[write.key])
                name = write.key
                stored = kube.plain(await self._call(f"replacing ResourceSlice {name}", _bind(
                    self.client.replace, ResourceSlice.from_dict(obj))))
                result.updated.append(name)
            self._stored_as[name] = (slices.comparable(write.obj), slices.comparable(stored))
            written[name] = (write.obj, stored)
            self._learn(write.obj, stored, f"ResourceSlice {name}")
        for name in plan.deletes:
            if await self._call(f"deleting ResourceSlice {name}", _bind(self._delete, name)):
                result.deleted.append(name)
        self._versions = {name: _version_of(obj) for name, obj in existing.items() if name not in plan.deletes}
        self._versions.update((name, _version_of(stored)) for name, (_, stored) in written.items())
        return result

    def versions(self) -> dict[str, str]:
        """The pool's slices (name -> resourceVersion) as the last completed sync left them."""
        return dict(self._versions)

    async def changes(self) -> AsyncIterator[tuple[str, str | None]]:
        """(name, resourceVersion, None once deleted) of every change to this node's slices of this driver:
        one field-selected watch of their metadata alone (`kubewatch.watch_forever`: an event that does not
        decode is skipped), resumed from the last version seen when the API server ends it or it fails (after
        a backoff). The first watch sends every slice as it is, and so does one started over after a 410."""
        async for event in kubewatch.watch_forever(
                self.client, ResourceSlice, "ResourceSlices", head=kubewatch.Head,
                fields={"spec.nodeName": self.node.name, "spec.driver": self.driver}, server_timeout=WATCH_TIMEOUT):
            meta = event.head.metadata
            if meta.name:
                yield meta.name, (None if event.type == "DELETED" else meta.resourceVersion)

    def _sent_before(self, write: slices.SliceWrite, existing: Mapping[str, Mapping[str, Any]]) -> bool:
        """Whether this rewrite would send what was sent before, to a slice still stored as the server
        stored it then (whatever the server changed in it, sending it again would change nothing)."""
        before = self._stored_as.get(write.key) if write.key is not None else None
        return before is not None and write.key is not None and before == (
            slices.comparable(write.obj), slices.comparable(existing[write.key]))

    async def _delete(self, name: str) -> bool:
        try:
            await self.client.delete(ResourceSlice, name)
        except Exception as exc:
            if kube.is_not_found(exc):
                return False  # someone was quicker; gone is gone
            raise
        return True


def _version_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


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

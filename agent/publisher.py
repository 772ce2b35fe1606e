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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import lightkube
import yaml
from lightkube.resources.resource_v1 import ResourceSlice

from agent import kube, slices
from agent.config import Settings
from agent.fsutil import atomic_write, is_temp_name, makedirs, unlink_quiet
from agent.kube import Backoff, NodeInfo
from agent.metrics import Metrics
from agent.model import Device

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_FILE_NAME = 255
CONFLICT_ROUNDS = 5  # re-reads after a 409 before a sync gives up


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


def _owner(node: NodeInfo) -> slices.NodeRef | None:
    return slices.NodeRef(node.name, node.uid) if node.uid else None


def _log_result(where: str, result: SyncResult) -> None:
    if result.changed:
        log.info("published %d devices in %d slices to %s", result.devices, result.slices, where, extra={
            "generation": result.generation, "slices_created": len(result.created),
            "slices_updated": len(result.updated), "slices_deleted": len(result.deleted)})
    else:
        log.debug("slices in %s up to date (generation %d)", where, result.generation)


# -- API server ---------------------------------------------------------------------------------

class _Conflict(Exception):
    pass


class ApiPublisher:
    def __init__(self, client: lightkube.AsyncClient, settings: Settings, node: NodeInfo, *,
                 backoff: Backoff | None = None) -> None:
        self.client = client
        self.driver = settings.driver_name
        self.node = node
        self.backoff = backoff or Backoff()
        self._reported: set[str] = set()

    async def sync(self, devices: Sequence[Device]) -> SyncResult:
        chunks = slices.chunk_devices(devices, reported=self._reported)
        for _ in range(CONFLICT_ROUNDS):
            try:
                result = await self._sync_once(chunks.slices)
            except _Conflict as exc:
                log.debug("ResourceSlice conflict, re-reading: %s", exc)
                continue
            result.devices, result.dropped = chunks.device_count, chunks.dropped
            _log_result("the API server", result)
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

    async def _sync_once(self, chunks: list[list[dict[str, Any]]]) -> SyncResult:
        existing = await self.existing()
        plan = slices.plan_pool(existing, chunks, driver=self.driver, node=self.node.name,
                                owner=_owner(self.node))
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


# -- offline directory --------------------------------------------------------------------------

_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def render_yaml(obj: Mapping[str, Any]) -> bytes:
    return yaml.dump(dict(obj), Dumper=_YAML_DUMPER, sort_keys=True, default_flow_style=False,
                     allow_unicode=True).encode()


def file_stem(driver: str, node: str) -> str:
    """`<driver>-<node>`, shortened with a digest where a file name would exceed NAME_MAX."""
    stem = f"{driver}-{node}"
    if len(stem) + len("-9999.yaml") <= MAX_FILE_NAME:
        return stem
    digest = hashlib.sha256(stem.encode()).hexdigest()[:16]
    return f"{stem[: MAX_FILE_NAME - 40]}-{digest}"


class DirectoryPublisher:
    """Slices as YAML files, `DIR/resourceslices/<driver>-<node>-<i>.yaml`: exactly what would be POSTed."""

    def __init__(self, directory: Path, settings: Settings, node: NodeInfo) -> None:
        self.dir = Path(directory) / "resourceslices"
        self.driver = settings.driver_name
        self.node = node
        self.stem = file_stem(self.driver, node.name)
        self._pattern = re.compile(re.escape(self.stem) + r"-(0|[1-9][0-9]*)\.yaml")
        self._reported: set[str] = set()

    async def sync(self, devices: Sequence[Device]) -> SyncResult:
        chunks = slices.chunk_devices(devices, reported=self._reported)
        try:
            result = await asyncio.to_thread(self._sync_blocking, chunks.slices)
        except OSError as exc:
            msg = f"writing ResourceSlices to {self.dir} failed: {exc}"
            log.error(msg)
            raise PublishError(msg) from exc
        result.devices, result.dropped = chunks.device_count, chunks.dropped
        _log_result(str(self.dir), result)
        return result

    async def close(self) -> None:
        pass

    def path(self, index: int) -> Path:
        return self.dir / f"{self.stem}-{index}.yaml"

    def existing(self) -> dict[str, bytes]:
        """This pool's files by stem, with their bytes."""
        found: dict[str, bytes] = {}
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return found
        for name in names:
            if self._pattern.fullmatch(name):
                with contextlib.suppress(FileNotFoundError):
                    found[name.removesuffix(".yaml")] = (self.dir / name).read_bytes()
            elif is_temp_name(name) and name.startswith(f".{self.stem}-"):
                unlink_quiet(self.dir / name)  # left by a crash mid-write
        return found

    def _sync_blocking(self, chunks: list[list[dict[str, Any]]]) -> SyncResult:
        makedirs(self.dir)
        raw = self.existing()
        existing = {key: _parse(data) for key, data in raw.items()}
        slots = [self.path(i).name.removesuffix(".yaml") for i in range(len(chunks))]
        plan = slices.plan_pool(existing, chunks, driver=self.driver, node=self.node.name,
                                owner=_owner(self.node), slots=slots)
        result = SyncResult(generation=plan.generation, slices=len(chunks))
        for write in plan.writes:
            assert write.key is not None  # slots give every chunk its file
            data = render_yaml(write.obj)
            if raw.get(write.key) == data:
                continue
            atomic_write(self.dir / f"{write.key}.yaml", data)
            (result.updated if write.key in raw else result.created).append(write.key)
        for key in plan.deletes:
            if unlink_quiet(self.dir / f"{key}.yaml"):
                result.deleted.append(key)
        return result


def _parse(data: bytes) -> dict[str, Any]:
    """A slice file's object; an unreadable one counts as an empty slice, so it gets rewritten."""
    try:
        obj = yaml.load(data, Loader=_YAML_LOADER)
    except yaml.YAMLError:
        return {}
    return obj if isinstance(obj, dict) else {}


# -- keeping it published -----------------------------------------------------------------------

class PublishLoop:
    """Republishes on every inventory change, retries failures, and re-checks now and then.

    `run()` never returns on its own and survives any API failure: the agent keeps
    serving the kubelet while the API server is away, and catches up when it is back.
    """

    def __init__(self, publisher: Publisher, *, verify_interval: float = 300.0,
                 backoff: Backoff | None = None, metrics: Metrics | None = None) -> None:
        self.publisher = publisher
        self.metrics = metrics
        self.verify_interval = verify_interval
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

    def update(self, devices: Sequence[Device]) -> None:
        self._devices = list(devices)
        self._version += 1
        self._wake.set()

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
            try:
                result = await self.publisher.sync(devices)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
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
            self.failures = 0
            self.last_error = ""
            self.last_result = result
            self.published_version = version
            async with self._done:
                self._done.notify_all()
            delay = self.verify_interval

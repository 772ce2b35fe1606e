"""Where a claim's `status.devices` entries go: the API server (server-side apply), or a file offline.

A sink makes this driver's entries of one claim exactly what it is given (none: remove
ours) and says how a failure should be taken: `StatusWriteFailed.retryable` for what
heals by itself (a 5xx, throttling, no connection), `ClaimGone` for a claim that was
deleted or re-created under the same name with another UID.

Online (`ApiStatusSink`): one server-side apply of the status subresource per write,
field manager = the driver name, `force=true`. The body names the claim's UID: applied
to a claim re-created under the same name, the API server refuses it (422, `metadata.uid`
is immutable), and a claim that is gone answers 404 (a subresource is never created by
an apply). `status.devices` is a map list keyed by driver, pool, device and shareID, so
the API server tracks which manager owns each entry: entries of other drivers are never
touched, and an apply without an entry we applied before removes it (unless another
manager also owns it). Unprepare therefore applies the object with no status at all.
A claim whose opaque parameters the API server stores other than as it encodes them (keys out
of order, spaces) refuses every apply (`status.allocation ... cannot be modified once set`): it
is written from then on by an update that keeps those bytes (`agent.health.statusupdate`),
replacing our entries only, logged once per claim.

Offline (`DirectoryStatusSink`): `DIR/resourceclaimstatus/<namespace>/<name>.yaml`, a
ResourceClaim object holding the status the API would hold after the apply (the claim
file's entries of other drivers, then ours), written atomically; removed when we have no
entries. The claim is read from `DIR/resourceclaims` first so that, as online, a claim
that is gone or has another UID is not written. The object is written as indented JSON,
which every YAML reader takes as it is (JSON is YAML's flow style): PyYAML's representer is
Python code and cost more CPU than the prepare it follows, a JSON encoder in C microseconds.
A file an older agent wrote in block style is still read back (its UID, before removal).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import orjson
import yaml

from agent import kube
from agent.claims.sources import ClaimNotFound, ClaimSource, ClaimSourceError, DirectoryClaimSource
from agent.fsutil import Root
from agent.names import ClaimRef

if TYPE_CHECKING:  # the API client is imported by the API sink's first write (`agent.kube`)
    import lightkube

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceClaim"
STATUS_DIR = "resourceclaimstatus"
NAME_MAX = 255
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

log = logging.getLogger(__name__)


class StatusWriteFailed(Exception):
    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class ClaimGone(StatusWriteFailed):
    """The claim no longer exists, or exists with another UID: nothing of ours to write there."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class StatusSink(Protocol):
    async def write(self, claim: ClaimRef, entries: Sequence[Mapping[str, Any]]) -> None:
        """Make this driver's entries in the claim's status.devices exactly `entries`."""
        ...

    async def read(self, claim: ClaimRef) -> list[dict[str, Any]]:
        """The claim's status.devices entries as they are now, every driver's; ClaimGone as `write`."""
        ...


def same_entries(entries: Sequence[Mapping[str, Any]], stored: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the entries `read` gave are these (the API server leaves out what is null)."""
    def plain(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items() if v is not None}
        return [plain(v) for v in value] if isinstance(value, list) else value

    def keyed(found: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], Any]:
        return {(str(e.get("device")), str(e.get("shareID") or "")): plain(e) for e in found}

    return keyed(entries) == keyed(stored)


def apply_body(claim: ClaimRef, entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The apply configuration: no status at all when we have no entries, so we own none."""
    body: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND,
                            "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid}}
    if entries:
        body["status"] = {"devices": [dict(e) for e in entries]}
    return body


class ApiStatusSink:
    def __init__(self, client: lightkube.AsyncClient, field_manager: str) -> None:
        self.client = client
        self.field_manager = field_manager  # the driver name: the entries' `driver` too
        # Claims whose status a server-side apply cannot change (`_allocation_refused`): written by update.
        self._by_update: set[str] = set()

    async def write(self, claim: ClaimRef, entries: Sequence[Mapping[str, Any]]) -> None:
        from lightkube.resources.resource_v1 import ResourceClaimStatus
        from lightkube.types import PatchType

        from agent.health import statusupdate

        if claim.uid not in self._by_update:
            try:
                await self.client.patch(ResourceClaimStatus, claim.name, apply_body(claim, entries),
                                        namespace=claim.namespace, patch_type=PatchType.APPLY,
                                        field_manager=self.field_manager, force=True)
                return
            except Exception as exc:
                if not _allocation_refused(exc):
                    _reraise(exc, claim, "applying")
                log.warning("status of %s: the API server refuses every server-side apply of it (%s), "
                            "since the claim's opaque parameters are not stored as it would encode them: writing "
                            "it by update, with the claim's stored bytes, from now on", claim, kube.describe(exc))
                self._by_update.add(claim.uid)
        try:
            await statusupdate.update_status(self.client, claim, self.field_manager, entries)
        except statusupdate.WrongIncarnation as exc:
            raise ClaimGone(str(exc)) from exc
        except statusupdate.UpdateConflict as exc:
            raise StatusWriteFailed(f"updating the status of {claim}: {exc}", retryable=True) from exc
        except Exception as exc:
            _reraise(exc, claim, "updating")
        if not entries:
            self._by_update.discard(claim.uid)

    async def read(self, claim: ClaimRef) -> list[dict[str, Any]]:
        from lightkube.resources.resource_v1 import ResourceClaim

        try:
            obj = await self.client.get(ResourceClaim, claim.name, namespace=claim.namespace)
        except Exception as exc:
            why = kube.describe(exc)
            if kube.is_not_found(exc):
                raise ClaimGone(f"{claim} is gone: {why}") from exc
            if kube.status_code(exc) is None and not kube.is_retryable(exc):
                raise
            raise StatusWriteFailed(f"reading the status of {claim}: {why}", retryable=kube.is_retryable(exc)) from exc
        return _entries_of(kube.plain(obj), claim)



def _entries_of(obj: Mapping[str, Any], claim: ClaimRef) -> list[dict[str, Any]]:
    """The status.devices entries of `claim`'s incarnation (ClaimGone for another one)."""
    meta = obj.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    if uid != claim.uid:
        raise ClaimGone(f"ResourceClaim {claim.namespace}/{claim.name} now has UID {uid!r}, not {claim.uid}")
    status = obj.get("status")
    found = status.get("devices") if isinstance(status, Mapping) else None
    return [dict(e) for e in found or [] if isinstance(e, Mapping)]


def _reraise(exc: Exception, claim: ClaimRef, doing: str) -> NoReturn:
    """A failed write of the claim's status, raised as what it means to the writer."""
    why = kube.describe(exc)
    if kube.is_not_found(exc):
        raise ClaimGone(f"{claim} is gone: {why}") from exc
    if kube.is_conflict(exc) or _uid_refused(exc):
        raise ClaimGone(f"ResourceClaim {claim.namespace}/{claim.name} is another incarnation than UID {claim.uid}: "
                        f"{why}") from exc
    if kube.status_code(exc) is None and not kube.is_retryable(exc):
        raise exc  # neither an API answer nor a connection failure: a bug, not a status to report
    if _allocation_refused(exc):
        why += (" (the claim's opaque parameters are stored other than as the API server encodes them, and even "
                "an update with those bytes was refused)")
    raise StatusWriteFailed(f"{doing} the status of {claim}: {why}", retryable=kube.is_retryable(exc)) from exc


def _allocation_refused(exc: BaseException) -> bool:
    """The API server 1.37's answer to a status write of a claim whose opaque parameters it stores other than
    as it encodes them (`agent.health.statusupdate`): the allocation, which the write does not touch, is
    found changed after decoding."""
    return kube.status_code(exc) == 422 and "status.allocation" in kube.describe(exc) \
        and "cannot be modified" in kube.describe(exc)


def _uid_refused(exc: BaseException) -> bool:
    """A 422 whose cause is `metadata.uid`: the API server's answer to an apply naming another UID."""
    from lightkube.core.exceptions import ApiError

    if not isinstance(exc, ApiError) or kube.status_code(exc) != 422 or exc.status is None:
        return False
    causes = (exc.status.details.causes if exc.status.details else None) or []
    return any(c.field == "metadata.uid" for c in causes) or "metadata.uid" in (exc.status.message or "")


class DirectoryStatusSink:
    def __init__(self, directory: Path, claims: DirectoryClaimSource | None = None) -> None:
        """`claims`: the engine's source of the same directory, whose parsed claims serve both."""
        self.root = Root(Path(directory) / STATUS_DIR)
        self.claims = claims or DirectoryClaimSource(directory)

    def path(self, claim: ClaimRef) -> Path:
        """`<namespace>/<name>.yaml`; a name too long for one file name is shortened with a digest
        (the object inside names the claim)."""
        name = f"{claim.name}.yaml"
        if len(os.fsencode(name)) > NAME_MAX:
            digest = hashlib.sha256(claim.name.encode()).hexdigest()[:16]
            name = f"{claim.name[:200]}-{digest}.yaml"
        return self.root.path / claim.namespace / name

    async def write(self, claim: ClaimRef, entries: Sequence[Mapping[str, Any]]) -> None:
        try:
            await asyncio.to_thread(self._write_blocking, claim, entries)
        except OSError as exc:
            raise StatusWriteFailed(f"writing the status of {claim} under {self.root.path}: {exc}",
                                    retryable=True) from exc

    async def read(self, claim: ClaimRef) -> list[dict[str, Any]]:
        try:
            return await asyncio.to_thread(self._read_blocking, claim)
        except OSError as exc:
            raise StatusWriteFailed(f"reading the status of {claim} under {self.root.path}: {exc}",
                                    retryable=True) from exc

    def _read_blocking(self, claim: ClaimRef) -> list[dict[str, Any]]:
        """What the status file holds (the claim file's, before any write of ours)."""
        current = self._claim(claim)
        written = self._stored(self.path(claim))
        return _entries_of(written if written is not None else current, claim)

    def _claim(self, claim: ClaimRef) -> dict[str, Any]:
        try:
            return self.claims.read(claim.namespace, claim.name)
        except ClaimNotFound as exc:
            raise ClaimGone(str(exc)) from exc
        except ClaimSourceError as exc:
            raise StatusWriteFailed(str(exc), retryable=True) from exc

    def _write_blocking(self, claim: ClaimRef, entries: Sequence[Mapping[str, Any]]) -> None:
        path = self.path(claim)
        if not entries:
            if self._uid_in(path) in (claim.uid, None):  # never another incarnation's file
                self.root.unlink(path)
                self.root.remove_empty_dirs(path.parent, stop=0)
            return
        current = self._claim(claim)
        ours = {e["driver"] for e in entries}
        theirs = [e for e in _entries_of(current, claim) if e.get("driver") not in ours]
        obj = apply_body(claim, [*theirs, *entries])
        self.root.write(path, orjson.dumps(obj, option=orjson.OPT_INDENT_2) + b"\n")

    def _uid_in(self, path: Path) -> str | None:
        """The UID the status file names; None when there is no (readable) file."""
        doc = self._stored(path)
        meta = doc.get("metadata") if doc is not None else None
        return str(meta.get("uid")) if isinstance(meta, Mapping) else None

    def _stored(self, path: Path) -> dict[str, Any] | None:
        """The object in a status file; None when there is no (readable) file."""
        try:
            data = self.root.read(path)
        except OSError:
            return None
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:  # block style, from an older agent
            try:
                doc = yaml.load(data, Loader=_LOADER)
            except yaml.YAMLError:
                return None
        return dict(doc) if isinstance(doc, Mapping) else None


def sink_for(client: lightkube.AsyncClient | None, offline: Path | None, driver: str,
             claims: ClaimSource | None = None) -> StatusSink:
    """The sink of a connection (`agent.app.connection.Connection`: its `client` and `offline`);
    `claims`: the engine's claim source, whose parsed claims an offline sink reads too."""
    if offline is not None:
        return DirectoryStatusSink(offline, claims if isinstance(claims, DirectoryClaimSource) else None)
    assert client is not None
    return ApiStatusSink(client, driver)

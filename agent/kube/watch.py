"""A watch of the API server that no object can stop (`watch_forever`), for the agent's two watches: this
node's ResourceSlices (`agent.publish.apiserver`) and, with `--binding-conditions`, every ResourceClaim
(`agent.claims.watch`).

The objects are other people's: anyone who may create a ResourceClaim chooses its opaque parameters, free
JSON up to 10 KiB that the API server stores however deeply it nests. So each event's line is read in
steps, each cheaper than the next and none trusting the line:

1. its head (`Head`, or the consumer's subclass of it: the metadata and the few fields the consumer
   filters on), every other field skipped by the decoder, nothing built of it;
2. the consumer's filter (`wanted`) on the head: an event of another node's claim is dropped here,
   before its configuration is decoded at all;
3. only then, and only when asked, the whole object.

An event that does not decode (msgspec, the decoder, recurses once per nesting level and gives up with a
`RecursionError` near Python's recursion limit: a claim nested 1,500 levels deep in 3 KB did that) has its
head read again from a copy of the line with everything nested deeper than `HEAD_DEPTH` cut away
(`_flattened`, no recursion). It is then skipped, logged once while it exists when the consumer wants it,
and the watch goes on from that event's resourceVersion. Before, such an event ended the watch, the next
one started without a resourceVersion (every claim of the cluster sent again), the poisoned claim ended
that one too, and the claims after it were never delivered (docs/security.md).

A watch that fails starts again from the last resourceVersion it saw; only a 410 (the version is gone
from the API server's history) starts it over, every object sent again. Its failures are forgotten only
once a watch has stayed up `HEALTHY` seconds, not at its first event: a watch that delivers one event and
fails backs off as much as one that fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import msgspec

from agent import kube
from agent.kube import Backoff

if TYPE_CHECKING:
    import lightkube

log = logging.getLogger(__name__)

EventType = Literal["ADDED", "MODIFIED", "DELETED"]
_TYPES: Mapping[str, EventType] = {"ADDED": "ADDED", "MODIFIED": "MODIFIED", "DELETED": "DELETED"}
HEALTHY = 60.0  # seconds a watch stays up before its failures are forgotten
HEAD_DEPTH = 32  # nesting kept of an object read for its head alone (a head's fields are a few levels deep)
GONE = 410  # the resourceVersion resumed from is no longer in the API server's history
READ_MARGIN = 30.0  # seconds beyond the server's own timeout a watch may stay silent before it is given up


class ObjectMeta(msgspec.Struct, frozen=True):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""


class Head(msgspec.Struct, frozen=True):
    """What a watch reads of every event's object first. A consumer that filters on more fields subclasses
    it; every field must have a default (an object without it is still read)."""

    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)

    def named(self) -> str:
        m = self.metadata
        return f"{m.namespace}/{m.name}" if m.namespace else m.name


H = TypeVar("H", bound=Head)


class _Kind(msgspec.Struct):
    type: str = ""


class _Event(msgspec.Struct, Generic[H]):
    type: str
    object: H


class _Whole(msgspec.Struct):
    object: dict[str, Any]


class _Status(msgspec.Struct):
    code: int = 0
    reason: str = ""
    message: str = ""


class _StatusEvent(msgspec.Struct):
    object: _Status


@dataclass(frozen=True, slots=True)
class WatchEvent(Generic[H]):
    type: EventType
    head: H
    object: Mapping[str, Any] | None  # the whole object as JSON when the watch was asked for it (`whole`)


class WatchError(Exception):
    """The API server ended a watch with an ERROR event."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(f"the API server ended the watch: {code} {message}".strip())


_DECODE_ERRORS = (msgspec.DecodeError, RecursionError)  # msgspec.ValidationError is a DecodeError

# A JSON string (its escapes included), or a run of opening or of closing brackets: what `_flattened` walks
# over, a run at a time (a deep value is mostly runs: 1,500 levels in two of them).
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]+|[\]}]+')


def _flattened(text: str, depth: int) -> str:
    """`text` (JSON) with every value nested deeper than `depth` replaced by null, found by a regular
    expression over its strings and brackets: no recursion, whatever the nesting."""
    parts: list[str] = []
    kept = 0  # text[kept:] is not in parts yet
    level = 0
    cut = 0  # where the value being replaced starts
    for match in _TOKENS.finditer(text):
        start, end = match.span()
        first = text[start]
        if first == '"':
            continue
        run = end - start
        if first in "[{":
            if level <= depth < level + run:  # this run opens the value at depth + 1
                cut = start + depth - level
            level += run
        else:
            if level - run <= depth < level:  # this run closes it
                parts += (text[kept:cut], "null")
                kept = start + level - depth
            level -= run
    parts.append(text[kept:])
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class _Read(Generic[H]):
    version: str  # the resourceVersion to resume from after this line ("" when it names none)
    event: WatchEvent[H] | None  # what the consumer gets, if anything


class _Reader(Generic[H]):
    """One watch's lines, read as the module says."""

    def __init__(self, what: str, head: type[H], wanted: Callable[[H], bool] | None, whole: bool) -> None:
        self.what = what
        self.wanted = wanted
        self.whole = whole
        self._kinds = msgspec.json.Decoder(_Kind)
        self._heads = msgspec.json.Decoder(_Event[head])  # type: ignore[valid-type]
        self._metas = msgspec.json.Decoder(_Event[Head])
        self._statuses = msgspec.json.Decoder(_StatusEvent)
        self._wholes = msgspec.json.Decoder(_Whole)
        self._skipped: set[str] = set()  # UIDs of objects logged as skipped, while they exist

    def read(self, line: str) -> _Read[H]:
        if not line.strip():
            return _Read("", None)
        try:
            kind = self._kinds.decode(line).type
            if kind == "ERROR":
                status = self._statuses.decode(line).object
                raise WatchError(status.code, status.message or status.reason)
            event: _Event[H] = self._heads.decode(line)
        except _DECODE_ERRORS as exc:
            return self._undecodable(line, exc)
        return self._wanted(line, event)

    def _wanted(self, line: str, event: _Event[H]) -> _Read[H]:
        version = event.object.metadata.resourceVersion
        known = _TYPES.get(event.type)
        if known is None or (self.wanted is not None and not self.wanted(event.object)):
            return _Read(version, None)  # a bookmark; or not the consumer's: dropped before any more is decoded
        whole = None
        if self.whole:
            try:
                whole = self._wholes.decode(line).object
            except _DECODE_ERRORS as exc:
                return self._skip(known, event.object, exc)
        return _Read(version, WatchEvent(known, event.object, whole))

    def _undecodable(self, line: str, exc: BaseException) -> _Read[H]:
        short = _flattened(line, HEAD_DEPTH)
        try:
            event: _Event[H] = self._heads.decode(short)
        except _DECODE_ERRORS:
            pass
        else:
            known = _TYPES.get(event.type)
            if known is None or (self.wanted is not None and not self.wanted(event.object)):
                if known == "DELETED":  # said while it was the consumer's, perhaps: forgotten now it is gone
                    self._skipped.discard(event.object.metadata.uid or event.object.named())
                return _Read(event.object.metadata.resourceVersion, None)
            return self._skip(known, event.object, exc)
        try:
            meta = self._metas.decode(short)  # whether it is the consumer's is unknown: said, as if it were
        except _DECODE_ERRORS:
            log.warning("watching %s: skipping an event of %d characters that does not decode (%s)", self.what,
                        len(line), _why(exc))
            return _Read("", None)
        known = _TYPES.get(meta.type)
        if known is None:
            return _Read(meta.object.metadata.resourceVersion, None)
        return self._skip(known, meta.object, exc)

    def _skip(self, kind: EventType, head: Head, exc: BaseException) -> _Read[H]:
        """An event the consumer would have had, but whose object does not decode: said once per object."""
        key = head.metadata.uid or head.named()
        if key not in self._skipped:
            log.warning("watching %s: skipping %s (uid %s, resourceVersion %s): its object does not decode (%s)",
                        self.what, head.named() or "an unnamed object", head.metadata.uid or "none",
                        head.metadata.resourceVersion or "none", _why(exc))
        if kind == "DELETED":
            self._skipped.discard(key)
        else:
            self._skipped.add(key)
        return _Read(head.metadata.resourceVersion, None)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def _lines(client: lightkube.AsyncClient, resource: type[Any], version: str, *, namespace: str | None,
                 fields: Mapping[str, str] | None, server_timeout: int | None) -> AsyncGenerator[str, None]:
    """The lines of one watch request, from `version` ("": every object first)."""
    import httpx2
    from lightkube.core.selector import build_selector

    # The request as lightkube's own watch makes it (its URL rules, credentials and connection); the lines are
    # read here, not by lightkube, whose watch decodes each whole and ends at the first it cannot. No bookmarks:
    # asked for them without a resourceVersion, the API server 1.37.2 sent one and then no event at all
    # (docs/tests.md, "What the real components do that the emulator does not model").
    api = client._client
    request = api.prepare_request("list", res=resource, namespace=namespace, watch=True, params={
        "timeoutSeconds": server_timeout, "resourceVersion": version or None,
        "fieldSelector": build_selector(dict(fields), for_fields=True) if fields else None})
    base = api._watch_timeout
    request.timeout = httpx2.Timeout(connect=base.connect, write=base.write, pool=base.pool,
                                     read=server_timeout + READ_MARGIN if server_timeout else None)
    response = await api._client.send(api.build_adapter_request(request), stream=True)
    try:
        if response.is_error:
            await response.aread()
            api.raise_for_status(response)  # type: ignore[no-untyped-call]  # an ApiError, as lightkube's calls raise
        async for line in response.aiter_lines():
            yield line
    finally:
        await response.aclose()


async def watch_forever(client: lightkube.AsyncClient, resource: type[Any], what: str, *, head: type[H],
                        wanted: Callable[[H], bool] | None = None, whole: bool = False,
                        backoff: Backoff | None = None, namespace: str | None = None,
                        fields: Mapping[str, str] | None = None,
                        server_timeout: int | None = None) -> AsyncIterator[WatchEvent[H]]:
    """Every object of `resource` (in `namespace`, `lightkube.ALL_NS` for all; selected by `fields`), then
    every change, for ever: the events whose head (`head`) `wanted` accepts, each with its whole object when
    `whole`. The caller cancels it; `what` names it in the log."""
    backoff = backoff or Backoff(initial=1.0, maximum=30.0)
    reader = _Reader(what, head, wanted, whole)
    loop = asyncio.get_running_loop()
    version = ""
    failures = 0
    while True:
        started = loop.time()
        failure: BaseException | None = None
        try:
            async with contextlib.aclosing(_lines(client, resource, version, namespace=namespace, fields=fields,
                                                  server_timeout=server_timeout)) as lines:
                async for line in lines:
                    read = reader.read(line)
                    version = read.version or version
                    if read.event is not None:
                        yield read.event
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure = exc
            if kube.status_code(exc) == GONE or (isinstance(exc, WatchError) and exc.code == GONE):
                version = ""
        lasted = loop.time() - started
        if lasted >= HEALTHY:
            failures = 0
            if failure is None:
                continue  # the server ended a watch that ran its time: resumed at once
        failures += 1
        delay = backoff.delay(failures, failure)
        log.warning("watching %s %s after %.0fs; watching again in %.1fs from %s", what,
                    f"failed ({kube.describe(failure)})" if failure is not None else "ended", lasted, delay,
                    f"resourceVersion {version}" if version else "the start (every object again)")
        await asyncio.sleep(delay)

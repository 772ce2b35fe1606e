"""A Kubernetes API emulator over real HTTP, for the agent's API code paths.

Built on kmock's KubernetesEmulator (its HTTP server, request parsing, object
history, discovery and watch streams) with what the agent's client relies on
and the stock emulator leaves out: server-chosen names for generateName, uid,
creationTimestamp, a resourceVersion that moves on every write and a 409 for a
PUT carrying a stale one, PUT replace, DELETE, the status subresource, field and
label selectors on LIST, server-side apply of a ResourceClaim's status.devices with per-manager
ownership of its entries and the API server's validation of them (kubeapi_ssa.py,
kubeapi_rules.py), and fault injection (the next N matching requests
answer an error, or hang first, or are carried out and then lose their answer).
ResourceSlices are checked against the 1.37 OpenAPI schema on every write, as the
API server would reject a bad one. SelfSubjectAccessReviews are answered from a
set of denied (verb, group, resource) triples: everything else is allowed.

Use the `kube_api` fixture (registered in conftest.py): it yields a `KubeApi`.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import fnmatch
import itertools
import json
import random
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import attrs
import httpx2
import kmock
import kubernetes_validate
import lightkube
import pytest_asyncio
import yaml
from kubeapi_rules import (
    ApiAnswer,
    device_status_causes,
    drop_disabled_slice_fields,
    field_matcher,
    invalid_answer,
    label_matcher,
    merge_patch,
    status_body,
)
from kubeapi_ssa import APPLY, apply_devices, check_apply_body, field_manager, update_owners, with_owners
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User

K8S_VERSION = "1.37.0"
JSON = {"Content-Type": "application/json"}  # exactly, as the API server says it (lightkube checks)
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what the API server draws generated suffixes from


@dataclass(frozen=True)
class Kind:
    resource: kmock.resource
    kind: str
    namespaced: bool
    status: bool  # has the status subresource
    fields: frozenset[str]  # supported field selector keys
    schema_checked: bool = False

    @property
    def api_version(self) -> str:
        group, version = self.resource.group, self.resource.version
        return f"{group}/{version}" if group else str(version)


NODES = kmock.resource("", "v1", "nodes")
RESOURCE_SLICES = kmock.resource("resource.k8s.io", "v1", "resourceslices")
RESOURCE_CLAIMS = kmock.resource("resource.k8s.io", "v1", "resourceclaims")

KINDS: dict[kmock.resource, Kind] = {
    k.resource: k for k in (
        Kind(NODES, "Node", namespaced=False, status=True, fields=frozenset({"metadata.name"})),
        Kind(RESOURCE_SLICES, "ResourceSlice", namespaced=False, status=False,
             fields=frozenset({"metadata.name", "spec.nodeName", "spec.driver"}), schema_checked=True),
        Kind(RESOURCE_CLAIMS, "ResourceClaim", namespaced=True, status=True,
             fields=frozenset({"metadata.name", "metadata.namespace"})),
    )
}
_BY_KIND = {(k.api_version, k.kind): k for k in KINDS.values()}
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


@dataclass
class Fault:
    """The next `times` requests matching `method` and the `path` glob answer `status` (after `hang` s).

    `status` None with a `hang` delays the request and then serves it normally, like a slow server.
    `lose_answer` serves it first (a write takes effect) and only then hangs `hang` seconds, or drops
    the connection when `hang` is 0: a server that committed while the client gave up waiting.
    """

    method: str
    path: str
    times: int = 1
    status: int | None = 500
    hang: float = 0.0
    headers: Mapping[str, str] = field(default_factory=dict)
    gate: asyncio.Event | None = None  # held until the test sets it
    lose_answer: bool = False
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (self.method in ("*", method.upper())) and fnmatch.fnmatchcase(path, self.path)


@dataclass
class Logged:
    method: str
    path: str
    params: dict[str, str]
    body: Any
    status: int | None = None  # None when the connection dropped before an answer

    def __str__(self) -> str:
        return f"{self.method} {self.path} -> {self.status}"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class KubeApiEmulator(kmock.KubernetesEmulator):
    """The handler: state, semantics and faults. `KubeApi` runs it on a port."""

    log: list[Logged] = attrs.field(factory=list, init=False)
    faults: list[Fault] = attrs.field(factory=list, init=False)
    _revision: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    resource_version: int = attrs.field(default=0, init=False)
    in_flight: int = attrs.field(default=0, init=False)
    # Play a server (or proxy) that drops field selectors, so clients must filter what they get.
    ignore_field_selectors: bool = attrs.field(default=False, init=False)
    max_in_flight: int = attrs.field(default=0, init=False)
    denied: set[tuple[str, str, str]] = attrs.field(factory=set, init=False)  # (verb, group, resource)
    gates: set[str] = attrs.field(factory=set, init=False)  # alpha feature gates turned on (kubeapi_rules)
    _background: set[asyncio.Task[Any]] = attrs.field(factory=set, init=False)  # held requests

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for kind in KINDS.values():
            self.resources[kind.resource] = kmock.ResourceInfo(
                kind=kind.kind, namespaced=kind.namespaced, singular=kind.kind.lower(),
                verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
                subresources={"status"} if kind.status else set())
        # Above the stock emulator's own handlers (plain fallbacks), below anything a test adds.
        (self.fallback ** 1)[lambda request: request.resource in KINDS] << self._serve
        (self.fallback ** 1)[f"post {ACCESS_REVIEWS}"] << self._review_access

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._handle_counted(request)
        finally:
            self.in_flight -= 1

    async def _handle_counted(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        entry = Logged(str(request.method.value), request.url.path, dict(request.params), request.data)
        self.log.append(entry)
        fault = next((f for f in self.faults if f.times > 0 and f.matches(entry.method, entry.path)),
                     None)
        if fault is not None and fault.lose_answer:
            fault.times -= 1
            fault.hits += 1
            return await self._serve_and_lose(request, entry, fault.hang)
        if fault is not None:
            fault.times -= 1
            fault.hits += 1
            if fault.status is None:
                # Held, then carried out even when the client has given up meanwhile (aiohttp
                # cancels the handler then): a request the server accepted runs to its end, as a
                # write on its way to storage does.
                task = asyncio.create_task(self._held(request, entry, fault))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                return await asyncio.shield(task)
            if fault.hang:
                await asyncio.sleep(fault.hang)
            if fault.gate is not None:
                await fault.gate.wait()
            entry.status = fault.status
            reason = _REASONS.get(fault.status, "InternalError")
            body = status_body(fault.status, reason, "injected fault")
            return aiohttp.web.Response(status=fault.status, body=json.dumps(body).encode(),
                                        headers={**JSON, **fault.headers})
        return await self._carry_out(request, entry)

    async def _carry_out(self, request: kmock.Request, entry: Logged) -> aiohttp.web.StreamResponse:
        try:
            # The stock emulator records writes before dispatching, with semantics this one replaces.
            response = await kmock.RawHandler._handle(self, request)
        except kmock.KubernetesError as exc:
            entry.status = exc.status
            raise
        entry.status = response.status
        return response

    async def _held(self, request: kmock.Request, entry: Logged, fault: Fault) -> aiohttp.web.StreamResponse:
        if fault.hang:
            await asyncio.sleep(fault.hang)
        if fault.gate is not None:
            await fault.gate.wait()
        return await self._carry_out(request, entry)

    async def _serve_and_lose(self, request: kmock.Request, entry: Logged,
                              hang: float) -> aiohttp.web.StreamResponse:
        response = await self._carry_out(request, entry)
        entry.status = None  # what the server did is in its state; the client never hears of it
        if hang:
            await asyncio.sleep(hang)  # the client's timeout runs out first
        elif request._raw_request is not None and request._raw_request.transport is not None:
            request._raw_request.transport.close()
        return response

    # -- dispatch -------------------------------------------------------------------------------

    async def _serve(self, request: kmock.Request) -> Any:
        kind = KINDS[request.resource]
        try:
            if request.action == kmock.action.WATCH:
                return _with_lines(self._serve_watch(request))
            code, body = await self._answer(kind, request)
        except ApiAnswer as exc:
            code, body = exc.code, exc.body
        return kmock.Response(status=code, payload=json.dumps(body).encode(), headers=JSON)

    async def _answer(self, kind: Kind, request: kmock.Request) -> tuple[int, dict[str, Any]]:
        if kind.namespaced is False and request.namespace is not None:
            raise ApiAnswer(404, "NotFound", "the server could not find the requested resource")
        sub = request.subresource
        if sub is not None and not (sub == "status" and kind.status and request.name):
            raise ApiAnswer(404, "NotFound", "the server could not find the requested resource")
        method = request.method.value
        async with self._lock:
            if request.name is None:
                if method == "GET":
                    return 200, self._list(kind, request)
                if method == "POST":
                    if kind.namespaced and request.namespace is None:
                        raise ApiAnswer(405, "MethodNotAllowed", "create needs a namespace")
                    return 201, await self._create(kind, request.namespace, request.data,
                                                   dry_run=request.params.get("dryRun") == "All")
            else:
                key = (kind.resource, request.namespace, request.name)
                if method == "GET":
                    return 200, copy.deepcopy(self._live(kind, key))
                if method == "PUT":
                    return 200, await self._replace(kind, key, request, status_only=sub == "status")
                if method == "PATCH":
                    return 200, await self._patch(kind, key, request, status_only=sub == "status")
                if method == "DELETE":
                    return 200, await self._delete(kind, key)
        raise ApiAnswer(405, "MethodNotAllowed", f"{method} is not supported here")

    async def _review_access(self, request: kmock.Request) -> Any:
        """A SelfSubjectAccessReview: allowed unless the test denied that verb on that resource."""
        body = request.data if isinstance(request.data, Mapping) else {}
        attributes = (body.get("spec") or {}).get("resourceAttributes") or {}
        key = (attributes.get("verb", ""), attributes.get("group", ""), attributes.get("resource", ""))
        allowed = key not in self.denied
        answer = {**body, "status": {"allowed": allowed, **({} if allowed else {"reason": "denied by the test"})}}
        return kmock.Response(status=201, payload=json.dumps(answer).encode(), headers=JSON)

    # -- semantics ------------------------------------------------------------------------------

    def _next_version(self) -> str:
        self.resource_version = next(self._revision)
        return str(self.resource_version)

    def _live(self, kind: Kind, key: tuple[Any, str | None, str]) -> dict[str, Any]:
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].raw
        raise ApiAnswer(404, "NotFound", f'{kind.resource.plural}.{kind.resource.group or "core"} '
                        f'"{key[2]}" not found', name=key[2], kind=kind.resource.plural)

    def _check_body(self, kind: Kind, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise ApiAnswer(400, "BadRequest", "the request body is not a JSON object")
        if (body.get("kind"), body.get("apiVersion")) not in ((None, None), (kind.kind, kind.api_version)):
            raise ApiAnswer(400, "BadRequest", f"expected {kind.api_version} {kind.kind}, got "
                            f"{body.get('apiVersion')} {body.get('kind')}")
        obj = copy.deepcopy(dict(body))
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        obj["metadata"] = dict(obj.get("metadata") or {})
        return obj

    @staticmethod
    def _default(kind: Kind, obj: dict[str, Any]) -> None:
        """Fields the API server fills in: a device taint's timeAdded, on create and update."""
        if kind.resource == RESOURCE_SLICES:
            for dev in (obj.get("spec") or {}).get("devices") or []:
                for taint in dev.get("taints") or []:
                    taint.setdefault("timeAdded", _now())

    def _validate(self, kind: Kind, obj: Mapping[str, Any]) -> None:
        if not kind.schema_checked:
            return
        try:
            kubernetes_validate.validate(dict(obj), K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise ApiAnswer(422, "Invalid", f"{kind.kind} is invalid: {exc.message}") from exc

    async def _publish(self, kind: Kind, event: str, obj: Mapping[str, Any]) -> None:
        await self._buses[kind.resource].put({"type": event, "object": copy.deepcopy(dict(obj))})

    async def _create(self, kind: Kind, namespace: str | None, body: Any, *, dry_run: bool = False) -> dict[str, Any]:
        """Store `body` (with `dry_run`: only answer what would be stored, as `?dryRun=All` does)."""
        obj = self._check_body(kind, body)
        meta = obj["metadata"]
        if kind.namespaced:
            if meta.get("namespace") not in (None, namespace):
                raise ApiAnswer(400, "BadRequest", "the namespace of the object does not match the URL")
            meta["namespace"] = namespace
        name = meta.get("name")
        if not name:
            base = meta.get("generateName")
            if not base:
                raise ApiAnswer(422, "Invalid", "metadata.name or metadata.generateName is required")
            base = base[:58]
            while True:
                name = base + "".join(random.choice(NAME_ALPHABET) for _ in range(5))
                if (kind.resource, namespace, name) not in self.objects or \
                        self.objects[kind.resource, namespace, name].deleted:
                    break
        key = (kind.resource, namespace if kind.namespaced else None, name)
        if key in self.objects and not self.objects[key].deleted:
            raise ApiAnswer(409, "AlreadyExists", f'{kind.resource.plural} "{name}" already exists')
        meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        for volatile in ("resourceVersion", "deletionTimestamp", "managedFields"):
            meta.pop(volatile, None)
        self._default(kind, obj)
        if kind.resource == RESOURCE_SLICES:
            drop_disabled_slice_fields(obj, None, self.gates)
        self._validate(kind, obj)
        if dry_run:
            return copy.deepcopy(obj)
        meta["resourceVersion"] = self._next_version()
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        await self._publish(kind, "ADDED", obj)
        return copy.deepcopy(obj)

    def _check_version(self, kind: Kind, current: Mapping[str, Any], sent: Any, name: str) -> None:
        if sent not in (None, "") and str(sent) != current["metadata"]["resourceVersion"]:
            raise ApiAnswer(409, "Conflict", f'Operation cannot be fulfilled on {kind.resource.plural}.'
                            f'{kind.resource.group or "core"} "{name}": the object has been modified; '
                            "please apply your changes to the latest version and try again",
                            name=name, kind=kind.resource.plural)

    async def _store_update(self, kind: Kind, key: Any, current: dict[str, Any],
                            new: dict[str, Any]) -> dict[str, Any]:
        meta = new["metadata"]
        for kept in ("name", "namespace", "uid", "creationTimestamp", "generation"):
            if kept in current["metadata"]:
                meta[kept] = current["metadata"][kept]
            else:
                meta.pop(kept, None)
        if "managedFields" not in meta and "managedFields" in current["metadata"]:
            meta["managedFields"] = current["metadata"]["managedFields"]  # a write without them keeps them
        if new.get("spec") != current.get("spec"):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        self._default(kind, new)
        if kind.resource == RESOURCE_SLICES:
            drop_disabled_slice_fields(new, current, self.gates)
        self._validate(kind, new)
        same_version = {**meta, "resourceVersion": current["metadata"]["resourceVersion"]}
        if {**new, "metadata": same_version} == current:
            return copy.deepcopy(current)  # a write that changes nothing leaves resourceVersion alone
        meta["resourceVersion"] = self._next_version()
        self.objects[key].history.append(new)
        await self._publish(kind, "MODIFIED", new)
        return copy.deepcopy(new)

    @staticmethod
    def _scoped(kind: Kind, current: Mapping[str, Any], proposed: Mapping[str, Any], *,
                status_only: bool) -> dict[str, Any]:
        """What a write may change: through /status only status, through the resource all but status."""
        if status_only:
            new, status = copy.deepcopy(dict(current)), proposed.get("status")
        else:
            new = dict(proposed)
            status = current.get("status") if kind.status else proposed.get("status")
        new.pop("status", None)
        if status is not None:
            new["status"] = copy.deepcopy(status)
        new["metadata"] = dict(new.get("metadata") or {})
        return new

    async def _replace(self, kind: Kind, key: Any, request: kmock.Request, *, status_only: bool) -> dict[str, Any]:
        current = self._live(kind, key)
        obj = self._check_body(kind, request.data)
        if obj["metadata"].get("name") not in (None, key[2]):
            raise ApiAnswer(400, "BadRequest", "the name of the object does not match the URL")
        self._check_version(kind, current, obj["metadata"].get("resourceVersion"), key[2])
        new = self._scoped(kind, current, obj, status_only=status_only)
        if status_only:
            self._status_written(kind, current, new, field_manager(request.params, request.headers, apply=False))
        return await self._store_update(kind, key, current, new)

    async def _patch(self, kind: Kind, key: Any, request: kmock.Request, *,
                     status_only: bool) -> dict[str, Any]:
        current = self._live(kind, key)
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
        if ctype == APPLY and status_only and kind.resource == RESOURCE_CLAIMS:
            return await self._apply_status(kind, key, current, request)
        if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            # Strategic merge is taken as a plain merge: lists are replaced, not merged by key.
            raise ApiAnswer(415, "UnsupportedMediaType", f"the emulator does not do {ctype!r} patches")
        patch = request.data
        if not isinstance(patch, Mapping):
            raise ApiAnswer(400, "BadRequest", "the patch is not a JSON object")
        self._check_version(kind, current, (patch.get("metadata") or {}).get("resourceVersion"), key[2])
        new = self._scoped(kind, current, merge_patch(current, patch), status_only=status_only)
        if status_only:
            self._status_written(kind, current, new, field_manager(request.params, request.headers, apply=False))
        return await self._store_update(kind, key, current, new)

    async def _apply_status(self, kind: Kind, key: Any, current: dict[str, Any],
                            request: kmock.Request) -> dict[str, Any]:
        """Server-side apply of a claim's status (kubeapi_ssa.py): status.devices entries by owner."""
        manager = field_manager(request.params, request.headers, apply=True)
        try:
            body = yaml.safe_load(request.text or "")
        except yaml.YAMLError as exc:
            raise ApiAnswer(400, "BadRequest", f"error decoding YAML: {exc}") from exc
        applied = check_apply_body(body, kind.api_version, kind.kind, key[2], key[1])
        meta = applied.get("metadata") or {}
        self._check_version(kind, current, meta.get("resourceVersion"), key[2])
        if meta.get("uid") not in (None, "", current["metadata"]["uid"]):
            # The apply's object keeps the UID it names; the update then fails validation.
            raise invalid_answer(kind.kind, kind.resource.group, key[2], [{
                "reason": "FieldValueInvalid", "field": "metadata.uid",
                "message": f'Invalid value: "{meta["uid"]}": field is immutable'}])
        devices, owners = apply_devices(current, applied, manager, request.params.get("force") == "true")
        new = copy.deepcopy(current)
        status = new.setdefault("status", {})
        if devices:
            status["devices"] = devices
        else:
            status.pop("devices", None)
        self._check_claim_status(kind, new)
        new["metadata"]["managedFields"] = with_owners(current["metadata"], owners, kind.api_version, _now())
        return await self._store_update(kind, key, current, new)

    def _status_written(self, kind: Kind, current: dict[str, Any], new: dict[str, Any], manager: str) -> None:
        """A plain write of a claim's status: validated, and its manager owns what it changed."""
        if kind.resource != RESOURCE_CLAIMS:
            return
        self._check_claim_status(kind, new)
        owners = update_owners(current, new, manager)
        if owners or current["metadata"].get("managedFields"):
            new["metadata"]["managedFields"] = with_owners(current["metadata"], owners, kind.api_version, _now())

    @staticmethod
    def _check_claim_status(kind: Kind, obj: Mapping[str, Any]) -> None:
        if causes := device_status_causes(obj):
            raise invalid_answer(kind.kind, kind.resource.group, obj["metadata"]["name"], causes)

    async def _delete(self, kind: Kind, key: Any) -> dict[str, Any]:
        current = copy.deepcopy(self._live(kind, key))
        self.objects[key].delete()
        await self._publish(kind, "DELETED", current)
        return current

    def _list(self, kind: Kind, request: kmock.Request) -> dict[str, Any]:
        checks = []
        if (fs := request.params.get("fieldSelector")) and not self.ignore_field_selectors:
            checks.append(field_matcher(fs, kind.fields))
        if ls := request.params.get("labelSelector"):
            checks.append(label_matcher(ls))
        items = []
        for (res, namespace, _name), obj in self.objects.items():
            if res != kind.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            raw = obj.raw
            if all(c(raw) for c in checks):
                item = copy.deepcopy(raw)
                # Items of a list carry no kind or apiVersion of their own, as from the real server.
                item.pop("kind", None)
                item.pop("apiVersion", None)
                items.append(item)
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        return {"apiVersion": kind.api_version, "kind": f"{kind.kind}List",
                "metadata": {"resourceVersion": str(self.resource_version)}, "items": items}


_REASONS = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
            504: "Timeout", 403: "Forbidden", 404: "NotFound"}


# The key of a stored object that every watch sends as this line instead of the object (`KubeApi.add_line`).
WATCH_LINE = "x-watch-line"


async def _with_lines(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for event in events:
        obj = event.get("object") if isinstance(event, dict) else None
        line = obj.get(WATCH_LINE) if isinstance(obj, dict) else None
        yield event if line is None else line.encode() + b"\n"


class KubeApi:
    """The emulator on a real TCP port, with test helpers. Stop and start it to play an outage."""

    def __init__(self, emulator: KubeApiEmulator) -> None:
        self.emulator = emulator
        self.port = 0
        self._server: kmock.Server | None = None
        self._clients: list[lightkube.AsyncClient] = []
        self._mark = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        assert self._server is None
        server = kmock.Server(self.emulator, port=self.port or None)
        await server.__aenter__()
        self._server, self.port = server, server.port

    async def stop(self) -> None:
        """Stop listening (state is kept): clients now get connection refused."""
        if self._server is not None:
            server, self._server = self._server, None
            await server.__aexit__(None, None, None)

    async def close(self) -> None:
        for client in self._clients:
            await client.close()
        await self.stop()

    def client(self, timeout: float = 5.0) -> lightkube.AsyncClient:
        """A lightkube client for this server (closed at teardown)."""
        # KubeConfig.from_server alone leaves no user, which lightkube's client refuses.
        config = KubeConfig.from_one(cluster=Cluster(server=self.url), user=User(token="emulator"))
        client = lightkube.AsyncClient(config, timeout=httpx2.Timeout(timeout), trust_env=False)
        self._clients.append(client)
        return client

    # -- state ----------------------------------------------------------------------------------

    def add(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Store an object as if created (uid, timestamps, resourceVersion filled in)."""
        kind = _BY_KIND[(obj["apiVersion"], obj["kind"])]
        new = copy.deepcopy(dict(obj))
        meta = new.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = self.emulator._next_version()
        key = (kind.resource, meta.get("namespace") if kind.namespaced else None, meta["name"])
        if key in self.emulator.objects:
            self.emulator.objects[key].create(new)
        else:
            self.emulator.objects[key] = new
        return copy.deepcopy(new)

    def add_line(self, api_version: str, kind: str, name: str, line: str, namespace: str | None = None) -> None:
        """An object that every watch of its kind sends, where it would send the object, as `line` itself:
        what no encoder here would write (an object nested deeper than Python's json recurses, an ERROR)."""
        self.add({"apiVersion": api_version, "kind": kind, WATCH_LINE: line,
                  "metadata": {"name": name} | ({"namespace": namespace} if namespace else {})})

    def add_node(self, name: str, uid: str | None = None,
                 declared_features: Iterable[str] = ()) -> dict[str, Any]:
        node: dict[str, Any] = {"apiVersion": "v1", "kind": "Node",
                                "metadata": {"name": name, "uid": uid or str(uuid.uuid4())}}
        if features := list(declared_features):
            node["status"] = {"declaredFeatures": features}
        return self.add(node)

    def get(self, resource: kmock.resource, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key not in self.emulator.objects or self.emulator.objects[key].deleted:
            return None
        return copy.deepcopy(self.emulator.objects[key].raw)

    def items(self, resource: kmock.resource) -> list[dict[str, Any]]:
        out = [copy.deepcopy(obj.raw) for (res, _, _), obj in self.emulator.objects.items()
               if res == resource and not obj.deleted]
        return sorted(out, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def remove(self, resource: kmock.resource, name: str, namespace: str | None = None) -> None:
        """Delete behind the agent's back (someone else did it)."""
        self.emulator.objects[resource, namespace, name].delete()

    def deny(self, verb: str, resource: str, group: str = "") -> None:
        """SelfSubjectAccessReviews for `verb` on `resource` (in `group`) answer not allowed."""
        self.emulator.denied.add((verb, group, resource))

    # -- faults and the log ---------------------------------------------------------------------

    def fail(self, method: str, path: str, *, times: int = 1, status: int = 500,
             headers: Mapping[str, str] | None = None) -> Fault:
        fault = Fault(method.upper(), path, times=times, status=status, headers=dict(headers or {}))
        self.emulator.faults.append(fault)
        return fault

    def hang(self, method: str, path: str, seconds: float, *, times: int = 1,
             status: int | None = None) -> Fault:
        fault = Fault(method.upper(), path, times=times, status=status, hang=seconds)
        self.emulator.faults.append(fault)
        return fault

    def lose_answer(self, method: str, path: str, *, hang: float = 0.0, times: int = 1) -> Fault:
        """Matching requests are carried out, then their answer is lost: held `hang` seconds (give
        more than the client's timeout), or, with no `hang`, the connection is closed."""
        fault = Fault(method.upper(), path, times=times, status=None, hang=hang, lose_answer=True)
        self.emulator.faults.append(fault)
        return fault

    def hold(self, method: str, path: str) -> asyncio.Event:
        """Matching requests wait at the server until the returned event is set, then are served."""
        gate = asyncio.Event()
        self.emulator.faults.append(Fault(method.upper(), path, times=1 << 30, status=None, gate=gate))
        return gate

    @property
    def requests(self) -> list[Logged]:
        return list(self.emulator.log)

    def mark(self) -> int:
        """Start a new stretch of the log for `since_mark`."""
        self._mark = len(self.emulator.log)
        return self._mark

    def since_mark(self) -> list[Logged]:
        return self.emulator.log[self._mark:]

    def writes(self, since_mark: bool = True) -> list[Logged]:
        log = self.since_mark() if since_mark else self.emulator.log
        return [r for r in log if r.method in ("POST", "PUT", "PATCH", "DELETE")]


@pytest_asyncio.fixture
async def kube_api() -> AsyncIterator[KubeApi]:
    async with KubeApiEmulator() as emulator:
        api = KubeApi(emulator)
        await api.start()
        try:
            yield api
        finally:
            await api.close()

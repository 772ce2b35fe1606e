"""The Kubernetes connection: finding a config, reading our Node, and telling errors apart.

Callers retry what `is_retryable` says is transient (server errors, throttling,
timeouts, a connection that failed) and report everything else at once: a 403
from missing RBAC will not heal by itself, a 503 from a restarting API server will.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml

from agent.config import Settings

# The API client (lightkube, httpx2) is imported where a cluster is used: offline, the agent never
# loads it (several MiB of modules and most of a start-up's imports). An error of a type from a
# module not imported yet cannot have been raised, so the error helpers below look for the types only
# among the modules loaded (`_loaded`).
if TYPE_CHECKING:
    import httpx2
    import lightkube
    from lightkube.config.kubeconfig import KubeConfig

log = logging.getLogger(__name__)

NODE_ALLOCATABLE_FEATURE = "DRANodeAllocatableResources"
# A 1.37 kubelet declares DRAOptionalNodeOperations (it can skip calls for the devices of a slice that says
# so; the scheduler puts a claim of such devices only on a node that declares it). It does not declare
# DRAListTypeAttributes, a gate of the API server and the scheduler alone: a Node lists it only where its
# status was written so (`--numa-node-list true` is how a real cluster says it).
LIST_ATTRIBUTES_FEATURE = "DRAListTypeAttributes"
OPTIONAL_NODE_OPERATIONS_FEATURE = "DRAOptionalNodeOperations"
FIELD_MANAGER = "dra-agent"
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"  # where a pod finds its service account


class NodeNotFound(LookupError):
    pass


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    uid: str = ""
    declared_features: frozenset[str] = frozenset()
    # status.allocatable and status.capacity, name -> quantity: the extended resources a device plugin
    # serves here (`agent.health.pluginholds`)
    allocatable: Mapping[str, str] = field(default_factory=dict, hash=False)
    capacity: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def node_allocatable(self) -> bool:
        """Whether the API server will accept node-allocatable fields in our slices."""
        return NODE_ALLOCATABLE_FEATURE in self.declared_features

    @property
    def list_attributes(self) -> bool:
        """Whether the Node says list-valued attributes are taken (`--numa-node-list auto`)."""
        return LIST_ATTRIBUTES_FEATURE in self.declared_features

    @property
    def optional_node_operations(self) -> bool:
        """Whether the kubelet can skip prepare for the devices of a slice that says so."""
        return OPTIONAL_NODE_OPERATIONS_FEATURE in self.declared_features


# -- connecting ---------------------------------------------------------------------------------

def _in_cluster(service_account: Path) -> KubeConfig | None:
    if not os.environ.get("KUBERNETES_SERVICE_HOST") or not os.environ.get("KUBERNETES_SERVICE_PORT"):
        return None
    if not (service_account / "token").is_file():
        return None
    from lightkube.config.kubeconfig import KubeConfig

    return KubeConfig.from_service_account(service_account)


def find_config(settings: Settings, *, service_account: Path = Path(SERVICE_ACCOUNT),
                home: Path | None = None) -> tuple[KubeConfig | None, str]:
    """The config to use and where it came from, or None and why there is none.

    An explicitly named kubeconfig (flag or $KUBECONFIG) that cannot be loaded is an
    error, not a reason to quietly talk to some other cluster.
    """
    from lightkube.config.kubeconfig import KubeConfig

    if settings.kubeconfig is not None:
        return KubeConfig.from_file(settings.kubeconfig), f"kubeconfig {settings.kubeconfig}"
    config = _in_cluster(service_account)
    if config is not None:
        return config, f"in-cluster service account {service_account}"
    default = (home if home is not None else Path(os.path.expanduser("~"))) / ".kube" / "config"
    if default.is_file():
        return KubeConfig.from_file(default), f"kubeconfig {default}"
    return None, (f"no cluster configured: not in a pod ({service_account} or $KUBERNETES_SERVICE_HOST "
                  f"missing), no --kubeconfig / $KUBECONFIG, no {default}")


async def connect(settings: Settings, *, service_account: Path = Path(SERVICE_ACCOUNT),
                  home: Path | None = None) -> tuple[lightkube.AsyncClient | None, str]:
    """A client for the configured cluster (not yet contacted), or None and the reason."""
    import httpx2
    import lightkube
    from lightkube.core.exceptions import ConfigError

    try:
        config, source = await asyncio.to_thread(find_config, settings, service_account=service_account,
                                                 home=home)
    except (ConfigError, OSError, KeyError, ValueError, yaml.YAMLError) as exc:
        return None, f"cluster config unusable: {exc}"
    if config is None:
        return None, source
    try:
        client = lightkube.AsyncClient(config, timeout=httpx2.Timeout(settings.api_timeout),
                                       field_manager=FIELD_MANAGER)
    except (ConfigError, OSError, KeyError, ValueError, AssertionError) as exc:
        # lightkube asserts on a context without a user.
        return None, f"cluster config from {source} unusable: {exc or type(exc).__name__}"
    log.info("Kubernetes API from %s: %s", source, client.config.cluster.server)
    return client, source


# -- the Node -----------------------------------------------------------------------------------

async def read_node(client: lightkube.AsyncClient, name: str) -> NodeInfo:
    from lightkube.core.exceptions import ApiError
    from lightkube.resources.core_v1 import Node

    try:
        node = await client.get(Node, name)
    except ApiError as exc:
        if status_code(exc) == 404:
            raise NodeNotFound(f"Node {name!r} does not exist in the cluster") from exc
        raise
    uid = (node.metadata.uid if node.metadata else None) or ""
    features = (node.status.declaredFeatures if node.status else None) or []
    allocatable = (node.status.allocatable if node.status else None) or {}
    capacity = (node.status.capacity if node.status else None) or {}
    return NodeInfo(name=name, uid=uid, declared_features=frozenset(features),
                    allocatable={str(k): str(v) for k, v in allocatable.items()},
                    capacity={str(k): str(v) for k, v in capacity.items()})


def read_offline_node(directory: Path, name: str) -> NodeInfo:
    """This node as described by `DIR/node.yaml`, if there is one (offline mode)."""
    path = Path(directory) / "node.yaml"
    try:
        doc = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except FileNotFoundError:
        return NodeInfo(name=name)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return NodeInfo(name=name)
    if not isinstance(doc, dict):
        log.warning("ignoring %s: not a Node object", path)
        return NodeInfo(name=name)
    meta = doc.get("metadata") or {}
    if meta.get("name") not in (None, name):
        log.warning("ignoring %s: it describes node %r, this is %r", path, meta.get("name"), name)
        return NodeInfo(name=name)
    features = (doc.get("status") or {}).get("declaredFeatures") or []
    return NodeInfo(name=name, uid=str(meta.get("uid") or ""),
                    declared_features=frozenset(str(f) for f in features))


# -- requests outside lightkube's models --------------------------------------------------------------

PROTOBUF = "application/vnd.kubernetes.protobuf"
_HTTP_METHODS = {"get": "GET", "replace": "PUT"}  # named as lightkube's client methods (and the RBAC test)


async def raw_call(client: lightkube.AsyncClient, method: str, resource: type[Any], name: str, namespace: str, *,
                   accept: str = "application/json", body: bytes | None = None) -> bytes:
    """One request for a namespaced object of `resource` (a lightkube resource class, a subresource's
    too) whose body is bytes, not a model: an answer in protobuf, a body whose raw fields must reach the
    API server exactly as given. Through the client's own connection (its server, credentials, timeout).
    Raises as the client's calls do: `ApiError` for a JSON error answer, `httpx2.HTTPStatusError` for any
    other, `httpx2.TransportError` when no answer came."""
    import httpx2
    from lightkube.core.exceptions import ApiError
    from lightkube.core.resource import api_info

    info = api_info(resource)
    base = info.parent or info.resource
    prefix = f"/apis/{base.group}/{base.version}" if base.group else f"/api/{base.version}"
    path = f"{prefix}/namespaces/{namespace}/{info.plural}/{name}" + (f"/{info.action}" if info.action else "")
    headers = {"Accept": accept}
    if body is not None:
        headers["Content-Type"] = "application/json"
    # lightkube has no public call for a body that is not a model; its HTTP client is the one its calls use.
    http: httpx2.AsyncClient = client._client._client
    response = await http.request(_HTTP_METHODS[method], path, content=body, headers=headers)
    try:
        response.raise_for_status()
    except httpx2.HTTPStatusError as exc:
        if response.headers.get("Content-Type") == "application/json":  # a Status, as lightkube's calls read it
            raise ApiError(request=exc.request, response=response) from exc
        raise
    return response.content


# -- what the agent asks of the API server -------------------------------------------------------------

_VERBS = {"POST": "CREATE", "PUT": "UPDATE", "PATCH": "PATCH", "DELETE": "DELETE"}


def request_kind(method: str, path: str, query: Mapping[str, str]) -> tuple[str, str]:
    """(verb, resource) of one API request, named as the API server's `apiserver_request_total` names them:
    GET is LIST on a collection and WATCH with `watch=true`; a subresource is `resource/sub`."""
    parts = [p for p in path.split("/") if p]
    # /api/v1/... or /apis/<group>/<version>/...; then namespaces/<ns>/ for a namespaced resource.
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:] if parts[:1] == ["apis"] else []
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]  # namespaces/<ns>/<plural>...; a Namespace itself is namespaces/<name>
    resource = rest[0] if rest else ""
    named = len(rest) >= 2
    if len(rest) >= 3:
        resource += "/" + rest[2]
    if method == "GET":
        if query.get("watch") in ("true", "1"):
            return "WATCH", resource
        return ("GET" if named else "LIST"), resource
    return _VERBS.get(method, method), resource


def count_requests(client: lightkube.AsyncClient, count: Callable[[str, str], None]) -> None:
    """Calls `count(verb, resource)` for every request the client sends, each retry too: what this agent
    costs the API server, in the API server's own terms. Hooked into the client's HTTP client, the one
    place every call (lightkube's and `raw_call`'s) goes through."""
    http: httpx2.AsyncClient = client._client._client

    async def counted(request: httpx2.Request) -> None:
        count(*request_kind(request.method, request.url.path, request.url.params))

    http.event_hooks["request"].append(counted)


# -- errors -------------------------------------------------------------------------------------

def _loaded(module: str, name: str) -> type[BaseException] | tuple[()]:
    """The exception type `module.name` when the module is loaded; else an empty tuple, which no
    `isinstance` matches (nothing of a module never imported can have been raised)."""
    found = sys.modules.get(module)
    return getattr(found, name) if found is not None else ()


def status_code(exc: BaseException) -> int | None:
    """The HTTP status of an API answer; None when no answer came."""
    if isinstance(exc, _loaded("lightkube.core.exceptions", "ApiError")):
        status = getattr(exc, "status", None)
        if status is not None and status.code:
            return int(status.code)
    if isinstance(exc, _loaded("httpx2", "HTTPStatusError")):
        return cast("httpx2.HTTPStatusError", exc).response.status_code
    return None


def status_cause_fields(exc: BaseException) -> list[str]:
    """The fields the API server's answer blames (`status.details.causes[].field` of a 422)."""
    api_error = _loaded("lightkube.core.exceptions", "ApiError")
    status = getattr(exc, "status", None) if isinstance(exc, api_error) else None
    details = status.details if status is not None else None
    return [c.field for c in (details.causes or []) if c.field] if details is not None else []


def is_retryable(exc: BaseException) -> bool:
    code = status_code(exc)
    if code is not None:
        return code >= 500 or code == 429
    return isinstance(exc, (_loaded("httpx2", "TransportError"), TimeoutError, ConnectionError))


def is_conflict(exc: BaseException) -> bool:
    return status_code(exc) == 409


def is_not_found(exc: BaseException) -> bool:
    return status_code(exc) == 404


def retry_after(exc: BaseException) -> float | None:
    """The server's Retry-After (seconds) on a 429/503, if it sent one."""
    if not isinstance(exc, _loaded("httpx2", "HTTPStatusError")):
        return None
    try:
        return max(0.0, float(cast("httpx2.HTTPStatusError", exc).response.headers.get("Retry-After", "")))
    except ValueError:
        return None


def describe(exc: BaseException) -> str:
    """One line for logs and error messages."""
    code = status_code(exc)
    if code is not None:
        message = ""
        status = getattr(exc, "status", None)
        if isinstance(exc, _loaded("lightkube.core.exceptions", "ApiError")) and status is not None:
            message = status.message or status.reason or ""
        return f"HTTP {code}" + (f": {message}" if message else "")
    if isinstance(exc, (_loaded("httpx2", "TimeoutException"), TimeoutError)):
        return f"timed out ({type(exc).__name__})"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if isinstance(exc, _loaded("httpx2", "TransportError")) else text


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter, so agents on many nodes do not retry in step."""

    initial: float = 0.5
    maximum: float = 15.0
    factor: float = 2.0
    attempts: int = 6  # tries in all, the first included

    def delay(self, failures: int, exc: BaseException | None = None) -> float:
        """Seconds to wait after the `failures`-th failure in a row (1-based)."""
        ceiling = min(self.maximum, self.initial * self.factor ** max(0, failures - 1))
        wait = random.uniform(ceiling / 2, ceiling)
        hint = retry_after(exc) if exc is not None else None
        return min(self.maximum, max(wait, hint)) if hint is not None else wait


def plain(obj: Any) -> dict[str, Any]:
    """A lightkube model as the JSON dict the API sent or will be sent."""
    return obj.to_dict()  # type: ignore[no-any-return]


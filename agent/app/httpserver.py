"""The HTTP server for `/metrics`, `/healthz` and `/readyz`, and the probes' answer format.

The server runs on the agent's event loop (`asyncio.start_server`), so a probe that gets an
answer has also shown that the loop is not stuck. It speaks just enough HTTP/1.1 for Prometheus
and the kubelet's probes: GET and HEAD, one request per connection.

Two roles (`Serves`). With `--probe-address` the probes have a listener of their own (the DaemonSet
puts it on the loopback: the kubelet reaches it with host networking, pods do not), which serves the
probes with their details, `/metrics`, and names the agent in each answer (`identity_headers`: version,
driver, node, pod UID, so that `dra-agent doctor` tells it from another program on the port); the
`--metrics-address` listener (the node's address) then serves `/metrics` alone and names nothing.
Without it one listener serves everything, as for `make run`.

A listener holds at most `max_connections` connections: one past that is closed at once, never queued,
and a request's head must arrive within `header_timeout`. So connections held open on the metrics
listener (any pod that reaches the node's address may open them) never delay a probe on its own
listener (tests/test_metrics.py holds 200 idle and partial ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import gzip
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from agent import __version__
from agent.config import Settings
from agent.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


def probe_body(checks: Sequence[Check], what: str) -> tuple[int, bytes]:
    """`[+]name ok: detail` lines, like the API server's verbose probes, and 200 or 503."""
    lines = [f"[{'+' if c.ok else '-'}]{c.name} {'ok' if c.ok else 'failed'}" + (f": {c.detail}" if c.detail else "")
             for c in checks]
    ok = all(c.ok for c in checks)
    lines.append(f"{what} check {'passed' if ok else 'failed'}")
    return (200 if ok else 503), ("\n".join(lines) + "\n").encode()


# The headers that name the agent in each answer.
VERSION_HEADER = "Dra-Agent-Version"
DRIVER_HEADER = "Dra-Agent-Driver"
NODE_HEADER = "Dra-Agent-Node"
POD_UID_HEADER = "Dra-Agent-Pod-Uid"


def identity_headers(settings: Settings) -> dict[str, str]:
    out = {VERSION_HEADER: __version__, DRIVER_HEADER: settings.driver_name, NODE_HEADER: settings.node_name}
    if settings.rolling_update_pod_uid:
        out[POD_UID_HEADER] = settings.rolling_update_pod_uid
    return out


# -- the HTTP server ------------------------------------------------------------------------------

ProbeFn = Callable[[], Awaitable[Sequence[Check]]]
# A request's head must arrive within this: Prometheus and the kubelet send theirs at once.
HEADER_TIMEOUT = 2.0
MAX_HEADER = 16 * 1024
MAX_CONNECTIONS = 16  # the metrics listener's (or the only one's)
MAX_PROBE_CONNECTIONS = 8  # the probe listener's: the kubelet's three probes and a person's doctor
REBIND_INTERVAL = 2.0


class Serves(enum.Enum):
    """What a listener serves: everything (one listener), the probes' own, or metrics alone."""

    ALL = "metrics and probes"
    PROBES = "probes"
    METRICS = "metrics"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class MetricsServer:
    """What `serves` says of `/metrics`, `/healthz` and `/readyz`, on HOST:PORT, on the running event loop.

    A port that is taken does not stop the agent: during a rolling update the agent being
    replaced holds it until it exits, so the server tries again every `REBIND_INTERVAL`
    seconds and logs once. Any other error binding (a bad address) fails `start`.
    """

    def __init__(self, metrics: Metrics, host: str | None, port: int, *, healthz: ProbeFn, readyz: ProbeFn,
                 identity: Mapping[str, str] | None = None, serves: Serves = Serves.ALL,
                 max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT) -> None:
        """`identity`: headers that name the agent, sent with every answer (`identity_headers`) but on a
        listener that serves metrics alone."""
        self.metrics = metrics
        self.serves = serves
        self.identity = {} if serves is Serves.METRICS else dict(identity or {})
        self.host, self.port = host, port
        self.healthz, self.readyz = healthz, readyz
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self._server: asyncio.Server | None = None
        self._retry: asyncio.Task[None] | None = None
        self._open = 0  # connections being served
        self.refused = 0  # connections closed at once, past `max_connections`
        self.bound = asyncio.Event()

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every listening socket (port 0 resolved)."""
        if self._server is None:
            return []
        return [(str(s.getsockname()[0]), int(s.getsockname()[1])) for s in self._server.sockets]

    @property
    def url(self) -> str:
        """http://HOST:PORT of the first listening socket, for people and tests."""
        host, port = self.addresses[0]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def start(self) -> None:
        if not await self._bind():
            log.warning("%s address %s:%d is in use (the agent this one replaces?): trying again every "
                        "%.0fs", self.serves.value, self.host or "", self.port, REBIND_INTERVAL)
            self._retry = asyncio.create_task(self._rebind(), name="metrics-rebind")

    async def _bind(self) -> bool:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_HEADER,
                                                      reuse_address=True)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return False
        self.bound.set()
        paths = "/metrics" if self.serves is Serves.METRICS else "/metrics, /healthz, /readyz"
        log.info("%s on %s (%s)", self.serves.value, ", ".join(f"{h}:{p}" for h, p in self.addresses), paths)
        return True

    async def _rebind(self) -> None:
        while True:
            await asyncio.sleep(REBIND_INTERVAL)
            if await self._bind():
                return

    async def stop(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self.max_connections:
            # Past the cap: closed at once, never queued behind the connections being served.
            self.refused += 1
            writer.transport.abort()
            return
        self._open += 1
        try:
            try:
                async with asyncio.timeout(self.header_timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                return
            status, headers, body, head_only = await self._answer(head)
            reason = _REASONS.get(status, "OK")
            out = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}", "Connection: close",
                   *(f"{k}: {v}" for k, v in {**self.identity, **headers}.items())]
            writer.write(("\r\n".join(out) + "\r\n\r\n").encode() + (b"" if head_only else body))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        except Exception:
            log.exception("%s server: answering a request failed", self.serves.value)
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _answer(self, head: bytes) -> tuple[int, dict[str, str], bytes, bool]:
        text = "text/plain; charset=utf-8"
        try:
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, target, _version = request_line.split(" ")
        except ValueError:
            return 400, {"Content-Type": text}, b"bad request\n", False
        headers = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            return 405, {"Content-Type": text, "Allow": "GET, HEAD"}, b"GET or HEAD only\n", False
        head_only = method == "HEAD"
        path = target.split("?", 1)[0]
        if path == "/metrics":
            body, content_type = self.metrics.render(headers.get("accept", ""))
            out = {"Content-Type": content_type}
            if "gzip" in headers.get("accept-encoding", ""):
                body, out["Content-Encoding"] = gzip.compress(body), "gzip"
            return 200, out, body, head_only
        if path in ("/healthz", "/livez", "/readyz") and self.serves is Serves.METRICS:
            return 404, {"Content-Type": text}, b"not found: the probes are served on the agent's probe listener\n", \
                head_only
        if path in ("/healthz", "/livez", "/readyz"):
            what = "readyz" if path == "/readyz" else "healthz"
            checks = await (self.readyz if what == "readyz" else self.healthz)()
            status, body = probe_body(checks, what)
            return status, {"Content-Type": text}, body, head_only
        served = b"/metrics is" if self.serves is Serves.METRICS else b"/metrics, /healthz and /readyz are"
        return 404, {"Content-Type": text}, b"not found: " + served + b" served here\n", head_only

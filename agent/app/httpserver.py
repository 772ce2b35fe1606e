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

A listener holds at most `max_connections` connections, and at most `per_source` from one address; a
request's head must arrive within `header_timeout`. A connection past either cap takes the place of one
that waits on its client (for the rest of its request head, or to take its answer): of the address
holding the most, the oldest first. It is closed at once, never queued, only when every connection it
could replace is being answered. So a client that sends its request at once (Prometheus, a probe) is
served however many slow ones others keep opening: a flood renewed faster than the header timeout can
hold the cap only as long as nobody else asks (tests/test_metrics.py floods both listeners).

`SocketServer` serves the probes on a unix socket (`--probe-socket`), for the kubelet's exec probes
(`agent.app.probeclient`): no TCP client, on the node or in a pod, reaches it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import errno
import gzip
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent import __version__
from agent.config import Settings
from agent.kubelet import sockets
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
MAX_PROBE_CONNECTIONS = 8  # the probe listener's and the probe socket's: the kubelet's three probes, a person's doctor
# One address's share of a TCP listener: the kubelet's probes (startup, liveness and readiness, at most two
# at once) or a scrape and a person's check, with room to spare; a unix socket's clients are one source.
MAX_PER_SOURCE = 4
# A client has this long to take its answer: it waits on the client meanwhile, and may be replaced.
ANSWER_TIMEOUT = 10.0
REBIND_INTERVAL = 2.0
REPLACED_LOGGED_EVERY = 60.0  # seconds: a flood is logged once a minute, not once a connection


class Serves(enum.Enum):
    """What a listener serves: everything (one listener), the probes' own, or metrics alone."""

    ALL = "metrics and probes"
    PROBES = "probes"
    METRICS = "metrics"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


@dataclass(eq=False, slots=True)
class _Held:
    """A connection a listener holds: the address it comes from, and whether it waits on its client (for
    the rest of its request head, or to take its answer), which makes it one a new connection may replace."""

    source: str
    transport: asyncio.WriteTransport
    waiting: bool = True


class MetricsServer:
    """What `serves` says of `/metrics`, `/healthz` and `/readyz`, on HOST:PORT, on the running event loop.

    A port that is taken does not stop the agent: during a rolling update the agent being
    replaced holds it until it exits, so the server tries again every `REBIND_INTERVAL`
    seconds and logs once. Any other error binding (a bad address) fails `start`.
    """

    def __init__(self, metrics: Metrics, host: str | None, port: int, *, healthz: ProbeFn, readyz: ProbeFn,
                 identity: Mapping[str, str] | None = None, serves: Serves = Serves.ALL,
                 max_connections: int = MAX_CONNECTIONS, per_source: int = MAX_PER_SOURCE,
                 header_timeout: float = HEADER_TIMEOUT) -> None:
        """`identity`: headers that name the agent, sent with every answer (`identity_headers`) but on a
        listener that serves metrics alone."""
        self.metrics = metrics
        self.serves = serves
        self.identity = {} if serves is Serves.METRICS else dict(identity or {})
        self.host, self.port = host, port
        self.healthz, self.readyz = healthz, readyz
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self.per_source = min(per_source, max_connections)
        self._server: asyncio.Server | None = None
        self._retry: asyncio.Task[None] | None = None
        self._held: dict[_Held, None] = {}  # the connections being served, oldest first
        self.refused = 0  # connections closed at once: every one they could replace was being answered
        self.replaced = 0  # connections closed, waiting on their clients, to make room for new ones
        self._replaced_logged = (0, -REPLACED_LOGGED_EVERY)  # (replaced, when) as last logged
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

    @property
    def where(self) -> str:
        """Where it listens, for the log."""
        return ", ".join(f"{h}:{p}" for h, p in self.addresses)

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_HEADER, reuse_address=True)

    async def _bind(self) -> bool:
        try:
            self._server = await self._listen()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return False
        self.bound.set()
        paths = "/metrics" if self.serves is Serves.METRICS else "/metrics, /healthz, /readyz"
        log.info("%s on %s (%s)", self.serves.value, self.where, paths)
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

    def _admit(self, writer: asyncio.StreamWriter) -> _Held | None:
        """The new connection held, once a connection waiting on its client has made room for it where a cap
        is reached (its address's, else the listener's); None: nothing could, it is to be closed."""
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) else ""  # a unix socket's clients are one source
        own = [h for h in self._held if h.source == source]
        if len(own) >= self.per_source:
            if (victim := self._victim(own)) is None:
                return None
            self._replace(victim)
        elif len(self._held) >= self.max_connections:
            if (victim := self._victim(list(self._held))) is None:
                return None
            self._replace(victim)
        held = _Held(source, writer.transport)
        self._held[held] = None
        return held

    def _victim(self, among: list[_Held]) -> _Held | None:
        """Of the connections waiting on their clients, one of the address holding the most, the oldest: a
        flood gives way before a client holding one connection does, and a slow client before a new one."""
        counts = collections.Counter(h.source for h in self._held)
        waiting = [h for h in among if h.waiting]
        return max(waiting, key=lambda h: counts[h.source]) if waiting else None  # max: the first, oldest

    def _replace(self, victim: _Held) -> None:
        del self._held[victim]
        victim.transport.abort()  # its handler sees the end of the stream and lets go
        self.replaced += 1
        count, when = self._replaced_logged
        now = time.monotonic()
        if now - when >= REPLACED_LOGGED_EVERY:
            self._replaced_logged = (self.replaced, now)
            log.warning("%s server: %d connections that had not sent their request (or taken their answer) "
                        "closed to serve new ones since the last such message, the last from %s: a slow client "
                        "or a flood of connections", self.serves.value, self.replaced - count,
                        victim.source or "the socket")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held = self._admit(writer)
        if held is None:
            # Past a cap with every connection being answered: closed at once, never queued.
            self.refused += 1
            writer.transport.abort()
            return
        try:
            try:
                async with asyncio.timeout(self.header_timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                return
            held.waiting = False
            status, headers, body, head_only = await self._answer(head)
            reason = _REASONS.get(status, "OK")
            out = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}", "Connection: close",
                   *(f"{k}: {v}" for k, v in {**self.identity, **headers}.items())]
            writer.write(("\r\n".join(out) + "\r\n\r\n").encode() + (b"" if head_only else body))
            held.waiting = True
            try:
                async with asyncio.timeout(ANSWER_TIMEOUT):
                    await writer.drain()
            except (TimeoutError, ConnectionError):
                writer.transport.abort()  # a client that does not take its answer: closing would wait on it
        except Exception:
            log.exception("%s server: answering a request failed", self.serves.value)
        finally:
            self._held.pop(held, None)
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


class SocketServer(MetricsServer):
    """The probes on a unix socket (`--probe-socket`): the kubelet's exec probes ask there
    (`agent.app.probeclient`). Mode 0600 and in a directory of the pod's own (the DaemonSet's `emptyDir`):
    only the pod's processes and root on the host reach it, whatever any pod does to the node's ports. Bound
    under a private name and renamed into place, removed at the end only while it is still this process's
    (`agent.kubelet.sockets`, as the kubelet's sockets)."""

    def __init__(self, metrics: Metrics, path: Path, *, healthz: ProbeFn, readyz: ProbeFn,
                 identity: Mapping[str, str] | None = None, max_connections: int = MAX_PROBE_CONNECTIONS) -> None:
        super().__init__(metrics, None, 0, healthz=healthz, readyz=readyz, identity=identity, serves=Serves.PROBES,
                         max_connections=max_connections, per_source=max_connections)
        self.path = path
        self._own: sockets.SocketIdentity | None = None

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return []

    @property
    def where(self) -> str:
        return f"unix socket {self.path}"

    async def _listen(self) -> asyncio.Server:
        sockets.check_length(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sockets.check_replaceable(self.path)
        bound = sockets.private_name(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound under a restrictive umask, so the socket never exists with wider permissions, even for an
        # instant (the directory may be an emptyDir, open to all).
        old = os.umask(0o177)
        try:
            sock.bind(str(bound))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        server = await asyncio.start_unix_server(self._handle, sock=sock, limit=MAX_HEADER)
        try:
            self._own = sockets.put_in_place(bound, self.path)
        except BaseException:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(bound)
            raise
        return server

    async def stop(self) -> None:
        await super().stop()
        own, self._own = self._own, None
        if own is not None:
            with contextlib.suppress(OSError):
                sockets.remove_own_socket(self.path, own)

"""The gRPC servers the kubelet talks to, on unix sockets.

- registration (`plugins_registry/<driver>-reg.sock`): GetInfo, NotifyRegistrationStatus;
- DRA v1 + v1beta1 and health v1 + v1alpha1 on `plugins/<driver>/dra.sock`.

GetInfo lists exactly the services the DRA socket serves: the kubelet picks the newest health
version it finds there and, should that service answer Unimplemented, stops watching until the
plugin registers again. So the health versions are listed only by servers made to serve them
(`Servers(health=True)`, the default), and those refuse to attach without a health tracker.

Registration runs on its own server so GetInfo (1 s kubelet timeout) never
queues behind prepares, and it starts first: this module imports the engine's modules only for
types, so the registration socket answers before discovery and the engine are even imported.
Handlers never let an exception out as a traceback: errors are per claim, in the response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from agent.config import UNIX_PATH_MAX, Settings
from agent.names import ClaimRef, base_request
from agent.pb import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    health_v1_pb2,
    health_v1_pb2_grpc,
    health_v1alpha1_pb2,
    health_v1alpha1_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)

if TYPE_CHECKING:  # the registration server starts before the engine's modules are imported
    from agent.engine.prepare import PrepareEngine
    from agent.kubelet.health import HealthTracker
    from agent.metrics import Metrics

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
DRA_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_VERSIONS = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")  # newest first, as the kubelet picks


class RegistrationState:
    """What the kubelet last told us about our registration (for logs, health and metrics)."""

    def __init__(self) -> None:
        self.registered: bool | None = None
        self.error = ""
        self.updated_at = 0.0
        self.info_calls = 0


def supported_versions(health: bool) -> list[str]:
    """The services GetInfo lists: the DRA versions, and the health versions when they are served."""
    return [*DRA_VERSIONS, *(HEALTH_VERSIONS if health else ())]


class Registration(registration_pb2_grpc.RegistrationServicer):
    def __init__(self, settings: Settings, state: RegistrationState, health: bool) -> None:
        self.info = registration_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=settings.driver_name, endpoint=str(settings.dra_socket),
            supported_versions=supported_versions(health))
        self.state = state

    async def GetInfo(self, request: Any, context: Any) -> Any:
        self.state.info_calls += 1
        return self.info

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.state.registered = request.plugin_registered
        self.state.error = request.error
        self.state.updated_at = time.time()
        if request.plugin_registered:
            log.info("the kubelet registered the plugin")
        else:
            log.error("THE KUBELET REJECTED THE PLUGIN REGISTRATION: %s", request.error or "(no reason given)")
        return registration_pb2.RegistrationStatusResponse()


def _refs(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]


class _DRA:
    """One implementation behind both API versions; `pb` is the version's message module."""

    def __init__(self, engine: PrepareEngine, pb: Any, with_share_id: bool) -> None:
        self.engine = engine
        self.pb = pb
        self.with_share_id = with_share_id
        self.service = pb.DESCRIPTOR.services_by_name["DRAPlugin"].full_name

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        with self.engine.metrics.grpc_call("unary", self.service, "NodePrepareResources"):
            return await self._prepare(request)

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        with self.engine.metrics.grpc_call("unary", self.service, "NodeUnprepareResources"):
            return await self._unprepare(request)

    async def _prepare(self, request: Any) -> Any:
        refs = _refs(request)
        response = self.pb.NodePrepareResourcesResponse()
        try:
            results = await self.engine.prepare(refs)
        except Exception as exc:  # the engine reports per claim; this is a last line of defence
            from agent.engine.prepare import PrepareResult

            log.exception("NodePrepareResources failed")
            results = {r.uid: PrepareResult(error=f"internal error: {exc!r}") for r in refs}
        for uid, result in results.items():
            entry = response.claims[uid]
            if result.error:
                entry.error = result.error
                continue
            for d in result.devices:
                dev = entry.devices.add(request_names=[base_request(d.request)], pool_name=d.pool,
                                        device_name=d.device, cdi_device_ids=d.cdi_device_ids)
                if self.with_share_id and d.share_id:
                    dev.share_id = d.share_id
        return response

    async def _unprepare(self, request: Any) -> Any:
        refs = _refs(request)
        response = self.pb.NodeUnprepareResourcesResponse()
        try:
            results = await self.engine.unprepare(refs)
        except Exception as exc:
            log.exception("NodeUnprepareResources failed")
            results = {r.uid: f"internal error: {exc!r}" for r in refs}
        for uid, error in results.items():
            response.claims[uid].error = error
        return response


class DRAv1(_DRA, dra_v1_pb2_grpc.DRAPluginServicer):
    def __init__(self, engine: PrepareEngine) -> None:
        super().__init__(engine, dra_v1_pb2, with_share_id=True)


class DRAv1beta1(_DRA, dra_v1beta1_pb2_grpc.DRAPluginServicer):
    def __init__(self, engine: PrepareEngine) -> None:
        super().__init__(engine, dra_v1beta1_pb2, with_share_id=False)


class _Health:
    def __init__(self, tracker: HealthTracker, pb: Any, metrics: Metrics) -> None:
        self.tracker = tracker
        self.pb = pb
        self.metrics = metrics
        self.service = pb.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name

    async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:
        from agent.kubelet.health import HEALTHY, UNHEALTHY, UNKNOWN

        status = {HEALTHY: self.pb.HEALTHY, UNHEALTHY: self.pb.UNHEALTHY, UNKNOWN: self.pb.UNKNOWN}
        with self.metrics.grpc_call("server_stream", self.service, "NodeWatchResources"):
            async for devices in self.tracker.watch():
                now = int(time.time())
                yield self.pb.NodeWatchResourcesResponse(devices=[
                    self.pb.DeviceHealth(
                        device=self.pb.DeviceIdentifier(pool_name=self.tracker.pool, device_name=d.device),
                        health=status.get(d.status, self.pb.UNKNOWN), last_updated_time=now,
                        health_check_timeout_seconds=self.tracker.timeout_seconds, message=d.message)
                    for d in devices])


class Healthv1(_Health, health_v1_pb2_grpc.DRAResourceHealthServicer):
    def __init__(self, tracker: HealthTracker, metrics: Metrics) -> None:
        super().__init__(tracker, health_v1_pb2, metrics)


class Healthv1alpha1(_Health, health_v1alpha1_pb2_grpc.DRAResourceHealthServicer):
    def __init__(self, tracker: HealthTracker, metrics: Metrics) -> None:
        super().__init__(tracker, health_v1alpha1_pb2, metrics)


def check_replaceable(path: Path) -> None:
    """A socket left by an earlier run (or held by an agent being replaced) may be replaced; anything
    else at that path is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"{path} exists and is not a socket: refusing to replace it")


SocketIdentity = tuple[int, int]  # (device, inode) of a socket file this process bound


def _identity(path: Path) -> SocketIdentity | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def remove_own_socket(path: Path, identity: SocketIdentity) -> bool:
    """Remove the socket file only if it is still the one this process bound: during a restart or
    a rolling update with default names, a newer agent may have replaced it with its own, and
    removing that would silently deregister the plugin."""
    if _identity(path) != identity:
        log.info("not removing %s: another agent has bound it since", path)
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True


async def _start(server: grpc.aio.Server, path: Path) -> SocketIdentity:
    if len(os.fsencode(str(path))) >= UNIX_PATH_MAX:
        raise RuntimeError(f"socket path {path} is {len(os.fsencode(str(path)))} bytes, over the unix limit of "
                           f"{UNIX_PATH_MAX - 1}: use a shorter --kubelet-dir")
    path.parent.mkdir(parents=True, exist_ok=True)
    check_replaceable(path)
    # gRPC unlinks the path it bound when the server shuts down, whoever owns that path by then.
    # Binding a private name and renaming it into place keeps a stopping agent from removing the
    # socket of the agent that replaced it; the rename also leaves no moment without a socket.
    bound = path.parent / f".{secrets.token_hex(4)}.sock"
    # The kubelet runs as root: nobody else may connect. Bind under a restrictive umask so the
    # socket never exists with wider permissions, even for an instant.
    old = os.umask(0o177)
    try:
        if server.add_insecure_port(f"unix://{bound}") == 0:
            raise RuntimeError(f"cannot listen on {bound}")
        await server.start()
    finally:
        os.umask(old)
    os.chmod(bound, 0o600)
    try:
        check_replaceable(path)  # a non-socket may have appeared meanwhile
    except RuntimeError:
        os.unlink(bound)
        raise
    os.rename(bound, path)  # atomically replaces an earlier agent's socket
    identity = _identity(path)
    if identity is None:
        raise RuntimeError(f"{path} vanished right after it was bound")
    return identity


class Servers:
    """Both servers. The registration server needs nothing but the settings (and whether the health
    stream will be served), so it can start first (the kubelet's GetInfo answered while devices are
    discovered and records listed); the DRA server gets its servicers from `attach` once the engine
    exists, and starts after that."""

    def __init__(self, settings: Settings, engine: PrepareEngine | None = None,
                 tracker: HealthTracker | None = None, *, health: bool = True) -> None:
        self.settings = settings
        self.health = health
        self.registration_state = RegistrationState()
        self._listening: list[tuple[grpc.aio.Server, Path, SocketIdentity]] = []
        self._retiring: set[asyncio.Task[None]] = set()  # replaced servers, stopping in the background
        self._registration_servicer = Registration(settings, self.registration_state, health)
        self._dra_servicers: tuple[DRAv1, DRAv1beta1] | None = None
        self._health_servicers: tuple[Healthv1, Healthv1alpha1] | None = None
        self.registration = self._new_registration()
        self.dra: grpc.aio.Server | None = None
        if engine is not None:
            self.attach(engine, tracker)

    def attach(self, engine: PrepareEngine, tracker: HealthTracker | None) -> None:
        """The DRA servicers, and the health servicers exactly when registration lists them
        (before `start_dra`)."""
        if self.health != (tracker is not None):
            raise RuntimeError("registration lists the health service: it needs a health tracker" if self.health
                               else "registration does not list the health service: it must not be served")
        self._dra_servicers = (DRAv1(engine), DRAv1beta1(engine))
        self._health_servicers = None if tracker is None else (Healthv1(tracker, engine.metrics),
                                                               Healthv1alpha1(tracker, engine.metrics))
        self.dra = self._new_dra()

    @property
    def dra_started(self) -> bool:
        return any(path == self.settings.dra_socket for _, path, _ in self._listening)

    @property
    def registration_started(self) -> bool:
        return any(path == self.settings.registration_socket for _, path, _ in self._listening)

    @staticmethod
    def _server() -> grpc.aio.Server:
        return grpc.aio.server(options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)])

    def _new_registration(self) -> grpc.aio.Server:
        server = self._server()
        registration_pb2_grpc.add_RegistrationServicer_to_server(self._registration_servicer, server)
        return server

    def _new_dra(self) -> grpc.aio.Server:
        if self._dra_servicers is None:
            raise RuntimeError("the DRA servicers are not attached")
        server = self._server()
        v1, v1beta1 = self._dra_servicers
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(v1, server)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(v1beta1, server)
        if self._health_servicers is not None:
            h1, h1alpha1 = self._health_servicers
            health_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server(h1, server)
            health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(h1alpha1, server)
        return server

    async def start_dra(self) -> None:
        if self.dra is None:
            raise RuntimeError("the DRA servicers are not attached")
        identity = await _start(self.dra, self.settings.dra_socket)
        self._listening.append((self.dra, self.settings.dra_socket, identity))
        log.info("DRA service listening on %s", self.settings.dra_socket)

    async def start_registration(self) -> None:
        identity = await _start(self.registration, self.settings.registration_socket)
        self._listening.append((self.registration, self.settings.registration_socket, identity))
        log.info("registration service listening on %s", self.settings.registration_socket)

    async def restore_missing(self) -> list[Path]:
        """Re-create each socket whose file was removed from under the agent (a kubelet restart
        cleaning its plugin directories; the parent directory is re-created too). gRPC cannot
        add a port to a started server, so a fresh server for the same servicers is bound and
        renamed into place, and the old one, unreachable now, stops in the background. A path
        that holds another socket (an agent that replaced this one) is left alone. The kubelet
        re-registers the plugin when it sees the registration socket appear."""
        restored = []
        for i, (server, path, _) in enumerate(self._listening):
            if _identity(path) is not None:
                continue
            fresh = self._new_registration() if server is self.registration else self._new_dra()
            identity = await _start(fresh, path)
            self._listening[i] = (fresh, path, identity)
            if server is self.registration:
                self.registration = fresh
                self.registration_state.registered = None  # until the kubelet registers it again
            else:
                self.dra = fresh
            task = asyncio.create_task(server.stop(2.0))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            restored.append(path)
        return restored

    async def stop(self, grace: float = 2.0) -> None:
        # Registration first: the kubelet stops sending work before the DRA socket goes away.
        for server, path, identity in reversed(self._listening):
            await server.stop(grace)
            with contextlib.suppress(OSError):
                remove_own_socket(path, identity)
        self._listening.clear()
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

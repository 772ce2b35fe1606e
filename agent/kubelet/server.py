"""The servers the kubelet talks to, on unix sockets.

- registration (`plugins_registry/<driver>-reg.sock`): GetInfo, NotifyRegistrationStatus
  (`agent.kubelet.registration`);
- DRA v1 + v1beta1 and health v1 + v1alpha1 on `plugins/<driver>/dra.sock` (gRPC).

GetInfo lists exactly the services the DRA socket serves: the kubelet picks the newest health
version it finds there and, should that service answer Unimplemented, stops watching until the
plugin registers again. So the health versions are listed only by servers made to serve them
(`Servers(health=True)`, the default), and those refuse to attach without a health tracker.

Registration runs on its own server so GetInfo (1 s kubelet timeout) never queues behind prepares,
and it starts last (`agent.app.daemon`): GetInfo names the DRA socket, which the kubelet calls right
after registering, so that socket answers before the registration socket appears. Handlers never
let an exception out as a traceback: errors are per claim, in the response.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from agent.config import Settings
from agent.kubelet import sockets
from agent.kubelet.registration import RegistrationServer, RegistrationState
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
)

if TYPE_CHECKING:
    from agent.engine.prepare import PrepareEngine
    from agent.kubelet.health import HealthTracker
    from agent.metrics import Metrics

log = logging.getLogger(__name__)

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




class Servers:
    """Both servers. The DRA server gets its servicers from `attach` once the engine exists, and starts
    after that; the registration server (`registration`: one made elsewhere, for tests) after it."""

    def __init__(self, settings: Settings, engine: PrepareEngine | None = None,
                 tracker: HealthTracker | None = None, *, health: bool = True,
                 registration: RegistrationServer | None = None) -> None:
        if registration is not None and registration.health != health:
            raise RuntimeError("the registration server lists other services than these servers serve")
        self.settings = settings
        self.health = health
        self.registration = registration or RegistrationServer(settings, health=health)
        self._dra = sockets.ServedSocket(settings.dra_socket, self._new_dra)
        self._dra_servicers: tuple[DRAv1, DRAv1beta1] | None = None
        self._health_servicers: tuple[Healthv1, Healthv1alpha1] | None = None
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

    @property
    def registration_state(self) -> RegistrationState:
        return self.registration.state

    @property
    def dra(self) -> grpc.aio.Server | None:
        """The DRA socket's server while it is started."""
        return self._dra.server

    @property
    def dra_started(self) -> bool:
        return self._dra.started

    @property
    def registration_started(self) -> bool:
        return self.registration.started

    @staticmethod
    def _server() -> grpc.aio.Server:
        return grpc.aio.server(options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)])

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
        await self._dra.start()  # `_new_dra` refuses servicers that are not attached
        log.info("DRA service listening on %s", self.settings.dra_socket)

    async def start_registration(self) -> None:
        await self.registration.start()

    async def restore_missing(self) -> list[Path]:
        """Re-create each socket whose file was removed from under the agent (a kubelet restart
        cleaning its plugin directories; the parent directory is re-created too). gRPC cannot
        add a port to a started server, so a fresh DRA server for the same servicers is bound and
        renamed into place, and the old one, unreachable now, stops in the background. A path
        that holds another socket (an agent that replaced this one) is left alone. The kubelet
        re-registers the plugin when it sees the registration socket appear."""
        restored = []
        if await self.registration.restore():
            restored.append(self.registration.path)
        if await self._dra.restore(2.0):
            restored.append(self._dra.path)
        return restored

    async def stop(self, grace: float = 2.0) -> None:
        # Registration first: the kubelet stops sending work before the DRA socket goes away.
        await self.registration.stop(grace)
        await self._dra.stop(grace)

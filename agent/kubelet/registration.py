"""The registration service the kubelet's plugin watcher calls (`plugins_registry/<driver>-reg.sock`):
GetInfo, then NotifyRegistrationStatus, served by grpcio with the messages generated from
proto/registration.proto, as the DRA and health services are.

It opens last (`agent.app.daemon`): GetInfo names the DRA socket, which the kubelet calls right after
registering, so that socket answers first. It is a gRPC server of its own, so a GetInfo (1 s kubelet
timeout) never waits in a queue behind prepares on the DRA socket.

GetInfo lists exactly the services the DRA socket serves: the kubelet picks the newest health
version it finds there and, should that service answer Unimplemented, stops watching until the
plugin registers again. So the health versions are listed only where they are served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from agent.config import Settings
from agent.kubelet import sockets
from agent.pb import registration_pb2, registration_pb2_grpc

log = logging.getLogger("agent.kubelet.server")

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
        # Called on the event loop each time the kubelet says it registered the plugin: a kubelet that
        # starts deletes every ResourceSlice of its node, so the agent publishes again (`agent.app.daemon`).
        self.on_registered: Callable[[], None] | None = None


def supported_versions(health: bool) -> list[str]:
    """The services GetInfo lists: the DRA versions, and the health versions when they are served."""
    return [*DRA_VERSIONS, *(HEALTH_VERSIONS if health else ())]


class RegistrationServicer(registration_pb2_grpc.RegistrationServicer):
    def __init__(self, info: registration_pb2.PluginInfo, state: RegistrationState) -> None:
        self.info = info
        self.state = state

    async def GetInfo(self, request: Any, context: Any) -> registration_pb2.PluginInfo:
        self.state.info_calls += 1
        return self.info

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> registration_pb2.RegistrationStatusResponse:
        state = self.state
        state.registered, state.error, state.updated_at = request.plugin_registered, request.error, time.time()
        if request.plugin_registered:
            log.info("the kubelet registered the plugin")
            if state.on_registered is not None:
                state.on_registered()
        else:
            log.error("THE KUBELET REJECTED THE PLUGIN REGISTRATION: %s", request.error or "(no reason given)")
        return registration_pb2.RegistrationStatusResponse()


class RegistrationServer:
    """The registration socket and its server. `start` binds it (the socket put in place atomically,
    replacing an earlier agent's); `restore` binds it again when the file was removed from under the
    agent; `stop` closes it and removes the file while it is still this process's own."""

    def __init__(self, settings: Settings, state: RegistrationState | None = None, *, health: bool = True) -> None:
        self.path = settings.registration_socket
        self.health = health
        self.state = state or RegistrationState()
        self._servicer = RegistrationServicer(registration_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=settings.driver_name, endpoint=str(settings.dra_socket),
            supported_versions=supported_versions(health)), self.state)
        self._socket = sockets.ServedSocket(self.path, self._new)

    @property
    def started(self) -> bool:
        return self._socket.started

    def _new(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        registration_pb2_grpc.add_RegistrationServicer_to_server(self._servicer, server)
        return server

    async def start(self) -> None:
        if not self._socket.started:
            await self._socket.start()
            log.info("registration service listening on %s", self.path)

    async def restore(self) -> bool:
        """Bind a fresh socket when the file is gone (`sockets.ServedSocket.restore`); the kubelet
        registers the plugin again when it sees it appear."""
        if not await self._socket.restore(1.0):
            return False
        self.state.registered = None  # until the kubelet registers it again
        return True

    async def stop(self, grace: float = 1.0) -> None:
        await self._socket.stop(grace)

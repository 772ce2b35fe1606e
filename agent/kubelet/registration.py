"""The registration service the kubelet's plugin watcher calls (`plugins_registry/<driver>-reg.sock`):
GetInfo, then NotifyRegistrationStatus.

It is the first thing `dra-agent run` opens, before gRPC, asyncio, protobuf or any of the agent's
heavier modules are imported (they take most of a second on a small node), and it answers from then
on for the life of the process: in a thread of its own (`agent.kubelet.h2server`), never queued
behind the event loop or a prepare. Its two messages (proto/registration.proto) are four strings
out and a bool and a string in, encoded here by hand for that reason.

GetInfo lists exactly the services the DRA socket serves: the kubelet picks the newest health
version it finds there and, should that service answer Unimplemented, stops watching until the
plugin registers again. So the health versions are listed only where they are served.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from agent.config import Settings
from agent.kubelet import sockets
from agent.kubelet.h2server import INTERNAL, GrpcError, UnaryServer

log = logging.getLogger("agent.kubelet.server")

PLUGIN_TYPE = "DRAPlugin"
DRA_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_VERSIONS = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")  # newest first, as the kubelet picks
SERVICE = "/pluginregistration.Registration/"


class RegistrationState:
    """What the kubelet last told us about our registration (for logs, health and metrics)."""

    def __init__(self) -> None:
        self.registered: bool | None = None
        self.error = ""
        self.updated_at = 0.0
        self.info_calls = 0
        # Called (in the registration server's thread) each time the kubelet says it registered the
        # plugin: a kubelet that starts deletes every ResourceSlice of its node, so the agent publishes
        # again (`agent.app.daemon`).
        self.on_registered: Callable[[], None] | None = None


def supported_versions(health: bool) -> list[str]:
    """The services GetInfo lists: the DRA versions, and the health versions when they are served."""
    return [*DRA_VERSIONS, *(HEALTH_VERSIONS if health else ())]


# -- the messages (protobuf wire format: a key of field number and wire type, then the value) -------

def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def plugin_info(kind: str, name: str, endpoint: str, versions: list[str]) -> bytes:
    """PluginInfo: type = 1, name = 2, endpoint = 3, repeated supported_versions = 4 (all strings)."""
    out = bytearray()
    for number, value in ((1, kind), (2, name), (3, endpoint), *((4, v) for v in versions)):
        data = value.encode()
        if data or number == 4:  # proto3 leaves empty singular strings out
            out += _varint(number << 3 | 2) + _varint(len(data)) + data
    return bytes(out)


def registration_status(data: bytes) -> tuple[bool, str]:
    """RegistrationStatus: plugin_registered = 1 (bool), error = 2 (string); other fields skipped."""
    registered, error, pos = False, "", 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= len(data) or shift > 63:
                raise GrpcError(INTERNAL, "malformed RegistrationStatus")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = varint()
            if number == 1:
                registered = value != 0
        elif wire == 2:
            length = varint()
            if pos + length > len(data):
                raise GrpcError(INTERNAL, "malformed RegistrationStatus")
            if number == 2:
                error = data[pos:pos + length].decode(errors="replace")
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise GrpcError(INTERNAL, "malformed RegistrationStatus")
    if pos > len(data):
        raise GrpcError(INTERNAL, "malformed RegistrationStatus")
    return registered, error


# -- the server -----------------------------------------------------------------------------------

class RegistrationServer:
    """The registration socket and its server. `start` binds it (the socket put in place atomically,
    replacing an earlier agent's); `restore` binds it again when the file was removed from under the
    agent; `stop` closes it and removes the file while it is still this process's own."""

    def __init__(self, settings: Settings, state: RegistrationState | None = None, *, health: bool = True) -> None:
        self.path = settings.registration_socket
        self.health = health
        self.state = state or RegistrationState()
        self._info = plugin_info(PLUGIN_TYPE, settings.driver_name, str(settings.dra_socket),
                                 supported_versions(health))
        self._server = UnaryServer({SERVICE + "GetInfo": self._get_info,
                                    SERVICE + "NotifyRegistrationStatus": self._notify}, "registration")
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.identity: sockets.SocketIdentity | None = None

    @property
    def started(self) -> bool:
        return self._listener is not None

    def start(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            self._listener, self.identity = sockets.listen(self.path)
            self._server.serve(self._listener)
            self._server.start()
        log.info("registration service listening on %s", self.path)

    def restore(self) -> bool:
        """Bind a fresh socket when the file is gone (a kubelet restart cleaning its plugin
        directories); the kubelet registers the plugin again when it sees it appear. A path that
        holds another socket (an agent that replaced this one) is left alone."""
        with self._lock:
            if self._listener is None or sockets.identity(self.path) is not None:
                return False
            fresh, self.identity = sockets.listen(self.path)
            self._server.retire(self._listener)
            self._listener = fresh
            self._server.serve(fresh)
            self.state.registered = None  # until the kubelet registers it again
        return True

    def stop(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            own, self.identity = self.identity, None
        if listener is None:
            return
        self._server.stop()
        if own is not None:
            with contextlib.suppress(OSError):
                sockets.remove_own_socket(self.path, own)

    def _get_info(self, request: bytes) -> bytes:
        self.state.info_calls += 1
        return self._info

    def _notify(self, request: bytes) -> bytes:
        registered, error = registration_status(request)
        self.state.registered, self.state.error, self.state.updated_at = registered, error, time.time()
        if registered:
            log.info("the kubelet registered the plugin")
            if self.state.on_registered is not None:
                self.state.on_registered()
        else:
            log.error("THE KUBELET REJECTED THE PLUGIN REGISTRATION: %s", error or "(no reason given)")
        return b""  # RegistrationStatusResponse: no fields

"""A client that calls the agent's sockets the way the kubelet does.

Used by `dra-agent kubelet ...` for a person at the node, by the tests as the
kubelet stand-in, and by the benchmark. Each call imports only the message modules it
uses: `dra-agent kubelet info` is a command a person waits for.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from agent.names import ClaimRef

GET_INFO_TIMEOUT = 1.0  # the kubelet's
PREPARE_TIMEOUT = 45.0  # the kubelet's

_DRA = {"v1": "dra_v1", "v1beta1": "dra_v1beta1"}
_HEALTH = {"v1": "health_v1", "v1alpha1": "health_v1alpha1"}


def _modules(stem: str) -> tuple[Any, Any]:
    """The message and service modules of one API (`agent.pb.<stem>_pb2`, `..._pb2_grpc`)."""
    return (importlib.import_module(f"agent.pb.{stem}_pb2"), importlib.import_module(f"agent.pb.{stem}_pb2_grpc"))


def channel(socket: Path) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"unix://{socket}")


def to_dict(message: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    return json_format.MessageToDict(message, preserving_proto_field_name=True)


async def get_info(socket: Path, timeout: float = GET_INFO_TIMEOUT) -> Any:
    registration_pb2, registration_pb2_grpc = _modules("registration")
    async with channel(socket) as ch:
        stub = registration_pb2_grpc.RegistrationStub(ch)
        return await stub.GetInfo(registration_pb2.InfoRequest(), timeout=timeout)


async def empty_prepare(socket: Path, timeout: float = GET_INFO_TIMEOUT) -> Any:
    """NodePrepareResources (v1) without claims: shows that the DRA server answers, and changes nothing."""
    dra_v1_pb2, dra_v1_pb2_grpc = _modules("dra_v1")
    async with channel(socket) as ch:
        stub = dra_v1_pb2_grpc.DRAPluginStub(ch)
        return await stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(), timeout=timeout)


async def notify_registration(socket: Path, registered: bool, error: str = "") -> None:
    registration_pb2, registration_pb2_grpc = _modules("registration")
    async with channel(socket) as ch:
        stub = registration_pb2_grpc.RegistrationStub(ch)
        await stub.NotifyRegistrationStatus(
            registration_pb2.RegistrationStatus(plugin_registered=registered, error=error), timeout=5)


class DRAClient:
    """A long-lived connection to the DRA socket (one channel, like the kubelet's)."""

    def __init__(self, socket: Path, api: str = "v1") -> None:
        if api not in _DRA:
            raise ValueError(f"api must be one of {', '.join(_DRA)}")
        self.pb, grpc_mod = _modules(_DRA[api])
        self._channel = channel(socket)
        self._stub = grpc_mod.DRAPluginStub(self._channel)

    async def __aenter__(self) -> DRAClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _claims(self, refs: Sequence[ClaimRef]) -> list[Any]:
        return [self.pb.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in refs]

    async def prepare(self, refs: Sequence[ClaimRef], timeout: float = PREPARE_TIMEOUT) -> Any:
        return await self._stub.NodePrepareResources(
            self.pb.NodePrepareResourcesRequest(claims=self._claims(refs)), timeout=timeout)

    async def unprepare(self, refs: Sequence[ClaimRef], timeout: float = PREPARE_TIMEOUT) -> Any:
        return await self._stub.NodeUnprepareResources(
            self.pb.NodeUnprepareResourcesRequest(claims=self._claims(refs)), timeout=timeout)


async def watch_health(socket: Path, api: str = "v1") -> AsyncIterator[Any]:
    if api not in _HEALTH:
        raise ValueError(f"api must be one of {', '.join(_HEALTH)}")
    pb, grpc_mod = _modules(_HEALTH[api])
    async with channel(socket) as ch:
        stub = grpc_mod.DRAResourceHealthStub(ch)
        async for response in stub.NodeWatchResources(pb.NodeWatchResourcesRequest()):
            yield response

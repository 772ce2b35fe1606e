"""The kubelet's pod resources service: what the pods on this node hold now, as the kubelet says.

The kubelet serves `v1.PodResourcesLister` on `<kubelet dir>/pod-resources/kubelet.sock`
(`Settings.pod_resources_socket`; the messages in `proto/podresources_v1.proto`). The agent is a client
that reads, nothing else: `List` gives every pod the kubelet runs on the node, each container with the
device-plugin devices it was assigned and the ResourceClaims it names, each by namespace and name (the
kubelet gives no claim UID). Garbage collection reads which claims pods on this node use
(`NodePods.claims_in_use`, `agent.engine.gc`), so that it never has to list claims in the API server;
`NodePods.device_ids` says which device-plugin device IDs are assigned to pods now.

The DaemonSet mounts the host's directory, not the socket: the kubelet makes a new socket file when it
restarts, and a mount of the old file would keep pointing at nothing (docs/deployment.md, "The pod's
privileges"). The channel is dialled by path, so it reaches the new socket by itself.

Every failure is a `PodResourcesUnavailable` whose message says what is wrong and what to do: the
socket absent (`PodResourcesAbsent`: not mounted, or no kubelet on this node yet), the kubelet not
answering in time, or answering with an error.
"""

from __future__ import annotations

import asyncio
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.names import ClaimName

TIMEOUT = 10.0  # seconds a List may take: the kubelet answers from memory
# A node's pods with their containers, devices and claims: far below this; the kubelet's own server takes
# 16 MiB, and gRPC's default of 4 MiB for what a client receives would refuse more than a node can hold.
MAX_MESSAGE = 16 << 20
SOCKET_DIR = "pod-resources"
SOCKET_NAME = "kubelet.sock"


class PodResourcesUnavailable(Exception):
    """The kubelet's pod resources service did not say what the pods hold; the message says why."""


class PodResourcesAbsent(PodResourcesUnavailable):
    """No socket where the kubelet serves it."""


@dataclass(frozen=True, slots=True)
class PluginDevices:
    """Devices of one extended resource a device plugin gave a container (`example.com/gpu`)."""

    resource: str
    ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ClaimDevice:
    """One device of a claim, as the kubelet holds it for a container."""

    driver: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ClaimUse:
    """A claim a container names, with the devices the kubelet prepared for it."""

    claim: ClaimName
    devices: tuple[ClaimDevice, ...]


@dataclass(frozen=True, slots=True)
class ContainerHolds:
    name: str
    plugin_devices: tuple[PluginDevices, ...]
    claims: tuple[ClaimUse, ...]


@dataclass(frozen=True, slots=True)
class PodHolds:
    namespace: str
    name: str
    containers: tuple[ContainerHolds, ...]


@dataclass(frozen=True, slots=True)
class NodePods:
    """Every pod the kubelet runs on this node, with what its containers hold."""

    pods: tuple[PodHolds, ...]

    def claims_in_use(self) -> frozenset[ClaimName]:
        """The claims some container of a pod on this node names. A claim only the pod names (no container
        asks for it) is not here: the kubelet lists claims per container."""
        return frozenset(use.claim for pod in self.pods for c in pod.containers for use in c.claims)

    def device_ids(self, resource: str) -> frozenset[str]:
        """The device-plugin device IDs of `resource` assigned to containers on this node now."""
        return frozenset(i for pod in self.pods for c in pod.containers for d in c.plugin_devices
                         if d.resource == resource for i in d.ids)


def node_pods(response: Any) -> NodePods:
    """The records of a `ListPodResourcesResponse`."""
    return NodePods(tuple(_pod(p) for p in response.pod_resources))


def _pod(pod: Any) -> PodHolds:
    return PodHolds(pod.namespace, pod.name, tuple(
        ContainerHolds(c.name, tuple(PluginDevices(d.resource_name, tuple(d.device_ids)) for d in c.devices),
                       tuple(_claim(r) for r in c.dynamic_resources))
        for c in pod.containers))


def _claim(resource: Any) -> ClaimUse:
    return ClaimUse(ClaimName(resource.claim_namespace, resource.claim_name), tuple(
        ClaimDevice(r.driver_name, r.pool_name, r.device_name, tuple(d.name for d in r.cdi_devices))
        for r in resource.claim_resources))


class PodResourcesClient:
    """One channel to the kubelet's pod resources socket, for the agent's life (`close` ends it)."""

    def __init__(self, socket: Path, timeout: float = TIMEOUT) -> None:
        self.socket = socket
        self.timeout = timeout
        self._channel: Any = None
        self._stub: Any = None

    async def list(self) -> NodePods:
        """Every pod on the node and what it holds (`List`)."""
        import grpc

        from agent.pb import podresources_v1_pb2 as pb

        stub = await self._connect()
        try:
            response = await stub.List(pb.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and not await asyncio.to_thread(self._socket_there):
                raise self._absent() from exc
            raise PodResourcesUnavailable(
                f"the kubelet's pod resources service on {self.socket} did not answer List: {exc.code().name}: "
                f"{exc.details()}") from exc
        return node_pods(response)

    async def claims_in_use(self) -> frozenset[ClaimName]:
        """The claims the pods on this node use now (`agent.engine.gc.PodClaims`)."""
        return (await self.list()).claims_in_use()

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    async def _connect(self) -> Any:
        if not await asyncio.to_thread(self._socket_there):
            # Said at once, and clearly: gRPC would only say it cannot connect, after its own backoff.
            await self.close()
            raise self._absent()
        if self._stub is None:
            import grpc

            from agent.pb import podresources_v1_pb2_grpc as pb_grpc

            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket}", options=[("grpc.max_receive_message_length", MAX_MESSAGE)])
            self._stub = pb_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    def _socket_there(self) -> bool:
        try:
            return stat.S_ISSOCK(os.stat(self.socket).st_mode)
        except OSError:
            return False

    def _absent(self) -> PodResourcesAbsent:
        return PodResourcesAbsent(absent_message(self.socket))


def absent_message(socket: Path) -> str:
    return (f"the kubelet's pod resources socket {socket} does not exist: mount the host's "
            f"{socket.parent} into the agent's pod (deploy/base/daemonset.yaml does, read-only), and check that "
            "the kubelet runs (it makes the socket at its start)")


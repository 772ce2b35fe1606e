"""A stand-in of the kubelet's pod resources service (`v1.PodResourcesLister`, proto/podresources_v1.proto) on
a real unix socket at the path the kubelet uses below a kubelet directory: the tests and the benchmark set
which pods run on the node and which claims their containers name, or make it fail, and count its calls.

A gRPC server of its own threads: it answers whether the caller runs an event loop or not."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from agent.names import ClaimRef
from agent.pb import podresources_v1_pb2 as pb
from agent.pb import podresources_v1_pb2_grpc as pb_grpc


def socket_of(kubelet_dir: Path) -> Path:
    return kubelet_dir / "pod-resources" / "kubelet.sock"


@dataclass
class Pod:
    """A pod on the node: its containers' claims (namespace, name) and device-plugin devices."""

    namespace: str
    name: str
    claims: tuple[tuple[str, str], ...] = ()
    plugin_devices: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (resource, device IDs)

    def message(self) -> Any:
        container = pb.ContainerResources(
            name="main",
            devices=[pb.ContainerDevices(resource_name=r, device_ids=list(ids)) for r, ids in self.plugin_devices],
            dynamic_resources=[pb.DynamicResource(claim_namespace=ns, claim_name=name) for ns, name in self.claims])
        return pb.PodResources(namespace=self.namespace, name=self.name, containers=[container])


class PodResourcesStandIn(pb_grpc.PodResourcesListerServicer):
    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.pods: list[Pod] = []
        self.failure: grpc.StatusCode | None = None  # List answers this error while set
        self.calls = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def use(self, *claims: ClaimRef | tuple[str, str], pod: str = "user") -> None:
        """A pod `pod` (in the first claim's namespace) whose container names these claims, replacing any of that
        name."""
        pairs = tuple((c.namespace, c.name) if isinstance(c, ClaimRef) else c for c in claims)
        with self._lock:
            self.pods = [p for p in self.pods if p.name != pod]
            if pairs:
                self.pods.append(Pod(pairs[0][0], pod, pairs))

    def set_pods(self, pods: Iterable[Pod]) -> None:
        with self._lock:
            self.pods = list(pods)

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            self.calls += 1
            failure, pods = self.failure, list(self.pods)
        if failure is not None:
            context.abort(failure, "the stand-in kubelet fails as the test asked")
        return pb.ListPodResourcesResponse(pod_resources=[p.message() for p in pods])

    def start(self) -> PodResourcesStandIn:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PodResourcesListerServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        self.socket.unlink(missing_ok=True)

    def __enter__(self) -> PodResourcesStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

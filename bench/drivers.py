"""The two drivers `make bench` runs, each as its own process with its own kubelet directory, CDI
directory and state, and the claims both read.

- `OurAgent`: `dra-agent run --offline DIR` with simulated GPUs, as `make run` starts it; it reads
  each claim from DIR/resourceclaims/<namespace>/<name>.yaml.
- `PeerDriver`: bench/peer/driver, on the official kubeletplugin helper; it reads each claim with
  client-go from the claims API stand-in (bench/peer/claimsapi), which serves the same files.

Both register the same way (`<kubelet dir>/plugins_registry/<driver>-reg.sock`, DRA socket
`<kubelet dir>/plugins/<driver>/dra.sock`), and this process calls both as the kubelet does.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import yaml
from probes import rss_mib

from agent.config import build_settings
from agent.kubelet import client as kc
from agent.names import ClaimRef

ROOT = Path(__file__).resolve().parents[1]
DRIVER = "dra.example.com"
NODE = "bench-node"
NAMESPACE = "bench"


def uid_of(i: int) -> str:
    return f"b0000000-0000-4000-8000-{i:012d}"


def share_id_of(i: int) -> str:
    return f"5a000000-0000-4000-8000-{i:012d}"


class Claims:
    """The ResourceClaims both drivers read: YAML files in the offline directory."""

    def __init__(self, offline: Path) -> None:
        self.offline = offline
        self.directory = offline / "resourceclaims" / NAMESPACE
        self.directory.mkdir(parents=True)

    def write(self, name: str, uid: str, devices: list[str], share: tuple[str, str] | None = None) -> ClaimRef:
        """A claim allocated `devices` of this node's pool; `share` (share ID, memory) makes the
        single device a share of a shared GPU, as the scheduler allocates one."""
        results: list[dict[str, Any]] = [
            {"request": "req", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]
        if share is not None:
            results[0]["shareID"], results[0]["consumedCapacity"] = share[0], {"memory": share[1]}
        doc = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
               "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid},
               "status": {"allocation": {"devices": {"results": results}}}}
        (self.directory / f"{name}.yaml").write_text(yaml.safe_dump(doc))
        return ClaimRef(NAMESPACE, name, uid)


class Driver:
    """One driver process: started and stopped, its registration and DRA sockets."""

    label = ""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.kubelet_dir = work / "kubelet"
        self.registration_socket = self.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
        self.dra_socket = self.kubelet_dir / "plugins" / DRIVER / "dra.sock"
        self.log = work / f"{self.label}.log"
        work.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    async def start(self) -> tuple[float, float]:
        """Start the process; seconds from exec until GetInfo is answered on the registration
        socket, and until the DRA socket answers an empty NodePrepareResources."""
        argv = self.argv()
        with self.log.open("ab") as log:
            started = time.perf_counter()
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
        info = dra = 0.0
        while not (info and dra):
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.label} exited ({self.proc.returncode}); see {self.log}")
            # A call only once the socket exists: a call to a missing socket puts gRPC's (shared)
            # subchannel into its reconnect backoff, and the next calls would measure that backoff.
            if not info and self.registration_socket.exists():
                info = await _answered(lambda: kc.get_info(self.registration_socket, timeout=1.0), started)
            if not dra and self.dra_socket.exists():
                dra = await _answered(lambda: kc.empty_prepare(self.dra_socket, timeout=1.0), started)
            if not (info and dra):
                await asyncio.sleep(0.002)
        return info, dra

    def rss(self) -> int:
        assert self.proc is not None
        return rss_mib(self.proc.pid)

    def stop(self) -> int:
        """Stop the process; its RSS (MiB) just before."""
        assert self.proc is not None
        rss = self.rss()
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.proc = None
        return rss

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class OurAgent(Driver):
    label = "agent"

    def __init__(self, work: Path, offline: Path) -> None:
        super().__init__(work)
        self.offline = offline
        self.settings = build_settings({
            "driver_name": DRIVER, "node_name": NODE, "kubelet_dir": self.kubelet_dir, "cdi_dir": work / "cdi",
            "static_cdi_dir": work / "cdi-static", "state_dir": work / "state", "offline": offline,
            "nvml": "sim", "gpu_sharing": True})
        assert self.settings.registration_socket == self.registration_socket
        assert self.settings.dra_socket == self.dra_socket

    def flags(self) -> list[str]:
        s = self.settings
        # --gpu-sharing: the shared form of each GPU, whose shares the node fill allocates.
        return ["--driver-name", DRIVER, "--node-name", NODE, "--nvml", "sim", "--gpu-sharing", "true",
                "--kubelet-dir", str(s.kubelet_dir), "--cdi-dir", str(s.cdi_dir),
                "--static-cdi-dir", str(s.static_cdi_dir), "--state-dir", str(s.state_dir),
                "--offline", str(s.offline)]

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "agent", "run", *self.flags(), "--log-format", "json",
                "--rescan-interval", "3600", "--metrics-address", ""]


class PeerDriver(Driver):
    label = "peer"

    def __init__(self, work: Path, binary: Path, api_url: str, attributes: Path, metadata: bool) -> None:
        super().__init__(work)
        self.binary, self.api_url, self.attributes, self.metadata = binary, api_url, attributes, metadata

    def argv(self) -> list[str]:
        return [str(self.binary), "--driver-name", DRIVER, "--node-name", NODE,
                "--kubelet-dir", str(self.kubelet_dir), "--cdi-dir", str(self.work / "cdi"),
                "--state-dir", str(self.work / "state"), "--api-server", self.api_url,
                f"--device-metadata={str(self.metadata).lower()}", "--device-attributes", str(self.attributes)]


async def _answered(call: Callable[[], Awaitable[Any]], started: float) -> float:
    """Seconds since `started` if the call is answered now, else 0."""
    try:
        await call()
    except grpc.aio.AioRpcError:
        return 0.0
    return time.perf_counter() - started

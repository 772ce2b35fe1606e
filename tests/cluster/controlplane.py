"""A real Kubernetes control plane on 127.0.0.1 for the tests: etcd, kube-apiserver, and optionally
kube-scheduler and kube-controller-manager, built by `tests/cluster/build.py`.

Everything listens on free loopback ports and lives in one temporary directory (certificates,
etcd's data, kubeconfigs, each component's log), removed at `stop`. The API server authorizes
with Node,RBAC, signs service-account tokens with its own key, and runs every DRA feature gate of
the release on (`DRA_GATES`) unless a test turns one off.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .pki import Pair, Pki

# Every DRA feature gate of Kubernetes 1.37 (pkg/features/kube_features.go), with the one gate a DRA
# gate depends on that is off by default (DRAWorkloadResourceClaims needs GenericWorkload).
# test_cluster_deploy.py checks this list against the gates the built API server knows.
DRA_GATES: tuple[str, ...] = (
    "DRAAdminAccess", "DRAConsumableCapacity", "DRADerivedAttributes", "DRADeviceBindingConditions",
    "DRADeviceCompatibilityGroups", "DRADeviceTaintRules", "DRADeviceTaints", "DRAExtendedResource",
    "DRAFractionalCapacityRange", "DRAListTypeAttributes", "DRANodeAllocatableResources",
    "DRAOptionalNodeOperations", "DRAPartitionableDevices", "DRAPartitionableDevicesType", "DRAPrioritizedList",
    "DRAResourceClaimDeviceStatus", "DRAResourceClaimGranularStatusAuthorization", "DRAResourcePoolStatus",
    "DRASchedulerFilterTimeout", "DRAWorkloadResourceClaims",
)
DEPENDENCY_GATES: tuple[str, ...] = ("GenericWorkload",)
# resource.k8s.io versions that exist in 1.37 but are off by default (pkg/controlplane/instance.go), and
# scheduling.k8s.io/v1beta1, whose PodGroups DRAWorkloadResourceClaims works with.
RUNTIME_CONFIG = ("resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true,resource.k8s.io/v1alpha3=true,"
                  "scheduling.k8s.io/v1beta1=true")
SERVICE_CIDR = "10.96.0.0/24"
ISSUER = "https://kubernetes.default.svc.cluster.local"
START_LIMIT = 120.0  # seconds for a component to become ready: a bound, not an expectation


class ControlPlaneError(RuntimeError):
    """A component did not start or answer; the message carries the end of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Component:
    name: str
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            # Its own process group, so that stop() reaches anything it started.
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds: a cluster thrown away needs no graceful
        shutdown (the API server's takes over ten seconds with watches open)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def failure(self, why: str) -> ControlPlaneError:
        state = f"exited {self.proc.returncode}" if self.proc and self.proc.poll() is not None else "running"
        return ControlPlaneError(f"{self.name} {why} ({state}); log {self.log}:\n{tail(self.log)}")


def kubeconfig(path: Path, server: str, ca: Path, *, cert: Pair | None = None, token: str | None = None,
               name: str = "test") -> Path:
    """A kubeconfig for `server` as one user: a client certificate or a bearer token."""
    user: dict[str, Any] = {}
    if cert is not None:
        user = {"client-certificate": str(cert.cert), "client-key": str(cert.key)}
    if token is not None:
        user = {"token": token}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": name,
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
    }))
    path.chmod(0o600)
    return path


# The controllers of a plane whose Nodes have no kubelet (`Cluster.add_node`). No kubelet renews their
# leases: the node lifecycle controller would mark them unreachable and evict the pod the agent's token
# is bound to (the token would die with it). The agent runs as a process of the test, not as the
# DaemonSet's pod: a real kubelet (nodekit) given that pod would make its host paths on this machine.
WITHOUT_KUBELETS = "*,-node-lifecycle-controller,-daemonset-controller"
# The controllers of a plane whose node is a real kubelet (test_cluster_kubelet.py): the node lifecycle
# controller, which takes the `node.kubernetes.io/not-ready` taint the kubelet registers its Node with
# away once the Node is Ready, as in any cluster.
WITH_KUBELETS = "*,-daemonset-controller"


@dataclass
class ControlPlane:
    """etcd and the API server, plus the scheduler and controller-manager when `full`."""

    bin: Path
    root: Path
    pki: Pki
    gates: Mapping[str, bool] = field(default_factory=dict)  # over DRA_GATES (all on)
    full: bool = True
    runtime_config: str = RUNTIME_CONFIG
    controllers: str = WITHOUT_KUBELETS
    components: list[Component] = field(default_factory=list)
    server: str = ""
    admin: Pair | None = None
    admin_kubeconfig: Path | None = None
    scheduler_health: str = ""
    controller_manager_health: str = ""
    started_in: float = 0.0

    def feature_gates(self) -> str:
        gates = {g: True for g in (*DRA_GATES, *DEPENDENCY_GATES)}
        gates.update(self.gates)
        return ",".join(f"{k}={'true' if v else 'false'}" for k, v in sorted(gates.items()))

    def _component(self, name: str, args: Sequence[str]) -> Component:
        c = Component(name, [str(self.bin / name), *args], self.root / f"{name}.log")
        self.components.append(c)
        return c

    def start(self) -> None:
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd = self._component("etcd", [
            "--name=test", f"--data-dir={self.root / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=test=http://127.0.0.1:{peer_port}",
            # A cluster that lives for one test session: durability buys nothing and fsyncs cost seconds.
            "--unsafe-no-fsync=true", "--log-level=warn"])
        etcd.start()
        serving = self.pki.serving("apiserver", dns=("localhost", "kubernetes", "kubernetes.default",
                                                     "kubernetes.default.svc"), ips=("127.0.0.1", "10.96.0.1"))
        self.admin = self.pki.client("admin", "kubernetes-admin", "system:masters")
        self.server = f"https://127.0.0.1:{api_port}"
        apiserver = self._component("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self.pki.ca}",
            f"--service-account-issuer={ISSUER}", f"--service-account-key-file={self.pki.sa_pub}",
            f"--service-account-signing-key-file={self.pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            "--enable-admission-plugins=NodeRestriction",
            f"--feature-gates={self.feature_gates()}", f"--runtime-config={self.runtime_config}",
            # The endpoint reconciler refuses a loopback advertise address; nothing here dials the
            # `kubernetes` Service anyway.
            "--endpoint-reconciler-type=none", "--profiling=false", "--v=1"])
        self._wait_etcd(etcd, etcd_port)
        apiserver.start()
        self.admin_kubeconfig = kubeconfig(self.root / "admin.kubeconfig", self.server, self.pki.ca, cert=self.admin)
        # Their kubeconfigs and certificates are made while the API server starts.
        identities = (self._identity("scheduler", "system:kube-scheduler"),
                      self._identity("controller-manager", "system:kube-controller-manager")) if self.full else ()
        self._wait_https(apiserver, f"{self.server}/readyz")
        if identities:
            # Only now: they give up at once when their roles (made by the API server's bootstrap
            # hook, part of /readyz) are not there yet.
            self._start_scheduler(identities[0])
            self._start_controller_manager(identities[1])
        self.started_in = time.monotonic() - started

    def _identity(self, stem: str, user: str) -> Path:
        pair = self.pki.client(stem, user)
        return kubeconfig(self.root / f"{stem}.kubeconfig", self.server, self.pki.ca, cert=pair)

    def _start_scheduler(self, config: Path) -> None:
        port = free_port()
        c = self._component("kube-scheduler", [
            f"--kubeconfig={config}", f"--authentication-kubeconfig={config}", f"--authorization-kubeconfig={config}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", "--leader-elect=false",
            # Only /healthz is asked, which needs no authentication: no request-header CA to look up.
            "--authentication-skip-lookup=true", f"--feature-gates={self.feature_gates()}"])
        c.start()
        self.scheduler_health = f"https://127.0.0.1:{port}/healthz"

    def _start_controller_manager(self, config: Path) -> None:
        port = free_port()
        c = self._component("kube-controller-manager", [
            f"--kubeconfig={config}", f"--authentication-kubeconfig={config}", f"--authorization-kubeconfig={config}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", "--leader-elect=false",
            "--authentication-skip-lookup=true",
            f"--service-account-private-key-file={self.pki.sa_key}", f"--root-ca-file={self.pki.ca}",
            # Each controller as its own service account: the bootstrap RBAC policy grants the
            # controllers' permissions to those, not to the controller-manager's own user.
            "--use-service-account-credentials=true", f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--controllers={self.controllers}",
            f"--feature-gates={self.feature_gates()}"])
        c.start()
        self.controller_manager_health = f"https://127.0.0.1:{port}/healthz"

    def wait_components(self) -> None:
        """Until the scheduler and the controller-manager answer /healthz (their own serving
        certificates are self-signed: only that they answer 200 is checked)."""
        if not self.full:
            return
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        for c in self.components:
            if c.name == "kube-scheduler":
                self._wait_https(c, self.scheduler_health, context=insecure)
            elif c.name == "kube-controller-manager":
                self._wait_https(c, self.controller_manager_health, context=insecure)

    def _wait_etcd(self, etcd: Component, port: int) -> None:
        deadline = time.monotonic() + START_LIMIT
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if not etcd.running():
                raise etcd.failure("did not start")
            if time.monotonic() > deadline:
                raise etcd.failure(f"not healthy within {START_LIMIT:g} s")
            time.sleep(0.05)

    def _wait_https(self, component: Component, url: str, context: ssl.SSLContext | None = None) -> None:
        if context is None:
            context = ssl.create_default_context(cafile=str(self.pki.ca))
            assert self.admin is not None
            context.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        deadline = time.monotonic() + START_LIMIT
        last = ""
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5, context=context) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[-2000:]}"
            except (OSError, urllib.error.URLError) as exc:
                last = str(exc)
            if not component.running():
                raise component.failure(f"stopped before {url} answered")
            if time.monotonic() > deadline:
                raise component.failure(f"{url} not ready within {START_LIMIT:g} s: {last}")
            time.sleep(0.1)

    def check_running(self) -> None:
        for c in self.components:
            if not c.running():
                raise c.failure("is not running")

    def logs(self, lines: int = 40) -> str:
        return "\n\n".join(f"--- {c.name} ({c.log}):\n{tail(c.log, lines)}" for c in self.components)

    def stop(self) -> None:
        # The components that talk to the API server first, etcd last.
        for c in reversed(self.components):
            c.stop()


def start_plane(bin_dir: Path, root: Path, pki: Pki, **options: Any) -> ControlPlane:
    plane = ControlPlane(bin_dir, root, pki, **options)
    try:
        plane.start()
    except BaseException:
        plane.stop()
        raise
    return plane

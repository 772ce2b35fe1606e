"""What the cluster tests use on top of the control plane: a plain REST client (JSON in, JSON out:
no client-side model between the test and what the server stored), the deployment applied as a
user applies it, Nodes, a pod-bound service-account token for the agent, kubeconfigs, and
`dra-agent run` as its own process against the cluster."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import ssl
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import yaml
from podresources import PodResourcesStandIn, socket_of

from .controlplane import ControlPlane, kubeconfig, tail

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
KUBECTL = VENV_BIN / "kubectl"
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
DRIVER = "dra.example.com"
NAMESPACE = "dra-agent"  # deploy/base/namespace.yaml
SERVICE_ACCOUNT = "dra-agent"  # deploy/base/serviceaccount.yaml
NODE = "dra-node-1"  # declares DRANodeAllocatableResources
OTHER_NODE = "dra-node-2"  # declares nothing
NODE_ALLOCATABLE = "DRANodeAllocatableResources"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
WAIT = 60.0  # a bound for what happens in the background, never an expected duration


class ApiFailure(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        message = body.get("message", "") if isinstance(body, dict) else str(body)
        self.message = message
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


class Rest:
    """JSON over HTTPS to the API server as one identity (a client certificate or a token)."""

    def __init__(self, server: str, ca: Path, *, cert: tuple[Path, Path] | None = None,
                 token: str | None = None) -> None:
        context = ssl.create_default_context(cafile=str(ca))
        if cert is not None:
            context.load_cert_chain(str(cert[0]), str(cert[1]))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx2.Client(base_url=server, verify=context, headers=headers, timeout=30.0)

    def request(self, method: str, path: str, body: Any = None, *, params: Mapping[str, str] | None = None,
                content_type: str = "application/json") -> Any:
        # Compact with sorted keys, as kubectl sends what it reads from YAML: the API server 1.37.2
        # compares a claim's opaque configuration byte for byte when its status is patched, against
        # its own re-encoding (docs/tests.md, "What the real components do"), so a claim sent with spaces, or with
        # keys in another order, takes another path of the agent's status writes
        # (test_cluster_claim_status.py sends those on purpose, as raw text).
        data = None if body is None else (
            body if isinstance(body, str | bytes) else json.dumps(body, separators=(",", ":"), sort_keys=True))
        r = self.client.request(method, path, content=data, params=params,
                                headers={"Content-Type": content_type} if data is not None else {})
        try:
            answer = r.json()
        except ValueError:
            answer = r.text
        if r.status_code >= 400:
            raise ApiFailure(method, path, r.status_code, answer)
        return answer

    def get(self, path: str, **params: str) -> Any:
        return self.request("GET", path, params=params or None)

    def post(self, path: str, body: Any, **params: str) -> Any:
        return self.request("POST", path, body, params=params or None)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def close(self) -> None:
        self.client.close()


def slices_of(api: Rest, node: str, driver: str = DRIVER) -> list[dict[str, Any]]:
    found = api.get(SLICES, fieldSelector=f"spec.nodeName={node},spec.driver={driver}")["items"]
    return sorted(found, key=lambda s: s["metadata"]["name"])


def devices_of(slices: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}


def eventually(probe: Any, what: str, limit: float = WAIT, interval: float = 0.1) -> Any:
    """Poll `probe` until it returns something truthy; fail naming `what` if it never does."""
    deadline = time.monotonic() + limit
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit:g} s")
        time.sleep(interval)


@dataclass
class Cluster:
    """The control plane, an admin client, and what the tests build on it."""

    plane: ControlPlane
    root: Path
    admin: Rest = field(init=False)
    applied: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # kustomization -> its objects
    ready_in: float = 0.0

    def __post_init__(self) -> None:
        assert self.plane.admin is not None
        self.admin = Rest(self.plane.server, self.plane.pki.ca, cert=(self.plane.admin.cert, self.plane.admin.key))

    @property
    def server(self) -> str:
        return self.plane.server

    def kubeconfig(self, name: str, token: str) -> Path:
        """A kubeconfig for `token` (what the agent and doctor are given)."""
        return kubeconfig(self.root / f"{name}.kubeconfig", self.server, self.plane.pki.ca, token=token, name=name)

    def rest(self, token: str) -> Rest:
        return Rest(self.server, self.plane.pki.ca, token=token)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.plane.admin_kubeconfig is not None
        done = subprocess.run([str(KUBECTL), f"--kubeconfig={self.plane.admin_kubeconfig}", *args], input=stdin,
                              capture_output=True, text=True, timeout=120, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
        return done

    # -- the deployment -------------------------------------------------------------------------------

    def apply_kustomization(self, directory: Path) -> list[dict[str, Any]]:
        """`kubectl kustomize DIR | kubectl apply --server-side` with strict server-side field
        validation, as a user installs it; the rendered objects."""
        rendered = subprocess.run([str(KUBECTL), "kustomize", str(directory)], capture_output=True, text=True,
                                  timeout=120, check=False)
        assert rendered.returncode == 0, f"kubectl kustomize {directory}: {rendered.stderr}"
        self.kubectl("apply", "--server-side", "--field-manager=dra-agent-install", "--validate=strict",
                     "-f", "-", stdin=rendered.stdout)
        return [d for d in yaml.safe_load_all(rendered.stdout) if d]

    def apply_deploy(self) -> None:
        """deploy/ as a user installs it: each overlay, then the base (so the base's objects are what is
        left), every overlay's device classes beside the base's."""
        for overlay in OVERLAYS:
            self.applied[overlay.name] = self.apply_kustomization(overlay)
        self.applied["base"] = self.apply_kustomization(DEPLOY / "base")

    # -- nodes ----------------------------------------------------------------------------------------

    def add_node(self, name: str, declared: Sequence[str] = ()) -> dict[str, Any]:
        """A Node as a kubelet registers it: created, then its status (Ready, capacity, allocatable,
        declared features) written through the status subresource."""
        self.admin.post("/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}}})
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        resources = {"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "500Gi"}
        status: dict[str, Any] = {
            "capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
                            "lastTransitionTime": now}],
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "v1.37.2",
                         "kubeProxyVersion": "", "bootID": "", "containerRuntimeVersion": "containerd://2.1.0",
                         "kernelVersion": "", "machineID": "", "osImage": "", "systemUUID": ""},
        }
        if declared:
            status["declaredFeatures"] = list(declared)
        node = self.admin.merge_patch(f"/api/v1/nodes/{name}/status", {"status": status})
        # The TaintNodesByCondition admission plugin gives every new Node `node.kubernetes.io/not-ready`
        # (NoSchedule); the node lifecycle controller, off here (conftest), takes it away once the Node
        # is Ready. Without this the scheduler places nothing on it.
        return self.admin.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"taints": None}}) if node else node

    # -- the agent's credentials ----------------------------------------------------------------------

    def pod_on(self, node: str, name: str, *, namespace: str = NAMESPACE, service_account: str = SERVICE_ACCOUNT,
               container: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A Pod object bound to `node`: what a service-account token is bound to. No kubelet runs it
        unless the node has one; then `container` is what it runs (an image the node has)."""
        return self.admin.post(f"/api/v1/namespaces/{namespace}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"nodeName": node, "serviceAccountName": service_account, "automountServiceAccountToken": False,
                     "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "agent", "image": "dra-agent:latest", **(container or {})}]}})

    def token(self, *, pod: Mapping[str, Any] | None = None, namespace: str = NAMESPACE,
              service_account: str = SERVICE_ACCOUNT, seconds: int = 3600) -> str:
        """A TokenRequest for the service account; bound to `pod` (and so carrying its node) when given."""
        spec: dict[str, Any] = {"expirationSeconds": seconds}
        if pod is not None:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}
        answer = self.admin.post(f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
                                 {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        return str(answer["status"]["token"])

    def agent_kubeconfig(self, node: str, container: Mapping[str, Any] | None = None) -> Path:
        """A kubeconfig with the agent's own ServiceAccount token bound to a Pod on `node` (the token
        carries the node, as the DaemonSet pod's projected token does)."""
        pod = self.pod_on(node, f"dra-agent-{node}", container=container)
        return self.kubeconfig(f"agent-{node}", self.token(pod=pod))

    def whoami(self, token: str) -> dict[str, Any]:
        rest = self.rest(token)
        try:
            review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
            answer = rest.post("/apis/authentication.k8s.io/v1/selfsubjectreviews", review)
            return dict(answer["status"]["userInfo"])
        finally:
            rest.close()

    def close(self) -> None:
        self.admin.close()


# -- the agent --------------------------------------------------------------------------------------

METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


@dataclass
class AgentProcess:
    proc: subprocess.Popen[bytes]
    log: Path
    metrics_port: int
    root: Path
    # The stand-in of the kubelet's pod resources service the agent's garbage collection asks (None: a real
    # kubelet serves it); a test sets which claims the node's pods use.
    kubelet: PodResourcesStandIn | None = None

    def metrics(self) -> dict[str, float]:
        """The agent's metrics, `name{labels}` -> value."""
        with httpx2.Client(timeout=5.0) as c:
            text = c.get(f"http://127.0.0.1:{self.metrics_port}/metrics").text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if m := METRIC.match(line):
                key = m["name"] + (f"{{{m['labels']}}}" if m["labels"] else "")
                out[key] = float(m["value"])
        return out

    def metric(self, key: str) -> float:
        return self.metrics().get(key, 0.0)

    def records(self) -> list[dict[str, Any]]:
        """The agent's JSON log lines so far."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def messages(self, level: str | None = None) -> list[str]:
        return [r.get("msg", "") for r in self.records() if level is None or r.get("level") == level]

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_published(self, limit: float = WAIT) -> None:
        """Until the agent says its latest inventory is published (the metric), or it exits."""
        def probe() -> bool:
            if not self.running():
                raise AssertionError(f"the agent exited {self.proc.returncode}:\n{tail(self.log, 60)}")
            try:
                return self.metric("dra_agent_publish_up_to_date") == 1.0
            except httpx2.TransportError:
                return False

        try:
            eventually(probe, "the agent publishes its slices", limit)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail(self.log, 60)}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def agent(root: Path, kubeconfig_path: Path, *args: str, node: str = NODE, nvml: str = "sim:dgx-h100",
          env: Mapping[str, str] | None = None, own_kubelet: bool = True,
          log_name: str = "agent.log") -> Iterator[AgentProcess]:
    """`dra-agent run` against the cluster in `kubeconfig_path`, its roots under `root` (kept across
    runs, as on a node: a second run with the same root is a restart), metrics on a free port, JSON
    logs appended to `root/agent.log` (`log_name`: another file, for a second agent running on the same
    roots, as in a rolling update). Stopped with SIGTERM when the block ends. With `own_kubelet`, a
    stand-in of the kubelet's pod resources service runs on its kubelet directory for the agent's life,
    with no pod on the node until a test says otherwise (`AgentProcess.kubelet`); without, a real kubelet
    (or the caller's stand-in) serves it."""

    root.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        standin = stack.enter_context(PodResourcesStandIn(socket_of(root / "kubelet"))) if own_kubelet else None
        with _agent(root, kubeconfig_path, args, node, nvml, env, log_name) as running:
            running.kubelet = standin
            yield running


@contextlib.contextmanager
def _agent(root: Path, kubeconfig_path: Path, args: tuple[str, ...], node: str, nvml: str,
           env: Mapping[str, str] | None, log_name: str = "agent.log") -> Iterator[AgentProcess]:
    from .controlplane import free_port

    port = free_port()
    log = root / log_name
    cmd = [str(VENV_BIN / "dra-agent"), "run", f"--kubeconfig={kubeconfig_path}", f"--node-name={node}",
           f"--nvml={nvml}", f"--kubelet-dir={root / 'kubelet'}", f"--cdi-dir={root / 'cdi'}",
           f"--static-cdi-dir={root / 'cdi-static'}", f"--state-dir={root / 'state'}",
           f"--metrics-address=127.0.0.1:{port}", "--log-format=json", "--rescan-interval=3600", *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DRA_", "KUBECONFIG", "NODE_NAME"))}
    with log.open("ab") as out:
        out.write(f"=== {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root,
                                env={**clean, **(env or {})})
    running = AgentProcess(proc, log, port, root)
    try:
        yield running
    finally:
        running.stop()


class AgentRuns:
    """Starts agents for one test and keeps their logs for its report."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.started: list[AgentProcess] = []

    @contextlib.contextmanager
    def run(self, root_name: str, kubeconfig: Path, *args: str, **options: Any) -> Iterator[AgentProcess]:
        """`clusterkit.agent` with its roots under this test's directory `root_name` (the same name
        again is a restart on the same node)."""
        with agent(self.base / root_name, kubeconfig, *args, **options) as proc:
            self.started.append(proc)
            yield proc

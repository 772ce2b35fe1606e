"""Workloads for the real scheduler, and the kubelet's side of them.

A namespace per test module; ResourceClaims and ResourceClaimTemplates asking for the DeviceClasses
deploy/ ships; Pods pinned to one node by its hostname label, so that the scheduler judges that node
alone (the other tests' agents leave their slices published on nodes of their own); and an agent on
that node, started once for several tests (`NodeAgent`), whose DRA socket is called the way the kubelet
calls it once the scheduler has bound a pod: with each claim's namespace, name and UID, the agent
reading the claim's allocation from the API server itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podresources import PodResourcesStandIn, socket_of

from agent.kubelet import client as kc
from agent.names import ClaimRef

from .clusterkit import (
    DRIVER,
    VENV_BIN,
    AgentProcess,
    AgentRuns,
    ApiFailure,
    Cluster,
    devices_of,
    eventually,
    slices_of,
)

RESOURCE = "/apis/resource.k8s.io/v1"
BUS = "device.attributes['resource.kubernetes.io'].pciBusID"  # a CEL reference to a device's PCI address
KUBELET_TIMEOUT = 60.0


def device_class(kind: str) -> str:
    """The installed name of a class of deploy/ (`gpu` -> gpu.dra.example.com)."""
    return f"{kind}.{DRIVER}"


def attr(name: str) -> str:
    """A CEL reference to one of the driver's own attributes."""
    return f"device.attributes['{DRIVER}'].{name}"


def request(name: str, kind: str, *, count: int | None = None, selectors: Sequence[str] = (),
            capacity: Mapping[str, str] | None = None, tolerations: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """One request of a claim: `count` devices of a class of deploy/ (ExactCount), narrowed by CEL."""
    exactly: dict[str, Any] = {"deviceClassName": device_class(kind)}
    if count is not None:
        exactly |= {"allocationMode": "ExactCount", "count": count}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if capacity:
        exactly["capacity"] = {"requests": dict(capacity)}
    if tolerations:
        exactly["tolerations"] = [dict(t) for t in tolerations]
    return {"name": name, "exactly": exactly}


def claim_spec(*requests: dict[str, Any], config: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if config:
        devices["config"] = [dict(c) for c in config]
    return {"devices": devices}


def results_of(claim: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The allocation results of our driver."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return [r for r in (allocation.get("devices") or {}).get("results") or [] if r["driver"] == DRIVER]


def ref_of(claim: Mapping[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(meta["namespace"], meta["name"], meta["uid"])


def our_status(claim: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The claim's `status.devices` entries of our driver."""
    return [e for e in (claim.get("status") or {}).get("devices") or [] if e["driver"] == DRIVER]


def allocated(claim: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(request, pool, device, shareID) of each result of our driver: what the kubelet must be told."""
    return sorted((r["request"].split("/")[0], r["pool"], r["device"], r.get("shareID", "")) for r in results_of(claim))


def prepared(answer: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """The same of a NodePrepareResources answer, which must hold no error."""
    assert answer.get("error", "") == "", answer
    return sorted((",".join(d.get("request_names") or []), d["pool_name"], d["device_name"], d.get("share_id", ""))
                  for d in answer["devices"])


def published(agent: NodeAgent) -> dict[str, dict[str, Any]]:
    """The devices in the agent's slices, by name."""
    return devices_of(slices_of(agent.cluster.admin, agent.node))


def string(device: Mapping[str, Any], name: str) -> str:
    return str(device["attributes"][name]["string"])


def condition(obj: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


@dataclass
class Namespace:
    """A namespace of the cluster and what tests made in it."""

    cluster: Cluster
    name: str

    def create(self) -> Namespace:
        api = self.cluster.admin
        api.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.name}})
        # Pods need the namespace's `default` ServiceAccount (the ServiceAccount admission plugin); the
        # controller-manager makes it, and so does this, whichever comes first.
        with contextlib.suppress(ApiFailure):
            api.post(f"/api/v1/namespaces/{self.name}/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
        return self

    def path(self, plural: str, name: str = "") -> str:
        prefix = "/api/v1" if plural == "pods" else RESOURCE
        return f"{prefix}/namespaces/{self.name}/{plural}" + (f"/{name}" if name else "")

    # -- objects --------------------------------------------------------------------------------------

    def claim(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.cluster.admin.post(self.path("resourceclaims"), {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name}, "spec": spec})

    def template(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.cluster.admin.post(self.path("resourceclaimtemplates"), {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": spec}})

    def pod(self, name: str, node: str, *, claims: Mapping[str, str] = (), templates: Mapping[str, str] = (),
            limits: Mapping[str, str] | None = None) -> dict[str, Any]:
        """A Pod pinned to `node` by its hostname label (the scheduler still picks the devices):
        `claims` pod claim name -> ResourceClaim, `templates` pod claim name -> ResourceClaimTemplate,
        `limits` extended resources of its container (unchanged pods: `example.com/gpu`)."""
        pod_claims = [{"name": k, "resourceClaimName": v} for k, v in dict(claims).items()]
        pod_claims += [{"name": k, "resourceClaimTemplateName": v} for k, v in dict(templates).items()]
        container: dict[str, Any] = {"name": "work", "image": "registry.example/work:1"}
        resources: dict[str, Any] = {}
        if pod_claims:
            resources["claims"] = [{"name": c["name"]} for c in pod_claims]
        if limits:
            resources["limits"] = dict(limits)
        if resources:
            container["resources"] = resources
        spec: dict[str, Any] = {"nodeSelector": {"kubernetes.io/hostname": node},
                                "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0,
                                "containers": [container]}
        if pod_claims:
            spec["resourceClaims"] = pod_claims
        return self.cluster.admin.post(self.path("pods"), {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})

    def get(self, plural: str, name: str) -> dict[str, Any]:
        return self.cluster.admin.get(self.path(plural, name))

    def exists(self, plural: str, name: str) -> bool:
        try:
            self.get(plural, name)
        except ApiFailure as exc:
            if exc.status == 404:
                return False
            raise
        return True

    # -- what the scheduler did -----------------------------------------------------------------------

    def scheduled(self, pod: str) -> dict[str, Any]:
        """The pod once the scheduler has bound it (fails naming the scheduler's reason if it does not)."""
        def probe() -> dict[str, Any] | None:
            obj = self.get("pods", pod)
            return obj if obj["spec"].get("nodeName") else None

        try:
            return eventually(probe, f"the scheduler binds pod {self.name}/{pod}")  # type: ignore[no-any-return]
        except AssertionError as exc:
            why = condition(self.get("pods", pod), "PodScheduled")
            raise AssertionError(f"{exc}: {why}") from None

    def unschedulable(self, pod: str) -> dict[str, Any]:
        """The pod's PodScheduled condition once the scheduler has said it cannot place it."""
        def probe() -> dict[str, Any] | None:
            cond = condition(self.get("pods", pod), "PodScheduled")
            return cond if cond is not None and cond["status"] == "False" else None

        found: dict[str, Any] = eventually(probe, f"the scheduler gives up on pod {self.name}/{pod}")
        assert not self.get("pods", pod)["spec"].get("nodeName")
        return found

    def claims_of(self, pod: str) -> dict[str, dict[str, Any]]:
        """Pod claim name -> the pod's ResourceClaim as it is now (made from a template or named)."""
        obj = self.get("pods", pod)
        names = {c["name"]: c.get("resourceClaimName") for c in obj["spec"].get("resourceClaims") or []}
        for status in (obj.get("status") or {}).get("resourceClaimStatuses") or []:
            names[status["name"]] = status.get("resourceClaimName")
        assert all(names.values()), f"pod {pod}: claims not made yet: {names}"
        return {k: self.get("resourceclaims", v) for k, v in names.items() if v}

    def extended_claim(self, pod: str) -> dict[str, Any]:
        """The claim the scheduler made for the pod's extended resources (DRAExtendedResource)."""
        status = (self.get("pods", pod).get("status") or {}).get("extendedResourceClaimStatus") or {}
        assert status.get("resourceClaimName"), f"pod {pod} has no extended resource claim: {status}"
        return self.get("resourceclaims", status["resourceClaimName"])

    def events_of(self, pod: str) -> list[dict[str, Any]]:
        found = self.cluster.admin.get(f"/api/v1/namespaces/{self.name}/events",
                                       fieldSelector=f"involvedObject.name={pod}")
        return list(found["items"])

    # -- clean-up -------------------------------------------------------------------------------------

    def remove_pod(self, pod: str) -> None:
        """Deleted at once (no kubelet would confirm a graceful deletion)."""
        with contextlib.suppress(ApiFailure):
            self.cluster.admin.request("DELETE", self.path("pods", pod), params={"gracePeriodSeconds": "0"})

    def clean(self) -> None:
        """Every pod, claim and template gone, so that the next test finds every device free."""
        api = self.cluster.admin
        for pod in api.get(self.path("pods"))["items"]:
            self.remove_pod(pod["metadata"]["name"])
        for plural in ("resourceclaims", "resourceclaimtemplates"):
            api.request("DELETE", self.path(plural))
        # A claim goes once the resource claim controller has seen its pods go (its finalizer).
        eventually(lambda: not api.get(self.path("resourceclaims"))["items"]
                   and not api.get(self.path("pods"))["items"], f"namespace {self.name} empties")


# -- the agent as the kubelet sees it -------------------------------------------------------------------

@dataclass
class NodeAgent:
    """`dra-agent run` on its own node for several tests, with a restart when a test needs one."""

    cluster: Cluster
    node: str
    root: Path
    args: tuple[str, ...]
    runs: AgentRuns
    kubeconfig: Path | None = None
    nvml: str = "sim:dgx-h100"
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    proc: AgentProcess | None = None
    # The stand-in of the kubelet's pod resources service on the node, for the NodeAgent's life (across the
    # agent's restarts): which claims the node's pods use, as a test sets them (none at first).
    kubelet: PodResourcesStandIn | None = None

    @property
    def socket(self) -> Path:
        return self.root / "kubelet" / "plugins" / DRIVER / "dra.sock"

    @property
    def state(self) -> Path:
        return self.root / "state"

    def start(self) -> AgentProcess:
        assert self.proc is None and self.kubeconfig is not None
        if self.kubelet is None:
            self.kubelet = PodResourcesStandIn(socket_of(self.root / "kubelet")).start()
        self.proc = self._stack.enter_context(
            self.runs.run(self.root.name, self.kubeconfig, *self.args, node=self.node, nvml=self.nvml,
                          own_kubelet=False))
        self.proc.wait_published()
        eventually(self.socket.exists, "the DRA socket")
        return self.proc

    def stop(self) -> None:
        self._stack.close()
        self.proc = None

    def restart(self) -> AgentProcess:
        self.stop()
        return self.start()

    # -- the kubelet's calls ----------------------------------------------------------------------------

    def prepare(self, *claims: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """NodePrepareResources (v1) for the claims: claim UID -> its answer."""
        return asyncio.run(self._call("prepare", [ref_of(c) for c in claims]))

    def unprepare(self, *claims: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        return asyncio.run(self._call("unprepare", [ref_of(c) for c in claims]))

    async def _call(self, what: str, refs: list[ClaimRef]) -> dict[str, dict[str, Any]]:
        async with kc.DRAClient(self.socket) as client:
            reply = await getattr(client, what)(refs, timeout=KUBELET_TIMEOUT)
        return {uid: kc.to_dict(answer) for uid, answer in reply.claims.items()}

    def prepared(self) -> set[str]:
        """UIDs of the claims the agent holds a record of."""
        return {p.stem for p in (self.state / "claims").glob("*.rec")}

    # -- its CLI on the node ------------------------------------------------------------------------------

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`dra-agent ARGS` with this agent's node, NVML and state directory (and its credentials)."""
        cmd = [str(VENV_BIN / "dra-agent"), *args, f"--node-name={self.node}", f"--nvml={self.nvml}",
               f"--state-dir={self.state}", f"--kubelet-dir={self.root / 'kubelet'}"]
        if self.kubeconfig is not None:
            cmd.append(f"--kubeconfig={self.kubeconfig}")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"dra-agent {' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done


@contextlib.contextmanager
def node_agent(cluster: Cluster, node: str, base: Path, *args: str,
               declared: Sequence[str] = ()) -> Iterator[NodeAgent]:
    """A Node registered for the agent, its ServiceAccount token bound to a pod there, and the agent running."""
    cluster.add_node(node, declared=declared)
    running = NodeAgent(cluster, node, base / node, tuple(args), AgentRuns(base))
    running.kubeconfig = cluster.agent_kubeconfig(node)
    running.start()
    try:
        yield running
    finally:
        running.stop()
        if running.kubelet is not None:
            running.kubelet.stop()

"""Claims the real scheduler allocates: a namespace, a ResourceClaim, a Pod that uses it on one node (no
kubelet runs it: the scheduler allocates the claim and binds the pod), and what came of it; and the
agent's kubelet stand-in preparing the claim over the running agent's DRA socket."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .clusterkit import DRIVER, VENV_BIN, AgentProcess, ApiFailure, Cluster, eventually

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"


def namespace(cluster: Cluster, name: str) -> str:
    """A namespace, once its default ServiceAccount exists (pods name it)."""
    cluster.admin.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    def ready() -> bool:
        try:
            cluster.admin.get(f"/api/v1/namespaces/{name}/serviceaccounts/default")
        except ApiFailure:
            return False
        return True

    eventually(ready, f"the default ServiceAccount of namespace {name}")
    return name


def request(name: str, device_class: str, *, count: int = 1, capacity: Mapping[str, str] | None = None,
            selectors: Sequence[str] = ()) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}
    if capacity:
        exactly["capacity"] = {"requests": dict(capacity)}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    return {"name": name, "exactly": exactly}


def create_claim(cluster: Cluster, ns: str, name: str, requests: Sequence[Mapping[str, Any]],
                 constraints: Sequence[Mapping[str, Any]] = (), labels: Mapping[str, str] | None = None) -> Any:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = list(constraints)
    meta: dict[str, Any] = {"name": name, "namespace": ns}
    if labels:
        meta["labels"] = dict(labels)
    return cluster.admin.post(CLAIMS.format(ns=ns), {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                                     "metadata": meta, "spec": {"devices": devices}})


def pod_using(cluster: Cluster, ns: str, name: str, claim: str, node: str) -> Any:
    """A pod on `node` (by node selector: the scheduler places it, allocating its claim) using `claim`."""
    return cluster.admin.post(f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "automountServiceAccountToken": False,
                 "tolerations": [{"operator": "Exists"}],
                 "resourceClaims": [{"name": "devices", "resourceClaimName": claim}],
                 "containers": [{"name": "c", "image": "busybox", "resources": {"claims": [{"name": "devices"}]}}]}})


def claim_of(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return dict(cluster.admin.get(f"{CLAIMS.format(ns=ns)}/{name}"))


def allocated(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    """The claim's allocation results, once the scheduler has made them."""
    def probe() -> list[dict[str, Any]] | None:
        status = claim_of(cluster, ns, name).get("status") or {}
        return ((status.get("allocation") or {}).get("devices") or {}).get("results") or None

    return list(eventually(probe, f"the scheduler allocates claim {ns}/{name}"))


def unschedulable(cluster: Cluster, ns: str, pod: str) -> str:
    """The scheduler's message for a pod it cannot place (the claim stays unallocated)."""
    def probe() -> str | None:
        obj = cluster.admin.get(f"/api/v1/namespaces/{ns}/pods/{pod}")
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return str(c.get("message", ""))
        assert not (obj.get("spec") or {}).get("nodeName"), f"pod {ns}/{pod} was scheduled"
        return None

    return str(eventually(probe, f"the scheduler gives up on pod {ns}/{pod}"))


def by_request(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["request"]: dict(r) for r in results if r["driver"] == DRIVER}


def kubelet_prepare(agent: AgentProcess, kubeconfig: Path, node: str, ns: str, name: str,
                    *extra: str) -> dict[str, Any]:
    """`dra-agent kubelet prepare` against the running agent's DRA socket (its roots, its credentials):
    the kubelet's NodePrepareResources call for the claim."""
    root = agent.root
    done = subprocess.run([str(VENV_BIN / "dra-agent"), "kubelet", "prepare", f"{ns}/{name}",
                           f"--kubeconfig={kubeconfig}", f"--node-name={node}", f"--kubelet-dir={root / 'kubelet'}",
                           f"--state-dir={root / 'state'}", f"--cdi-dir={root / 'cdi'}", *extra],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"prepare {ns}/{name}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return dict(json.loads(done.stdout))


def metadata_files(agent: AgentProcess, uid: str) -> dict[str, dict[str, Any]]:
    """Request -> the first (newest API) object of the claim's metadata file for it."""
    base = agent.root / "kubelet" / "plugins" / DRIVER / "dra-device-metadata" / uid
    return {p.parent.name: json.loads(p.read_text().splitlines()[0]) for p in sorted(base.glob("*/metadata.json"))}


def claim_env(agent: AgentProcess, uid: str) -> dict[str, str]:
    """The environment the claim's CDI spec gives its containers."""
    spec = json.loads((agent.root / "cdi" / f"{DRIVER}-claim_{uid}.json").read_text())
    return dict(e.split("=", 1) for d in spec["devices"] for e in d["containerEdits"]["env"])

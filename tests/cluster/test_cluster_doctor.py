"""`dra-agent doctor -o json` against the real API server: its RBAC row asks real
SelfSubjectAccessReviews, so it passes with the ClusterRole deploy/base ships and fails, naming the
permission and the fix, for a role that lacks one of the permissions the agent uses."""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .clusterkit import NAMESPACE, NODE, VENV_BIN, Cluster

pytestmark = pytest.mark.cluster

RBAC = "/apis/rbac.authorization.k8s.io/v1"


def doctor(kubeconfig: Path, root: Path) -> dict[str, dict[str, Any]]:
    """doctor's results by check (its exit status says whether something blocks: here, with no kubelet,
    something always does)."""
    root.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [str(VENV_BIN / "dra-agent"), "doctor", "-o", "json", f"--kubeconfig={kubeconfig}", f"--node-name={NODE}",
         "--nvml=sim", f"--kubelet-dir={root / 'kubelet'}", f"--cdi-dir={root / 'cdi'}",
         f"--static-cdi-dir={root / 'cdi-static'}", f"--state-dir={root / 'state'}", "--metrics-address="],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (0, 1), done.stderr
    return {r["check"]: r for r in json.loads(done.stdout)}


def shipped_role(cluster: Cluster) -> dict[str, Any]:
    (role,) = [o for o in cluster.applied["base"] if o["kind"] == "ClusterRole"]
    return role


@pytest.fixture
def identity_with(cluster: Cluster, tmp_path: Path) -> Iterator[Any]:
    """A ServiceAccount bound to a copy of the shipped ClusterRole with its rules edited; its
    kubeconfig (token bound to a pod on NODE, as the agent's)."""
    made: list[str] = []

    def make(name: str, edit: Any) -> Path:
        role = copy.deepcopy(shipped_role(cluster))
        role["metadata"] = {"name": name}
        role["rules"] = edit(role["rules"])
        cluster.admin.post(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
                           {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
        cluster.admin.post(f"{RBAC}/clusterroles", role)
        cluster.admin.post(f"{RBAC}/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]})
        made.append(name)
        pod = cluster.pod_on(NODE, f"{name}-pod", service_account=name)
        return cluster.kubeconfig(name, cluster.token(pod=pod, service_account=name))

    yield make
    for name in made:
        cluster.admin.delete(f"{RBAC}/clusterrolebindings/{name}")
        cluster.admin.delete(f"{RBAC}/clusterroles/{name}")
        cluster.admin.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}-pod")
        cluster.admin.delete(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{name}")


def test_rbac_passes_with_the_shipped_role(cluster: Cluster, agent_kubeconfig: Path, tmp_path: Path) -> None:
    checks = doctor(agent_kubeconfig, tmp_path)
    assert checks["Kubernetes API"]["ok"], checks["Kubernetes API"]
    assert checks["Node"]["ok"] and NODE in checks["Node"]["detail"]
    assert "DRANodeAllocatableResources" in checks["Node"]["detail"]
    assert checks["RBAC"]["ok"], checks["RBAC"]
    assert checks["RBAC"]["detail"].startswith("all ")


def without_verb(resource: str, verb: str) -> Any:
    def edit(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for rule in rules:
            if resource in rule["resources"]:
                rule = {**rule, "verbs": [v for v in rule["verbs"] if v != verb]}
            if rule["verbs"]:
                out.append(rule)
        return out

    return edit


@pytest.mark.parametrize(("resource", "verb", "named"), [
    ("resourceslices", "delete", "delete resourceslices.resource.k8s.io"),
    ("resourceclaims/status", "patch", "patch resourceclaims/status.resource.k8s.io"),
    # What the API server checks for a status.devices write (DRAResourceClaimGranularStatusAuthorization).
    ("resourceclaims/driver", "associated-node:patch", "associated-node:patch resourceclaims/driver.resource.k8s.io"),
])
def test_rbac_fails_naming_a_missing_permission(identity_with: Any, tmp_path: Path, resource: str, verb: str,
                                                named: str) -> None:
    kubeconfig = identity_with(f"doctor-no-{verb.replace(':', '-')}-{resource.replace('/', '-')}",
                               without_verb(resource, verb))
    rbac = doctor(kubeconfig, tmp_path)["RBAC"]
    assert not rbac["ok"] and rbac["blocking"], rbac
    assert rbac["detail"].startswith("denied: ") and named in rbac["detail"], rbac["detail"]
    assert "deploy/base has the ClusterRole" in rbac["fix"]

"""deploy/ against the real API server: every kustomization applies with strict server-side
validation (the session fixture applies them; these tests check what the server made of them), the
DeviceClasses' CEL is compiled and accepted by the server, and the ValidatingAdmissionPolicy type-checks
without warnings (the controller-manager's type checker writes them into the policy's status)."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from .clusterkit import ApiFailure, Cluster, eventually
from .controlplane import DEPENDENCY_GATES, DRA_GATES, RUNTIME_CONFIG

pytestmark = pytest.mark.cluster

POLICIES = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"


def path_of(obj: dict[str, Any]) -> str:
    """The REST path of a rendered object (the kinds deploy/ holds)."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    ns = obj["metadata"].get("namespace")
    group_version = obj["apiVersion"]
    prefix = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    plural = {"Namespace": "namespaces", "ServiceAccount": "serviceaccounts", "ClusterRole": "clusterroles",
              "ClusterRoleBinding": "clusterrolebindings", "DaemonSet": "daemonsets", "DeviceClass": "deviceclasses",
              "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
              "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings"}[kind]
    return f"{prefix}/namespaces/{ns}/{plural}/{name}" if ns else f"{prefix}/{plural}/{name}"


def test_every_dra_feature_gate_of_the_release_is_on(cluster: Cluster) -> None:
    # Every gate the API server knows is in its metrics, with whether it is on: a release that adds a
    # DRA gate makes this fail until DRA_GATES has it.
    metrics = cluster.admin.get("/metrics")
    gates = dict(re.findall(r'^kubernetes_feature_enabled\{name="(\w+)",stage="\w*"\} ([01])$', metrics, re.MULTILINE))
    assert {g for g in gates if g.startswith("DRA")} == set(DRA_GATES)
    assert [g for g in (*DRA_GATES, *DEPENDENCY_GATES) if gates[g] != "1"] == []
    served = {v["version"] for v in cluster.admin.get("/apis/resource.k8s.io")["versions"]}
    wanted = {gv.split("=")[0].split("/")[1] for gv in RUNTIME_CONFIG.split(",") if gv.startswith("resource.")} | {"v1"}
    assert served == wanted


def test_every_kustomization_was_stored_as_rendered(cluster: Cluster) -> None:
    # The fixture applied each overlay and then the base with --server-side --validate=strict (an
    # unknown or duplicate field, a CEL selector that does not compile, a bad value: kubectl fails).
    assert set(cluster.applied) == {"base", "dev", "driver-container", "kubevirt", "node-allocatable"}
    # The driver-container overlay, taken by the server: the driver root is the GPU Operator's.
    (daemonset,) = [o for o in cluster.applied["driver-container"] if o["kind"] == "DaemonSet"]
    roots = {v["name"]: v["hostPath"]["path"] for v in daemonset["spec"]["template"]["spec"]["volumes"]
             if "hostPath" in v}
    assert roots["driver-root"] == "/run/nvidia/driver"
    kinds = set()
    for objs in cluster.applied.values():
        for obj in objs:
            if obj["kind"] == "ConfigMap":  # driver.yaml: local-config, never applied
                assert obj["metadata"]["annotations"]["config.kubernetes.io/local-config"] == "true"
                continue
            stored = cluster.admin.get(path_of(obj))
            kinds.add(obj["kind"])
            assert stored["metadata"]["name"] == obj["metadata"]["name"]
    assert {"DaemonSet", "ClusterRole", "DeviceClass", "ValidatingAdmissionPolicy"} <= kinds
    # The base was applied last: the node-allocatable overlay's extra selector is gone again.
    cpu = cluster.admin.get(f"{CLASSES}/cpu.dra.example.com")
    assert [s["cel"]["expression"] for s in cpu["spec"]["selectors"]] == [
        next(o for o in cluster.applied["base"] if o["metadata"]["name"] == "cpu.dra.example.com")
        ["spec"]["selectors"][0]["cel"]["expression"]]


def test_device_class_selectors_are_compiled_by_the_server(cluster: Cluster) -> None:
    classes = [o for objs in cluster.applied.values() for o in objs if o["kind"] == "DeviceClass"]
    assert len({c["metadata"]["name"] for c in classes}) == 10  # dra.cpu: KubeVirt's, in the kubevirt overlay
    for cls in classes:
        # A server-side dry run of each class as rendered: accepted.
        probe = copy.deepcopy(cls)
        probe["metadata"]["name"] = "probe-" + cls["metadata"]["name"]
        cluster.admin.post(CLASSES, probe, dryRun="All")
        # The same class with its selector cut short: refused by the server's CEL compiler, so the
        # acceptance above means something.
        broken = copy.deepcopy(probe)
        broken["spec"]["selectors"][0]["cel"]["expression"] += " &&"
        with pytest.raises(ApiFailure) as refused:
            cluster.admin.post(CLASSES, broken, dryRun="All")
        assert refused.value.status == 422 and "compilation failed" in refused.value.message


def _type_checked(cluster: Cluster, name: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        policy = cluster.admin.get(f"{POLICIES}/{name}")
        status = policy.get("status") or {}
        done = status.get("observedGeneration") == policy["metadata"]["generation"]
        return status if done else None

    return eventually(probe, f"the controller-manager type-checks ValidatingAdmissionPolicy {name}")


def test_admission_policy_type_checks_without_warnings(cluster: Cluster) -> None:
    policies = [o for o in cluster.applied["base"] if o["kind"] == "ValidatingAdmissionPolicy"]
    assert len(policies) == 2  # ResourceSlices, ResourcePoolStatusRequests
    for each in policies:
        status = _type_checked(cluster, each["metadata"]["name"])
        assert (status.get("typeChecking") or {}).get("expressionWarnings") in (None, []), each["metadata"]["name"]
    policy = next(p for p in policies if p["metadata"]["name"] == "dra-agent-resourceslices")
    # A copy with a misspelt field gets a warning from the same checker.
    probe = copy.deepcopy(policy)
    probe["metadata"] = {"name": "probe-type-checking"}
    probe["spec"]["validations"].append({"expression": "object.spec.nodeNam == 'x'"})
    cluster.admin.post(POLICIES, probe)
    try:
        warnings = (_type_checked(cluster, "probe-type-checking").get("typeChecking") or {}).get(
            "expressionWarnings") or []
    finally:
        cluster.admin.delete(f"{POLICIES}/probe-type-checking")
    assert any("nodeNam" in w["warning"] for w in warnings), warnings

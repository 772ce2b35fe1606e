"""deploy/ against the real API server: every kustomization applies with strict server-side
validation (the session fixture applies them; these tests check what the server made of them), the
DeviceClasses' CEL is compiled and accepted by the server, the ValidatingAdmissionPolicy type-checks
without warnings (the controller-manager's type checker writes them into the policy's status), and the
scheduler places the DaemonSet's pod on the nodes that have devices and never on the control plane."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from .clusterkit import DRIVER, NAMESPACE, ApiFailure, Cluster, eventually
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
              "ClusterRoleBinding": "clusterrolebindings", "Role": "roles", "RoleBinding": "rolebindings",
              "DaemonSet": "daemonsets", "DeviceClass": "deviceclasses",
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
    assert set(cluster.applied) == {"base", "binding-conditions", "dev", "device-plugin-migration", "driver-container",
                                    "kubevirt", "node-allocatable"}
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
    # The device-plugin-migration overlay's MIG classes, taken by the server with the device plugin's names.
    mig = cluster.admin.get(f"{CLASSES}/mig-1g10gbme.dra.example.com")
    assert mig["spec"]["extendedResourceName"] == "nvidia.com/mig-1g.10gb.me"
    # The base was applied last: its gpu class serves its own name again, and the node-allocatable overlay's
    # extra selector is gone.
    assert cluster.admin.get(f"{CLASSES}/gpu.dra.example.com")["spec"]["extendedResourceName"] == "example.com/gpu"
    cpu = cluster.admin.get(f"{CLASSES}/cpu.dra.example.com")
    assert [s["cel"]["expression"] for s in cpu["spec"]["selectors"]] == [
        next(o for o in cluster.applied["base"] if o["metadata"]["name"] == "cpu.dra.example.com")
        ["spec"]["selectors"][0]["cel"]["expression"]]


def test_device_class_selectors_are_compiled_by_the_server(cluster: Cluster) -> None:
    classes = [o for objs in cluster.applied.values() for o in objs if o["kind"] == "DeviceClass"]
    # dra.cpu: KubeVirt's, in the kubevirt overlay; 7 MIG classes in the device-plugin-migration overlay.
    assert len({c["metadata"]["name"] for c in classes}) == 17
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


# -- where the DaemonSet's pods go ------------------------------------------------------------------------

NODES = "/api/v1/nodes"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
NFD_NVIDIA = "feature.node.kubernetes.io/pci-10de.present"
# The tolerations the DaemonSet controller gives each pod it makes, beside the template's own: those of a
# node's conditions, and network-unavailable for a pod on the host's network.
DAEMON_TOLERATIONS = [
    *({"key": f"node.kubernetes.io/{key}", "operator": "Exists", "effect": "NoExecute"}
      for key in ("not-ready", "unreachable")),
    *({"key": f"node.kubernetes.io/{key}", "operator": "Exists", "effect": "NoSchedule"}
      for key in ("disk-pressure", "memory-pressure", "pid-pressure", "unschedulable", "network-unavailable")),
]


def daemon_pod(template: dict[str, Any], node: str) -> dict[str, Any]:
    """The DaemonSet's pod for `node`, as its controller decides whether the node runs one: the template
    with the controller's tolerations, each term of its node affinity narrowed to that node (a field of the
    Node), so that the scheduler judges the template's placement on that node alone. (The daemonset
    controller itself is off in these tests: conftest.py.)"""
    spec = copy.deepcopy(template["spec"])
    spec["tolerations"] = [*spec.get("tolerations", []), *DAEMON_TOLERATIONS]
    terms = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": [{}]})["nodeSelectorTerms"]
    for term in terms:
        term["matchFields"] = [{"key": "metadata.name", "operator": "In", "values": [node]}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"daemon-{node}", "namespace": NAMESPACE},
            "spec": spec}


def scheduled(cluster: Cluster, names: list[str]) -> dict[str, str] | None:
    """Each pod's node, or the scheduler's reason it fits none; None while one is undecided. A refusal
    counts once the scheduler judged every Node (`0/<all> nodes are available`): one made before it saw
    the pod's own node is tried again when it does."""
    every = len(cluster.admin.get(NODES)["items"])
    out = {}
    for name in names:
        pod = cluster.admin.get(f"{PODS}/{name}")
        refused = [c.get("message", "") for c in (pod.get("status") or {}).get("conditions", [])
                   if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"]
        if pod["spec"].get("nodeName"):
            out[name] = str(pod["spec"]["nodeName"])
        elif refused and refused[0].startswith(f"0/{every} nodes are available"):
            out[name] = f"refused: {refused[0]}"
        else:
            return None
    return out


# As a cluster has them: a control-plane node as kubeadm makes one (with GPUs, so that its taint alone
# keeps the agent off), a GPU node labelled by NFD and tainted for GPU pods, a node its administrator
# labelled for the agent (NICs, CPU and memory), and a node of neither: labels and taints of each.
PLACEMENT_NODES: dict[str, tuple[dict[str, str], list[dict[str, str]]]] = {
    "placement-control-plane": ({"node-role.kubernetes.io/control-plane": "", NFD_NVIDIA: "true"},
                                [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}]),
    "placement-gpu": ({NFD_NVIDIA: "true"}, [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]),
    "placement-labelled": ({f"{DRIVER}/agent": "true"}, []),
    "placement-plain": ({}, []),
}


def placements(cluster: Cluster, template: dict[str, Any]) -> dict[str, str]:
    """Where the scheduler puts the daemon pod of each of PLACEMENT_NODES (the node's name, or why it
    refuses); the nodes and pods are gone again afterwards."""
    try:
        for node, (labels, taints) in PLACEMENT_NODES.items():
            cluster.add_node(node)
            cluster.admin.merge_patch(f"{NODES}/{node}", {"metadata": {"labels": labels},
                                                          "spec": {"taints": taints or None}})
            cluster.admin.post(PODS, daemon_pod(template, node))
        pods = [f"daemon-{node}" for node in PLACEMENT_NODES]
        decided = eventually(lambda: scheduled(cluster, pods), "the scheduler places or refuses each daemon pod")
        return {pod.removeprefix("daemon-"): where for pod, where in decided.items()}
    finally:
        for node in PLACEMENT_NODES:
            for path in (f"{PODS}/daemon-{node}", f"{NODES}/{node}"):
                try:  # a pod bound to a node without a kubelet goes at once only with no grace period
                    cluster.admin.request("DELETE", path, params={"gracePeriodSeconds": "0"})
                except ApiFailure as exc:
                    if exc.status != 404:
                        raise


def assert_placed_on_device_nodes_only(decided: dict[str, str]) -> None:
    assert {node: where for node, where in decided.items() if not where.startswith("refused")} == {
        "placement-gpu": "placement-gpu", "placement-labelled": "placement-labelled"}, decided
    # Refused by the control plane's taint on the one (its labels match), by the node affinity on the other.
    control_plane = decided["placement-control-plane"]
    assert "1 node(s) had untolerated taint" in control_plane, control_plane
    assert "untolerated" not in decided["placement-plain"], decided["placement-plain"]


def test_the_scheduler_places_the_agent_on_device_nodes_and_never_on_the_control_plane(cluster: Cluster) -> None:
    (applied,) = [o for o in cluster.applied["base"] if o["kind"] == "DaemonSet"]
    template = cluster.admin.get(path_of(applied))["spec"]["template"]  # as the API server stored it
    assert_placed_on_device_nodes_only(placements(cluster, template))

"""The Helm chart (deploy/helm/dra-agent) installed, upgraded and uninstalled with the real Helm v4
(tests/helm/build.py) on a real 1.37 control plane of its own: the session's cluster holds deploy/
applied by kubectl, whose objects a Helm release cannot own.

- `helm install` stores the objects of `kubectl kustomize deploy/base` (tests/test_helm.py shows the
  renders equal; here the server takes them), and the DaemonSet controller makes the agent's pod from the
  chart's template on a node labelled for it; an agent run with that template's environment (its paths
  in the pod rebased to the test's directories: no kubelet runs the pod here) publishes its slices
  through the chart's RBAC and admission policy;
- `helm upgrade` with values changed (a setting, a taint policy: a ConfigMap more) changes the DaemonSet's
  template, and the DaemonSet rolls (a pod of the new revision), while every object keeps its UID and the
  slices stay, still written by the agent;
- `helm uninstall` removes every object of the chart, the namespace too.

The tests run in file order, on one release.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from .clusterkit import REPO, ApiFailure, Cluster, agent, eventually, slices_of
from .controlplane import WITHOUT_KUBELETS, ControlPlaneError, start_plane
from .pki import Pki
from .test_cluster_deploy import path_of as deploy_path_of

pytestmark = pytest.mark.cluster

CHART = REPO / "deploy" / "helm" / "dra-agent"
RELEASE = NAMESPACE = "dra-agent"
NODE = "helm-node"
DRIVER = "dra.example.com"  # the chart's default driverName
# The DaemonSet controller on (the session's plane has it off): it makes the chart's pod, and rolls it.
CONTROLLERS = WITHOUT_KUBELETS.replace(",-daemonset-controller", "")


@dataclass
class Release:
    cluster: Cluster
    helm: Path
    home: Path
    kubeconfig: Path

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # Helm's own configuration, cache and data under the test's directory, never the user's.
        env = {**os.environ, "HELM_CONFIG_HOME": str(self.home / "config"), "HELM_CACHE_HOME": str(self.home / "cache"),
               "HELM_DATA_HOME": str(self.home / "data")}
        done = subprocess.run([str(self.helm), f"--kubeconfig={self.kubeconfig}", *args], capture_output=True,
                              text=True, timeout=180, env=env, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
        return done

    def manifest(self) -> list[dict[str, Any]]:
        """The objects of the release's current revision, as Helm recorded them."""
        return [o for o in yaml.safe_load_all(self.run("get", "manifest", RELEASE, "-n", NAMESPACE).stdout) if o]


@pytest.fixture(scope="module")
def helm_binary() -> Path:
    from helm import build

    return Path(build.HELM.for_test("helm"))


@pytest.fixture(scope="module")
def release(components: Path, cluster_root: Path, helm_binary: Path) -> Iterator[Release]:
    root = cluster_root / "helm"
    try:
        plane = start_plane(components, root / "plane", Pki(root / "pki"), controllers=CONTROLLERS)
    except ControlPlaneError as exc:
        pytest.fail(f"the control plane did not start: {exc}", pytrace=False)
    c = Cluster(plane, root)
    try:
        plane.wait_components()
        assert plane.admin_kubeconfig is not None
        yield Release(c, helm_binary, root / "helm-home", plane.admin_kubeconfig)
    finally:
        c.close()
        plane.stop()


def path_of(obj: dict[str, Any]) -> str:
    """The REST path of an object of the chart: deploy/'s kinds, and the taint policy's ConfigMap."""
    if obj["kind"] == "ConfigMap":
        return f"/api/v1/namespaces/{obj['metadata']['namespace']}/configmaps/{obj['metadata']['name']}"
    return deploy_path_of(obj)


def base_objects() -> list[dict[str, Any]]:
    from test_deploy import DEPLOY, kustomize

    return [o for o in kustomize(DEPLOY / "base") if o["kind"] != "ConfigMap"]


def contains(stored: Any, given: Any, where: str = "") -> list[str]:
    """Where `stored` lacks or differs from what `given` says (the server adds defaults and metadata)."""
    if isinstance(given, dict):
        if not isinstance(stored, dict):
            return [f"{where}: {stored!r}"]
        return [d for k, v in given.items() for d in contains(stored.get(k), v, f"{where}.{k}")]
    if isinstance(given, list):
        if not isinstance(stored, list) or len(stored) != len(given):
            return [f"{where}: {stored!r}"]
        return [d for i, (s, g) in enumerate(zip(stored, given, strict=True)) for d in contains(s, g, f"{where}[{i}]")]
    return [] if stored == given else [f"{where}: {stored!r} != {given!r}"]


def uids(cluster: Cluster, objs: list[dict[str, Any]]) -> dict[str, str]:
    return {path_of(o): cluster.admin.get(path_of(o))["metadata"]["uid"] for o in objs}


def daemonset(cluster: Cluster) -> dict[str, Any]:
    return dict(cluster.admin.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/dra-agent"))


def daemon_pods(cluster: Cluster) -> list[dict[str, Any]]:
    pods = cluster.admin.get(f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector="app.kubernetes.io/name=dra-agent")
    return list(pods["items"])


def pod_environment(template: dict[str, Any], node: str, pod_uid: str, root: Path) -> dict[str, str]:
    """The agent container's environment as the kubelet gives it on `node` (fieldRefs and $(VAR)
    resolved), with what names the pod's own filesystem moved under `root`: the probe socket, and the
    driver root (no GPU here). The directories shared with the kubelet are clusterkit.agent's flags."""
    (container,) = template["spec"]["containers"]
    fields = {"spec.nodeName": node, "status.hostIP": "127.0.0.1", "status.hostIPs": "127.0.0.1",
              "metadata.uid": pod_uid}
    env: dict[str, str] = {}
    for e in container["env"]:
        if "valueFrom" in e:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), e["value"])
    env["DRA_PROBE_SOCKET"] = str(root / "probe.sock")
    env["DRA_PROBE_ADDRESS"] = "127.0.0.1:0"
    env["DRA_DRIVER_ROOT"] = "/"
    return env


def test_install_stores_deploy_base_and_the_agent_publishes(release: Release) -> None:
    cluster = release.cluster
    release.run("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace")
    # Every object of deploy/base, as the server stored it: what the render said, and Helm's.
    for obj in base_objects():
        stored = cluster.admin.get(path_of(obj))
        differs = contains(stored, obj)
        assert differs == [], f"{obj['kind']} {obj['metadata']['name']}: {differs}"
        assert stored["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
    assert sorted(path_of(o) for o in release.manifest()) == sorted(path_of(o) for o in base_objects())
    # The namespace the chart owns admits the privileged pod.
    ns = cluster.admin.get(f"/api/v1/namespaces/{NAMESPACE}")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"

    # A node labelled for the agent: the DaemonSet controller makes its pod from the chart's template,
    # and the API server admits it.
    cluster.add_node(NODE)
    cluster.admin.merge_patch(f"/api/v1/nodes/{NODE}", {"metadata": {"labels": {f"{DRIVER}/agent": "true"}}})
    (pod,) = eventually(lambda: [p for p in daemon_pods(cluster) if p["spec"].get("nodeName")],
                        "the DaemonSet controller makes the agent's pod, and the scheduler binds it")
    assert pod["spec"]["nodeName"] == NODE
    assert pod["spec"]["containers"][0]["env"] == daemonset(cluster)["spec"]["template"]["spec"]["containers"][0]["env"]


@pytest.fixture(scope="module")
def running(release: Release) -> Iterator[Any]:
    """The agent, with the environment of the installed DaemonSet's pod, its token bound to that pod."""
    cluster = release.cluster
    (pod,) = daemon_pods(cluster)
    root = cluster.root / "agent"
    root.mkdir(parents=True, exist_ok=True)
    token = cluster.token(pod=pod)
    env = pod_environment(daemonset(cluster)["spec"]["template"], NODE, pod["metadata"]["uid"], root)
    with agent(root, cluster.kubeconfig("helm-agent", token), node=NODE, env=env) as proc:
        proc.wait_published()
        yield proc


def slice_identities(cluster: Cluster) -> dict[str, str]:
    return {s["metadata"]["name"]: s["metadata"]["uid"] for s in slices_of(cluster.admin, NODE)}


def test_upgrade_rolls_the_daemonset_and_the_slices_stay(release: Release, running: Any) -> None:
    cluster = release.cluster
    published = slice_identities(cluster)
    assert published and running.metric('dra_agent_publish_syncs_total{result="failure"}') == 0
    before = daemonset(cluster)
    objects = uids(cluster, base_objects())
    (old_pod,) = daemon_pods(cluster)

    release.run("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values",
                "--set", "settings.logLevel=debug", "--set", "taintPolicy.gpuLost.effect=NoExecute")

    after = daemonset(cluster)
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    env = after["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "DRA_LOG_LEVEL", "value": "debug"} in env
    (container,) = before["spec"]["template"]["spec"]["containers"]
    assert [e for e in env if e["name"] not in ("DRA_LOG_LEVEL", "DRA_TAINT_POLICY")] == container["env"]
    # The taint policy: a ConfigMap the upgrade made, mounted where DRA_TAINT_POLICY says.
    policy = cluster.admin.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/dra-agent-taint-policy")
    assert yaml.safe_load(policy["data"]["policy.yaml"]) == {"gpuLost": {"effect": "NoExecute"}}
    assert any(v.get("configMap", {}).get("name") == "dra-agent-taint-policy"
               for v in after["spec"]["template"]["spec"]["volumes"])
    # Changed in place: no object was deleted and made again.
    assert uids(cluster, base_objects()) == objects
    history = yaml.safe_load(release.run("history", RELEASE, "-n", NAMESPACE, "-o", "yaml").stdout)
    assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "deployed")]

    # The DaemonSet rolls: a pod of the new template's revision on the node (the old one, which no
    # kubelet stops here, is left terminating).
    def rolled() -> bool:
        pods = daemon_pods(cluster)
        revisions = {p["metadata"]["labels"]["controller-revision-hash"] for p in pods
                     if not p["metadata"].get("deletionTimestamp")}
        return bool(revisions) and old_pod["metadata"]["labels"]["controller-revision-hash"] not in revisions

    eventually(rolled, "the DaemonSet controller makes a pod of the upgraded template")
    new = [p for p in daemon_pods(cluster) if not p["metadata"].get("deletionTimestamp")]
    assert {"name": "DRA_LOG_LEVEL", "value": "debug"} in new[0]["spec"]["containers"][0]["env"]

    # The slices stay, and the agent still writes them through the upgraded role and admission policy:
    # a slice deleted behind its back is published again.
    assert slice_identities(cluster) == published
    name, uid = sorted(published.items())[0]
    cluster.admin.delete(f"/apis/resource.k8s.io/v1/resourceslices/{name}")

    def republished() -> bool:
        now = slice_identities(cluster)
        return len(now) == len(published) and uid not in now.values()

    eventually(republished, "the agent publishes the deleted slice again")
    assert running.metric('dra_agent_publish_syncs_total{result="failure"}') == 0


def test_uninstall_removes_every_object(release: Release, running: Any) -> None:
    cluster = release.cluster
    running.stop()
    objs = release.manifest()
    release.run("uninstall", RELEASE, "--namespace", NAMESPACE)
    # The pods the DaemonSet made are bound to a node without a kubelet: deleted at once, as the kubelet
    # would once they stopped, so that the namespace can go.
    for pod in daemon_pods(cluster):
        try:
            cluster.admin.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}",
                                  params={"gracePeriodSeconds": "0"})
        except ApiFailure as exc:
            if exc.status != 404:
                raise

    def gone(obj: dict[str, Any]) -> bool:
        try:
            cluster.admin.get(path_of(obj))
        except ApiFailure as exc:
            return exc.status == 404
        return False

    for obj in objs:
        eventually(functools.partial(gone, obj), f"{obj['kind']} {obj['metadata']['name']} is deleted")
    assert "dra-agent" not in release.run("list", "--all-namespaces", "-q").stdout.split()


def test_a_kustomize_install_moves_to_the_chart(release: Release) -> None:
    """deploy/base applied as docs/deployment.md says (`kubectl apply -k`, server-side), then `helm install
    --take-ownership --force-conflicts` (docs/helm.md): Helm takes the objects as they are, and an upgrade
    changes them. Without --force-conflicts each is refused: kubectl's field manager owns the fields too
    (an env variable's fieldRef, a toleration list, a class's extendedResourceName)."""
    cluster = release.cluster
    applied = cluster.apply_kustomization(REPO / "deploy" / "base")
    objects = uids(cluster, [o for o in applied if o["kind"] != "ConfigMap"])
    release.run("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--take-ownership", "--force-conflicts")
    assert uids(cluster, base_objects()) == objects
    for obj in base_objects():
        assert cluster.admin.get(path_of(obj))["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
    release.run("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--force-conflicts",
                "--set", "deviceClasses.gpu.extendedResourceName=nvidia.com/gpu")
    gpu = cluster.admin.get("/apis/resource.k8s.io/v1/deviceclasses/gpu.dra.example.com")
    assert gpu["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    release.run("uninstall", RELEASE, "--namespace", NAMESPACE)

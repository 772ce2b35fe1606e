"""The whole chain on a real node: the scheduler allocates a pod's claims from the slices the agent
published, the kubelet (1.37, `make kubelet-components`) finds the agent through its plugin
registration socket and calls NodePrepareResources on its DRA socket, containerd applies the CDI
specs the agent wrote, and the container reads its device metadata at the contract's paths; when
the pod is deleted the kubelet unprepares and the agent's files go.

Marker `kubelet`, outside `make test` (docs/tests.md, "A real kubelet"): `make test-kubelet`."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .clusterkit import DRIVER, AgentRuns, ApiFailure, Cluster, devices_of, eventually, slices_of
from .nodekit import IMAGE, Node, NodeError, running

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]

NODE_NAME = "dra-kubelet-1"
NAMESPACE = "kubelet-e2e"
ATTRIBUTES = "/var/run/kubernetes.io/dra-device-attributes"
# What the container prints, in sections the test splits on.
SCRIPT = f"""
for f in {ATTRIBUTES}/*/*/*/*; do echo "=== file $f"; cat "$f"; done
echo "=== env"; env
echo "=== dev"; stat -c '%n %F %t:%T' /dev/nvidia*
echo "=== end"
trap 'exit 0' TERM
sleep 2147483647 & wait
"""


def _busybox() -> Path:
    from runtime import is_static_elf  # tests/runtime.py: the busybox-static check the podman tests use

    found = shutil.which("busybox")
    if found is None or not is_static_elf(Path(found).resolve()):
        pytest.fail(f"the node's image needs a static busybox (Debian's busybox-static); found {found}",
                    pytrace=False)
    return Path(found).resolve()


@pytest.fixture
def real_node(cluster: Cluster, node_components: Path, agent_runs: AgentRuns, cluster_root: Path,
              request: pytest.FixtureRequest) -> Iterator[Node]:
    """containerd and the kubelet for NODE_NAME; its kubelet directory and CDI directory are the
    ones the agent run `kn` of this test uses."""
    agent_root = agent_runs.base / "kn"
    node = Node(node_components, Path(tempfile.mkdtemp(prefix="node-", dir=cluster_root)), NODE_NAME,
                cluster.plane, agent_root / "kubelet", agent_root / "cdi", _busybox())
    request.node.real_node = node
    try:
        with running(node):
            yield node
    except NodeError as exc:
        pytest.fail(f"the node did not start: {exc}", pytrace=False)


def _sections(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    current = ""
    for line in text.splitlines(keepends=True):
        if line.startswith("=== "):
            current = line[4:].strip()
            out[current] = ""
        elif current:
            out[current] += line
    return out


def _first(stream: str) -> dict[str, Any]:
    """The newest object of a metadata file's JSON stream (one object per version, newest first)."""
    obj, _ = json.JSONDecoder().raw_decode(stream.lstrip())
    assert isinstance(obj, dict)
    return obj


def _node_registered(cluster: Cluster) -> bool:
    try:
        cluster.admin.get(f"/api/v1/nodes/{NODE_NAME}")
    except ApiFailure as exc:
        if exc.status == 404:
            return False
        raise
    return True


def _objects(cluster: Cluster) -> dict[str, Any]:
    """The namespace, a claim by name (returned), a claim template, and the pod using both."""
    api = cluster.admin
    api.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    # Pod admission looks the pod's service account up; the controller-manager makes `default`.
    eventually(lambda: any(a["metadata"]["name"] == "default"
                           for a in api.get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts")["items"]),
               "the namespace's default service account")
    one_gpu = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}
    claims = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}"
    named = api.post(f"{claims}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "trainer-gpu", "namespace": NAMESPACE}, "spec": one_gpu})
    api.post(f"{claims}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "spare-gpu", "namespace": NAMESPACE}, "spec": {"spec": one_gpu}})
    api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reader", "namespace": NAMESPACE},
        "spec": {
            # Placed by the scheduler, not named: only this node's slices can satisfy it.
            "nodeSelector": {"kubernetes.io/hostname": NODE_NAME},
            # The runtime has no CNI network (nodekit): the host's network, and the not-ready taint tolerated.
            "hostNetwork": True,
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoSchedule"}],
            "automountServiceAccountToken": False, "restartPolicy": "Never",
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "trainer-gpu"},
                               {"name": "spare", "resourceClaimTemplateName": "spare-gpu"}],
            "containers": [{"name": "reader", "image": IMAGE, "imagePullPolicy": "Never",
                            "command": ["/bin/sh", "-c", SCRIPT],
                            "resources": {"claims": [{"name": "gpu"}, {"name": "spare"}]}}]}})
    return named


def test_a_scheduled_pod_reads_its_device_metadata_through_kubelet_containerd_and_cdi(
        cluster: Cluster, real_node: Node, agent_runs: AgentRuns) -> None:
    api = cluster.admin
    eventually(lambda: _node_registered(cluster), "the kubelet registers its Node")
    # The Pod this token is bound to is on the node too: the kubelet never starts it (it does not
    # use the host's network, and the runtime has no other).
    kubeconfig = cluster.agent_kubeconfig(NODE_NAME)
    with agent_runs.run("kn", kubeconfig, node=NODE_NAME) as agent:
        agent.wait_published()
        # The kubelet's plugin watcher found the registration socket and told the agent it took it.
        eventually(lambda: agent.metric("dra_agent_kubelet_registered") == 1.0, "the kubelet registers the plugin")
        published = devices_of(slices_of(api, NODE_NAME))

        named = _objects(cluster)
        pods = f"/api/v1/namespaces/{NAMESPACE}/pods"

        def printed() -> tuple[dict[str, Any], dict[str, str]] | None:
            # Running, and through its script: its claims stay allocated to it while it waits.
            p: dict[str, Any] = api.get(f"{pods}/reader")
            assert p["status"].get("phase") in ("Pending", "Running"), json.dumps(p["status"], indent=1)
            if p["status"].get("phase") != "Running":
                return None
            sections = _sections(real_node.container_log(p, "reader"))
            return (p, sections) if "end" in sections else None

        running_pod, out = eventually(printed, "the container prints its devices")
        assert running_pod["spec"]["nodeName"] == NODE_NAME
        generated = {s["name"]: s["resourceClaimName"] for s in running_pod["status"]["resourceClaimStatuses"]}
        claims = {"gpu": api.get(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/trainer-gpu"),
                  "spare": api.get(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/"
                                   f"{generated['spare']}")}
        assert claims["gpu"]["metadata"]["uid"] == named["metadata"]["uid"]
        paths = {"gpu": f"{ATTRIBUTES}/resourceclaims/trainer-gpu/gpu/{DRIVER}-metadata.json",
                 "spare": f"{ATTRIBUTES}/resourceclaimtemplates/spare/gpu/{DRIVER}-metadata.json"}
        assert sorted(k for k in out if k.startswith("file ")) == sorted(f"file {p}" for p in paths.values()), out
        minors = []
        for pod_claim, claim in claims.items():
            result, = claim["status"]["allocation"]["devices"]["results"]
            assert (result["driver"], result["pool"]) == (DRIVER, NODE_NAME)
            meta = _first(out[f"file {paths[pod_claim]}"])
            assert meta["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
            assert meta["metadata"]["name"] == claim["metadata"]["name"]
            assert meta["metadata"]["uid"] == claim["metadata"]["uid"]
            assert meta.get("podClaimName") == ("spare" if pod_claim == "spare" else None)
            request, = meta["requests"]
            device, = request["devices"]
            assert request["name"] == "gpu"
            assert (device["driver"], device["pool"], device["name"]) == (DRIVER, NODE_NAME, result["device"])
            # Every attribute the slice publishes for the device, as published.
            assert device["attributes"] == published[result["device"]]["attributes"]
            attrs = device["attributes"]
            assert f"DRA_GPU_{attrs['index']['int']}_UUID={attrs['uuid']['string']}" in out["env"]
            minors.append(attrs["minor"]["int"])
        # The GPUs' device nodes, made by runc from the CDI specs (hex major:minor; 195 is NVIDIA's).
        dev = out["dev"].splitlines()
        for minor in minors:
            assert f"/dev/nvidia{minor} character special file c3:{minor:x}" in dev, dev

        uids = [c["metadata"]["uid"] for c in claims.values()]
        cdi_dir = agent.root / "cdi"
        metadata_dir = agent.root / "kubelet" / "plugins" / DRIVER / "dra-device-metadata"

        def left(uid: str) -> bool:
            return bool(list(cdi_dir.glob(f"*{uid}*"))) or (metadata_dir / uid).exists()

        assert all(left(uid) for uid in uids)
        api.delete(f"{pods}/reader")
        eventually(lambda: not api.get(pods)["items"], "the kubelet lets the pod go")
        # The kubelet unprepared both claims: the agent removed their CDI specs and metadata.
        eventually(lambda: not any(left(uid) for uid in uids), "the claims' CDI specs and metadata go")
        unprepared = [m for m in agent.messages() if m.startswith("unprepared claim")]
        assert sorted(unprepared) == sorted(f"unprepared claim {NAMESPACE}/{c['metadata']['name']} "
                                            f"({c['metadata']['uid']})" for c in claims.values())
        assert agent.messages("error") == []


"""The real node's fixtures, for each module that runs one (test_cluster_kubelet.py, test_cluster_upgrades.py):
a control plane of the module's own whose node lifecycle controller treats the node as any cluster does,
and containerd and the kubelet (1.37) for NODE_NAME, Ready, whose kubelet and CDI directories are those of
the agent root `AGENT_ROOT` under the module's `node_runs`. Module-scoped, made available to every module
of tests/cluster by conftest.py: each module that asks for them gets a node and a plane of its own (the
host lock of nodekit.py makes two modules' nodes take turns)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .clusterkit import AgentRuns, ApiFailure, Cluster, eventually
from .controlplane import WITH_KUBELETS, ControlPlaneError, start_plane
from .nodekit import IMAGE, Node, NodeError, NodeReport, running
from .pki import Pki

NODE_NAME = "dra-kubelet-1"
AGENT_ROOT = "kn"  # the agents' root directory under `node_runs.base`: the node's kubelet and CDI directories
# The bound the node gets to become Ready after the kubelet answers /healthz: a bound, not an expectation.
READY_WITHIN = 120.0
# What an agent's own pod runs on the node (a sleeper in place of the DaemonSet's image).
SLEEPER = {"image": IMAGE, "imagePullPolicy": "Never", "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; "
                                                                    "sleep 2147483647 & wait"]}


def busybox() -> Path:
    from runtime import is_static_elf  # tests/runtime.py: the busybox-static check the podman tests use

    found = shutil.which("busybox")
    if found is None or not is_static_elf(Path(found).resolve()):
        pytest.fail(f"the node's image needs a static busybox (Debian's busybox-static); found {found}",
                    pytrace=False)
    return Path(found).resolve()


@pytest.fixture(scope="module")
def node_report() -> NodeReport:
    """Filled in by the fixtures below as they come up; conftest puts it in a failing test's report."""
    return NodeReport()


@pytest.fixture(scope="module")
def node_cluster(components: Path, cluster_root: Path, pki: Pki, node_report: NodeReport) -> Iterator[Cluster]:
    """A control plane for the real node alone, with deploy/ applied (the agent's RBAC, admission policy
    and device classes, the KubeVirt overlay's among them)."""
    root = Path(tempfile.mkdtemp(prefix="node-plane-", dir=cluster_root))
    try:
        plane = start_plane(components, root, pki, controllers=WITH_KUBELETS)
    except ControlPlaneError as exc:
        pytest.fail(f"the control plane did not start: {exc}", pytrace=False)
    c = Cluster(plane, root)
    try:
        c.apply_deploy()
        plane.wait_components()
    except Exception as exc:
        logs = plane.logs()
        c.close()
        plane.stop()
        pytest.fail(f"setting up the cluster failed: {exc}\n{logs}", pytrace=False)
    node_report.cluster = c
    try:
        yield c
    finally:
        node_report.cluster = None
        c.close()
        plane.stop()


@pytest.fixture(scope="module")
def node_runs(cluster_root: Path, node_report: NodeReport) -> Iterator[AgentRuns]:
    runs = node_report.runs = AgentRuns(Path(tempfile.mkdtemp(prefix="agent-", dir=cluster_root)))
    yield runs
    for proc in runs.started:
        proc.stop()


def node_object(cluster: Cluster) -> dict[str, Any] | None:
    try:
        node: dict[str, Any] = cluster.admin.get(f"/api/v1/nodes/{NODE_NAME}")
    except ApiFailure as exc:
        if exc.status == 404:
            return None
        raise
    return node


def ready(node: dict[str, Any] | None) -> bool:
    """The Node Ready and schedulable: its Ready condition True and the taints that go with not being
    ready (the kubelet registers with one, the node lifecycle controller removes it) gone."""
    if node is None:
        return False
    conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions") or []}
    taints = {t["key"] for t in node.get("spec", {}).get("taints") or []}
    return conditions.get("Ready") == "True" and not taints & {"node.kubernetes.io/not-ready",
                                                                "node.kubernetes.io/network-unavailable"}


@pytest.fixture(scope="module")
def real_node(node_cluster: Cluster, node_components: Path, node_runs: AgentRuns,
              node_report: NodeReport) -> Iterator[Node]:
    """containerd and the kubelet for NODE_NAME, Ready; its kubelet directory and CDI directory are
    those of the agent root AGENT_ROOT."""
    agent_root = node_runs.base / AGENT_ROOT
    node = node_report.node = Node(node_components, Path(tempfile.mkdtemp(prefix="node-", dir=node_runs.base)),
                                   NODE_NAME, node_cluster.plane, agent_root / "kubelet", agent_root / "cdi",
                                   busybox())
    try:
        with running(node):
            eventually(lambda: ready(node_object(node_cluster)), "the Node is Ready with no not-ready taint",
                       READY_WITHIN)
            yield node
    except NodeError as exc:
        pytest.fail(f"the node did not start: {exc}", pytrace=False)

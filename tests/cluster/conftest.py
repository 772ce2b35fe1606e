"""The real control plane for the tests under tests/cluster (marker `cluster`), started once per
session: etcd, kube-apiserver, kube-scheduler and kube-controller-manager built by
tests/cluster/build.py (`make cluster-components`), with deploy/ applied as a user applies it
and the agent's Node registered.

Without the built components the tests skip, saying how to build them; under CI=true or
DRA_TEST_NO_SKIP=1 that is an error instead. A failing test gets the end of each component's
log and of every agent's log it started in its report.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from .clusterkit import NODE, NODE_ALLOCATABLE, OTHER_NODE, AgentRuns, Cluster, eventually
from .controlplane import ControlPlaneError, start_plane, tail
from .nodekit import NodeReport
from .pki import Pki

# The real node's module-scoped fixtures (a node and a control plane for each module that asks for them).
from .realnode import node_cluster, node_report, node_runs, real_node  # noqa: F401
from .workloads import Namespace, NodeAgent, node_agent


def _build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dra_cluster_build", Path(__file__).with_name("build.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _strict() -> bool:
    """Whether a missing control plane is an error rather than a skip."""
    return any(os.environ.get(v, "") not in ("", "0", "false") for v in ("CI", "DRA_TEST_NO_SKIP"))


@pytest.fixture(scope="session")
def components() -> Path:
    """The bin directory of the built control plane."""
    build = _build_module()
    try:
        return Path(build.ensure(build_missing=False).bin)
    except build.BuildError as exc:
        if _strict():
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def node_components() -> Path:
    """The bin directory of the built kubelet and containerd (`make kubelet-components`)."""
    build = _build_module()
    try:
        return Path(build.ensure(build_missing=False, node_set=True).bin)
    except build.BuildError as exc:
        if _strict():
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def cluster_root() -> Iterator[Path]:
    # Short, under /tmp: the agents' unix sockets live below it (108-byte limit).
    root = Path(tempfile.mkdtemp(prefix="dra-k8s-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pki(cluster_root: Path) -> Pki:
    return Pki(cluster_root / "pki")


@pytest.fixture(scope="session")
def cluster(components: Path, cluster_root: Path, pki: Pki) -> Iterator[Cluster]:
    """The session's cluster: every DRA gate on, deploy/ applied (each overlay, then the base, so
    the base's objects are what is left), NODE (declaring DRANodeAllocatableResources) and
    OTHER_NODE registered."""
    started = time.monotonic()
    try:
        plane = start_plane(components, cluster_root / "main", pki)
    except ControlPlaneError as exc:
        pytest.fail(f"the control plane did not start: {exc}", pytrace=False)
    c = Cluster(plane, cluster_root)
    try:
        c.apply_deploy()
        c.add_node(NODE, declared=[NODE_ALLOCATABLE])
        c.add_node(OTHER_NODE)
        plane.wait_components()
    except Exception as exc:
        logs = plane.logs()
        c.close()
        plane.stop()
        pytest.fail(f"setting up the cluster failed: {exc}\n{logs}", pytrace=False)
    c.ready_in = time.monotonic() - started
    print(f"\ncontrol plane: API server ready in {plane.started_in:.1f} s, deploy/ applied and every "
          f"component healthy in {c.ready_in:.1f} s ({plane.root})")
    try:
        yield c
    finally:
        c.close()
        plane.stop()


@pytest.fixture(scope="session")
def agent_kubeconfig(cluster: Cluster) -> Path:
    """The agent's own ServiceAccount with a token bound to a Pod on NODE."""
    return cluster.agent_kubeconfig(NODE)


# The node of `scheduled` (dgx-h100: 8 GPUs) and its agent's flags: MIG placements, shared GPUs, and
# garbage collection after a second (tests delete claims the kubelet would have unprepared). No GPU
# host-memory overhead: kube-scheduler 1.37.2 cannot bind a pod asking for `example.com/gpu` when the
# device it gets has nodeAllocatableResources (docs/deployment.md, "Unchanged pods"), and such a pod is among the tests.
SCHEDULED_NODE = "dra-scheduled"
# A NIC for the workloads' NIC claims: this machine's own NIC is its uplink, which the `nic` class never
# offers, so the session makes a veth pair whose one end (`dratest*`) the scheduled agent publishes.
SCHEDULED_NIC = "dratest"
# The MIG profiles: the default's (1g, 2g, 3g, 7g) and the two the tests ask for beyond them (4g.40gb, whose
# placement overlaps a 3g.40gb's; 1g.10gb+me, the device plugin's `mig-1g.10gb.me`), named as an operator does.
SCHEDULED_FLAGS = ("--dynamic-mig=true", "--mig-profiles=1g,2g,3g,4g,7g,1g.10gb+me", "--gpu-sharing=true",
                   "--gc-grace-period=1", "--gpu-host-memory-overhead=0", f"--nic-include={SCHEDULED_NIC}*")


@pytest.fixture(scope="session")
def scheduled_nic() -> Iterator[str]:
    """The veth end the scheduled agent publishes (its peer's name is not included); deleted at the end."""
    tag = uuid.uuid4().hex[:6]
    name = f"{SCHEDULED_NIC}{tag}"
    subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"dtpeer{tag}"], check=True)
    for link in (name, f"dtpeer{tag}"):
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)


@pytest.fixture(scope="session")
def scheduled_agent(cluster: Cluster, cluster_root: Path, scheduled_nic: str) -> Iterator[NodeAgent]:
    with node_agent(cluster, SCHEDULED_NODE, cluster_root / "scheduled", *SCHEDULED_FLAGS,
                    declared=[NODE_ALLOCATABLE]) as running:
        yield running


@pytest.fixture
def scheduled(scheduled_agent: NodeAgent) -> Iterator[NodeAgent]:
    """One agent for the tests of what the real scheduler allocates, started once for them all, on a
    Node that declares DRANodeAllocatableResources (running again if a test stopped it and failed).
    After a test, until it holds no prepared claim: those a test left are garbage-collected once the
    test's namespace is gone (`ns`, torn down first), so the next test finds every device free."""
    if scheduled_agent.proc is None:
        scheduled_agent.start()
    yield scheduled_agent
    if scheduled_agent.proc is None:
        scheduled_agent.start()
    eventually(lambda: not scheduled_agent.prepared(), "the agent unprepares what the test left")


@pytest.fixture
def ns(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Namespace]:
    """A namespace of the test's own, emptied at its end (so that every device is free again)."""
    space = Namespace(cluster, request.node.name.replace("_", "-")[:50].rstrip("-").lower()).create()
    yield space
    space.clean()


@pytest.fixture
def agent_runs(cluster_root: Path, request: pytest.FixtureRequest) -> Iterator[AgentRuns]:
    base = Path(tempfile.mkdtemp(prefix="agent-", dir=cluster_root))
    runs = AgentRuns(base)
    request.node.agent_runs = runs
    yield runs
    for proc in runs.started:
        proc.stop()


def events(cluster: Cluster) -> str:
    """Every Event of the cluster, oldest first, a line each: what the scheduler, the kubelet and the
    controllers said about pods, claims and nodes."""
    items = cluster.admin.get("/api/v1/events")["items"]
    items.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    lines = []
    for e in items:
        about = e["involvedObject"]
        lines.append(f"{e.get('lastTimestamp') or e.get('eventTime')} {e['type']} {about.get('kind')}/"
                     f"{e['metadata']['namespace']}/{about.get('name')} {e.get('reason')}: "
                     f"{e.get('message', '').strip()}")
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    funcargs = getattr(item, "funcargs", {})
    reports = [v for v in funcargs.values() if isinstance(v, NodeReport)]
    clusters = [v for v in funcargs.values() if isinstance(v, Cluster)] + [r.cluster for r in reports if r.cluster]
    for cluster in {id(c): c for c in clusters}.values():
        report.sections.append((f"control plane logs ({cluster.plane.root})", cluster.plane.logs()))
    for r in reports:
        if r.cluster is not None:
            try:
                report.sections.append(("events", events(r.cluster)))
            except Exception as exc:  # the report of a failure must not fail itself
                report.sections.append(("events", f"could not be listed: {exc}"))
        if r.node is not None:
            report.sections.append((f"node {r.node.name}", r.node.logs()))
    runs = [getattr(item, "agent_runs", None), *(r.runs for r in reports)]
    runs += [a.runs for a in funcargs.values() if isinstance(a, NodeAgent)]
    # A shared agent may be in more than one fixture, and a restarted one appends to the same log.
    logs = {p.log for r in runs if isinstance(r, AgentRuns) for p in r.started}
    for log in sorted(logs):
        report.sections.append((f"agent log {log}", tail(log, 80)))

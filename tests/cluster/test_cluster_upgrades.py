"""Upgrades through the real kubelet (1.37), with pods starting through them: the agent rolled (a second agent
beside the first, as the DaemonSet's `maxSurge: 1` makes it, and one after the other, as `maxSurge: 0` would),
and the kubelet restarted under the agent. docs/deployment.md, "Upgrade", states what each does to running pods
and to pods starting meanwhile, with the figures these tests print.

What the kubelet does (pkg/kubelet/cm/dra/plugin of the pinned release): it calls the newest connected plugin
of a driver; a pod whose claims it must prepare while no plugin of the driver is registered fails that attempt
("DRA driver ... is not registered", an Event FailedPrepareDynamicResources) and is tried again by its pod
worker; 30 s after the last plugin of a driver goes it deletes the driver's ResourceSlices of its node, unless a
plugin is back by then; and when it starts it deletes every ResourceSlice of its node at once.

Each test has agents of its own on the module's node (realnode.py), sharing one root as the DaemonSet's pods
share the host's directories; a steady stream of pods (`PodStream`) with a claim of each kind the simulated
DGX H100 offers the real node (a whole GPU, a MIG device, a share of a GPU, CPUs and memory) runs throughout,
each pod deleted once it runs. Every wait is bounded (`eventually`); no duration is asserted, they are printed.

Marker `kubelet` (docs/tests.md, "A real kubelet"): `make test-kubelet` runs these with the other real-node
tests."""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml

from agent.config import Settings

from .clusterkit import (
    DRIVER,
    METRIC,
    SLICES,
    AgentProcess,
    AgentRuns,
    Cluster,
    Rest,
    devices_of,
    eventually,
    slices_of,
)
from .nodekit import Node, NodeReport
from .realnode import AGENT_ROOT, NODE_NAME, SLEEPER, node_object, ready
from .workloads import Namespace

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]

# As the node's agent in test_cluster_kubelet.py (MIG placements and shares published), collecting after a
# second's grace: a claim whose pod the kubelet still runs must never be.
FLAGS = ("--dynamic-mig=true", "--gpu-sharing=true", "--gpu-host-memory-overhead=0", "--gc-grace-period=1")
# One claim template per kind of device the stream's pods take, in turn (its claims' `devices`).
KINDS: dict[str, dict[str, Any]] = {
    "gpu": {"requests": [{"name": "dev", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]},
    "mig": {"requests": [{"name": "dev", "exactly": {
        "deviceClassName": f"mig.{DRIVER}",
        "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "1g.10gb"'}}]}}]},
    "share": {"requests": [{"name": "dev", "exactly": {
        "deviceClassName": f"gpu-shared.{DRIVER}", "capacity": {"requests": {"memory": "10Gi", "compute": "500m"}}}}]},
    "cpu": {"requests": [
        {"name": "dev", "exactly": {"deviceClassName": f"cpu.{DRIVER}", "capacity": {"requests": {"cpus": "1"}}}},
        {"name": "mem", "exactly": {"deviceClassName": f"memory.{DRIVER}",
                                    "capacity": {"requests": {"memory": "1Gi"}}}}]},
}
# The stream: a pod every STREAM_INTERVAL seconds while fewer than STREAM_ALIVE of its pods exist (what two
# cores shared by the control plane, the node and two agents keep up with).
STREAM_INTERVAL = 0.4
STREAM_ALIVE = 8
NOT_REGISTERED = f"DRA driver {DRIVER} is not registered"
AUTHORIZER_LAG = "no relationship found between node"
# The bound for a pod to run: a pod whose first start failed (no plugin; the authorizer's lag) is tried again by
# the kubelet's pod worker after its backoff, seen here to be up to its resync period (a minute) and more.
RUNS_WITHIN = 180.0


@pytest.fixture(scope="module", autouse=True)
def _reported(node_report: NodeReport) -> None:
    """Every test of the module has the node's report (conftest.py, realnode.py)."""


def pod(name: str, kind: str, *, stream: bool) -> dict[str, Any]:
    """A pod on the node (placed by the scheduler, which allocates its claim from the template of `kind`)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"kind": kind, "stream": str(stream).lower()}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": NODE_NAME}, "automountServiceAccountToken": False,
                     "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "resourceClaims": [{"name": "dev", "resourceClaimTemplateName": kind}],
                     "containers": [{"name": "work", **SLEEPER, "resources": {"claims": [{"name": "dev"}]}}]}}


def admin_rest(cluster: Cluster) -> Rest:
    """An admin client of its own (for a thread: the tests' client is the main thread's)."""
    plane = cluster.plane
    assert plane.admin is not None
    return Rest(plane.server, plane.pki.ca, cert=(plane.admin.cert, plane.admin.key))


def with_templates(cluster: Cluster, name: str) -> Namespace:
    ns = Namespace(cluster, name).create()
    for kind, spec in KINDS.items():
        ns.template(kind, {"devices": spec})
    return ns


@dataclass
class PodStream:
    """Pods with claims created at a steady pace in a thread, each kind of KINDS in turn, and each deleted once
    it runs; what became of them. A pod that fails (phase Failed) is recorded and deleted too."""

    cluster: Cluster
    ns: Namespace
    created: list[str] = field(default_factory=list)
    ran: set[str] = field(default_factory=set)
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    errors: list[str] = field(default_factory=list)

    def __enter__(self) -> PodStream:
        self._thread = threading.Thread(target=self._run, name="pod-stream", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        api = admin_rest(self.cluster)
        kinds = list(KINDS)
        try:
            while not self._stop.is_set():
                alive = self._reap(api)
                if alive < STREAM_ALIVE:
                    name = f"s-{len(self.created):03d}"
                    kind = kinds[len(self.created) % len(kinds)]
                    api.post(self.ns.path("pods"), pod(name, kind, stream=True))
                    self.created.append(name)
                self._stop.wait(STREAM_INTERVAL)
        except Exception as exc:  # reported by `done`: the thread must not die silently
            self.errors.append(repr(exc))
        finally:
            api.close()

    def _reap(self, api: Rest) -> int:
        """Each pod of the stream that runs or failed, deleted; how many it has (those going included)."""
        pods = api.get(self.ns.path("pods"), labelSelector="stream=true")["items"]
        for p in pods:
            name, phase = p["metadata"]["name"], p["status"].get("phase")
            if p["metadata"].get("deletionTimestamp") or phase not in ("Running", "Failed", "Succeeded"):
                continue
            if phase == "Running":
                self.ran.add(name)
            else:
                self.failed[name] = p["status"]
            with contextlib.suppress(Exception):
                api.delete(self.ns.path("pods", name))
        return len(pods)

    def wait_ran(self, count: int, what: str) -> None:
        eventually(lambda: self.errors or len(self.ran) >= count, f"{count} pods of the stream run ({what})")
        assert not self.errors, self.errors

    def done(self) -> None:
        """Stopped; every pod it made ran (or failed) and is gone."""
        self.stop()
        assert not self.errors, self.errors
        api = self.cluster.admin

        def settled() -> bool:
            self._reap(api)
            return not api.get(self.ns.path("pods"), labelSelector="stream=true")["items"]

        eventually(settled, "every pod of the stream runs and goes", RUNS_WITHIN)


@dataclass
class SliceEvent:
    at: float  # time.monotonic() when the test saw it
    type: str
    name: str
    obj: dict[str, Any]


class SliceWatch:
    """Every change to the node's ResourceSlices of the driver from now on, as the API server's watch reports
    it, with when the test saw it; and the slices as those changes leave them."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.events: list[SliceEvent] = []
        listed = cluster.admin.get(SLICES, fieldSelector=self.selector)
        self.listed: dict[str, dict[str, Any]] = {s["metadata"]["name"]: s for s in listed["items"]}
        self.current = dict(self.listed)
        self._since = listed["metadata"]["resourceVersion"]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="slice-watch", daemon=True)
        self.errors: list[str] = []

    @property
    def selector(self) -> str:
        return f"spec.nodeName={NODE_NAME},spec.driver={DRIVER}"

    def _run(self) -> None:
        api = admin_rest(self.cluster)
        try:
            while not self._stop.is_set():
                # Short watches, resumed from the last version: the thread sees `_stop` within seconds.
                params = {"watch": "1", "resourceVersion": self._since, "fieldSelector": self.selector,
                          "timeoutSeconds": "2", "allowWatchBookmarks": "false"}
                with api.client.stream("GET", SLICES, params=params, timeout=None) as r:
                    for line in r.iter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            raise RuntimeError(f"the slices' watch ended: {event['object']}")
                        obj = event["object"]
                        name = obj["metadata"]["name"]
                        self._since = obj["metadata"]["resourceVersion"]
                        with self._lock:
                            self.events.append(SliceEvent(time.monotonic(), event["type"], name, obj))
                            if event["type"] == "DELETED":
                                self.current.pop(name, None)
                            else:
                                self.current[name] = obj
        except Exception as exc:
            self.errors.append(repr(exc))
        finally:
            api.close()

    def __enter__(self) -> SliceWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def deleted(self) -> list[SliceEvent]:
        with self._lock:
            return [e for e in self.events if e.type == "DELETED"]

    def devices(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return devices_of(list(self.current.values()))

    def changes(self, kind: str) -> int:
        with self._lock:
            return sum(e.type == kind for e in self.events)

    def back_at(self, after: float) -> float | None:
        """When the watch's slices were first a whole pool again after time `after`: every slice of one
        generation there, as many as the pool says it has (`resourceSliceCount`)."""
        with self._lock:
            state, events = dict(self.listed), list(self.events)
        for e in events:  # the slices as each change left them
            if e.type == "DELETED":
                state.pop(e.name, None)
            else:
                state[e.name] = e.obj
            if e.at > after and whole_pool(list(state.values())):
                return e.at
        return None


def whole_pool(found: list[dict[str, Any]]) -> bool:
    pools = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in found}
    return len(pools) == 1 and next(iter(pools))[1] == len(found)


# -- what the agents and the kubelet say ---------------------------------------------------------------

@dataclass
class AgentPod:
    """An agent's own pod (what its token is bound to; its UID names its sockets, as the DaemonSet's
    `--rolling-update-pod-uid` from the downward API does) and its kubeconfig."""

    uid: str
    kubeconfig: Path

    def settings(self, root: Path) -> Settings:
        return Settings(node_name=NODE_NAME, kubelet_dir=root / "kubelet", state_dir=root / "state",
                        rolling_update_pod_uid=self.uid)

    def sockets(self, root: Path) -> tuple[Path, Path]:
        s = self.settings(root)
        return s.registration_socket, s.dra_socket


def agent_pod(cluster: Cluster, name: str) -> AgentPod:
    made = cluster.pod_on(NODE_NAME, name, container=SLEEPER)
    return AgentPod(made["metadata"]["uid"], cluster.kubeconfig(name, cluster.token(pod=made)))


@contextlib.contextmanager
def rolled_agent(runs: AgentRuns, who: AgentPod, log: str) -> Iterator[AgentProcess]:
    """`dra-agent run` of `who` on the node's root, its sockets named by its pod's UID, logging to `log`;
    once it published and the kubelet registered it."""
    with runs.run(AGENT_ROOT, who.kubeconfig, *FLAGS, f"--rolling-update-pod-uid={who.uid}", node=NODE_NAME,
                  own_kubelet=False, log_name=log) as agent:
        registered(agent)
        yield agent


def registered(agent: AgentProcess) -> None:
    agent.wait_published()
    eventually(lambda: agent.metric("dra_agent_kubelet_registered") == 1.0, "the kubelet registers the plugin")


def prepared(agent: AgentProcess, ns: Namespace, verb: str = "prepared") -> set[str]:
    """The claims of `ns` the agent says it prepared (or unprepared), as `<namespace>/<name> (<uid>)`."""
    return {m.removeprefix(f"{verb} claim ") for m in agent.messages() if m.startswith(f"{verb} claim {ns.name}/")}


def prepares(agent: AgentProcess) -> float:
    """The claims the agent prepared (its metric: at once, where its log lines are written in the background)."""
    return agent.metric('dra_agent_claim_operations_total{operation="prepare",result="success"}')


def slice_writes(agent: AgentProcess) -> float:
    """The ResourceSlices the agent updated so far (its metric)."""
    return agent.metric('dra_agent_slice_writes_total{action="update"}')


def prepare_errors(agent: AgentProcess) -> float:
    return agent.metric('dra_agent_claim_operations_total{operation="prepare",result="error"}')


def kubelet_metrics(node: Node, cluster: Cluster) -> dict[str, float]:
    """The kubelet's own metrics (its authenticated port; the admin's client certificate is of the CA the
    kubelet trusts), `name{labels}` -> value."""
    port = yaml.safe_load((node.root / "kubelet.yaml").read_text())["port"]
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # its serving certificate is self-signed
    assert cluster.plane.admin is not None
    context.load_cert_chain(str(cluster.plane.admin.cert), str(cluster.plane.admin.key))
    with httpx2.Client(verify=context, timeout=10.0) as client:
        text = client.get(f"https://127.0.0.1:{port}/metrics").text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := METRIC.match(line):
            out[m["name"] + (f"{{{m['labels']}}}" if m["labels"] else "")] = float(m["value"])
    return out


def failed_calls(node: Node, cluster: Cluster) -> float:
    """The kubelet's count of NodePrepareResources calls to the driver that failed (its gRPC client's metric:
    any status but OK)."""
    return sum(v for k, v in kubelet_metrics(node, cluster).items()
               if k.startswith("dra_grpc_operations_duration_seconds_count{") and "NodePrepareResources" in k
               and f'driver_name="{DRIVER}"' in k and 'grpc_status_code="OK"' not in k)


def prepare_failures(ns: Namespace) -> list[str]:
    """The kubelet's Events of the namespace saying a pod's claims could not be prepared, but for those of the
    API server's node authorizer: a pod the kubelet sees bound before the authorizer's graph has it cannot have
    its claim read yet (`no relationship found between node ...`), whatever the driver does; the kubelet tries
    it again later."""
    events = ns.cluster.admin.get(f"/api/v1/namespaces/{ns.name}/events")["items"]
    return [f"{e['involvedObject']['name']}: {e.get('message', '')}" for e in events
            if e.get("reason") == "FailedPrepareDynamicResources" and AUTHORIZER_LAG not in e.get("message", "")]


def long_pods(cluster: Cluster, ns: Namespace) -> dict[str, str]:
    """A running pod of each kind (not the stream's): pod name -> its claim as the agents' logs name it."""
    for kind in KINDS:
        cluster.admin.post(ns.path("pods"), pod(f"long-{kind}", kind, stream=False))
    out = {}
    for kind in KINDS:
        name = f"long-{kind}"
        eventually(lambda n=name: ns.get("pods", n)["status"].get("phase") == "Running", f"pod {name} runs",
                   RUNS_WITHIN)
        claim = ns.claims_of(name)["dev"]
        out[name] = f"{ns.name}/{claim['metadata']['name']} ({claim['metadata']['uid']})"
    return out


def cdi_specs(root: Path) -> set[str]:
    return {p.name for p in (root / "cdi").glob(f"{DRIVER}-claim_*")}


# -- the agent rolled ------------------------------------------------------------------------------------

def test_a_rolling_update_with_overlap_fails_no_pod_starting_through_it(
        node_cluster: Cluster, real_node: Node, node_runs: AgentRuns) -> None:
    """`maxSurge: 1`: agent B (another pod, the same directories) starts and registers while agent A runs, then
    A gets SIGTERM and goes, while pods with claims keep being created. No pod fails and the kubelet fails no
    prepare; the kubelet calls B as soon as it registered; the slices are never deleted; the claims A prepared
    are unprepared by B when their pods go; A's sockets are gone and B's kept."""
    cluster, root = node_cluster, node_runs.base / AGENT_ROOT
    pod_a, pod_b = agent_pod(cluster, "dra-agent-roll-a"), agent_pod(cluster, "dra-agent-roll-b")
    ns = with_templates(cluster, "roll")
    try:
        with contextlib.ExitStack() as stack:
            a = stack.enter_context(rolled_agent(node_runs, pod_a, "agent-roll-a.log"))
            kubelet_failed = failed_calls(real_node, cluster)
            published = set(devices_of(slices_of(cluster.admin, NODE_NAME)))
            watch = stack.enter_context(SliceWatch(cluster))
            by_a = long_pods(cluster, ns)
            eventually(lambda: set(by_a.values()) <= prepared(a, ns), "agent A says it prepared the claims")
            stream = stack.enter_context(PodStream(cluster, ns))
            stream.wait_ran(4, "agent A alone")

            started = time.monotonic()
            b = stack.enter_context(rolled_agent(node_runs, pod_b, "agent-roll-b.log"))
            b_up = time.monotonic() - started
            at_b, a_writes = len(stream.ran), slice_writes(a)
            stream.wait_ran(at_b + 4, "both agents")
            # The kubelet calls the newest plugin: B prepared pods' claims while A still ran.
            assert prepares(b) > 0, "agent B prepared nothing while both ran"
            a_errors, a_rewrites = prepare_errors(a), slice_writes(a) - a_writes

            started = time.monotonic()
            a.stop()
            a_stop = time.monotonic() - started
            at_a_gone, b_before = len(stream.ran), prepares(b)
            stream.wait_ran(at_a_gone + 4, "agent B alone")
            stream.done()

            for name in by_a:
                cluster.admin.delete(ns.path("pods", name))
            eventually(lambda: set(by_a.values()) <= prepared(b, ns, "unprepared"),
                       "agent B unprepares the claims agent A prepared")
            eventually(lambda: not cdi_specs(root), "every claim's CDI spec goes")

            print(f"\nrolling update with overlap: {len(stream.created)} pods created ({len(stream.ran)} ran), "
                  f"agent A prepared {len(prepared(a, ns))} claims, B {prepares(b):g}; B registered "
                  f"{b_up:.1f} s after it started, A stopped {a_stop:.1f} s after SIGTERM; A updated "
                  f"{a_rewrites:g} slices while B ran; slices: "
                  f"{watch.changes('MODIFIED')} modified, {watch.changes('ADDED')} added, "
                  f"{len(watch.deleted())} deleted")
            assert not stream.failed, stream.failed
            assert prepare_failures(ns) == []
            assert failed_calls(real_node, cluster) == kubelet_failed
            assert a_errors == 0 and prepare_errors(b) == 0
            # The two agents publish one pool: a pool the other wrote is verified against a fresh scan of the
            # devices, so A wrote its view back over B's at most once (before, each rewrote the other's slices
            # every second or two for as long as both ran).
            assert a_rewrites <= len(slices_of(cluster.admin, NODE_NAME)), a_rewrites
            assert prepares(b) > b_before, "agent B prepared nothing after A went"
            assert not (set(by_a.values()) & prepared(a, ns, "unprepared"))
            assert not watch.errors and watch.deleted() == [], watch.deleted()
            # Once no claim is left, every device is published as before (a GPU's MIG mode is off again).
            eventually(lambda: set(watch.devices()) == published, "the node's devices are all published")
            # A's sockets gone, B's kept: the kubelet still has B registered.
            assert [p for p in pod_a.sockets(root) if p.exists()] == []
            assert all(p.exists() for p in pod_b.sockets(root))
            assert b.metric("dra_agent_kubelet_registered") == 1.0
            assert a.messages("error") == [] and b.messages("error") == []
    finally:
        ns.clean()


def test_a_rolling_update_without_overlap_starts_the_pods_of_its_window_and_keeps_the_slices(
        node_cluster: Cluster, real_node: Node, node_runs: AgentRuns) -> None:
    """`maxSurge: 0`: agent A stops, then agent B starts. Pods created meanwhile wait: the kubelet cannot
    prepare their claims while no plugin is registered, and its pod worker tries again once B registered, and
    they run. B is back within the kubelet's 30 s: the slices are never deleted. The claims A prepared are
    unprepared by B."""
    cluster, root = node_cluster, node_runs.base / AGENT_ROOT
    pod_a, pod_b = agent_pod(cluster, "dra-agent-gap-a"), agent_pod(cluster, "dra-agent-gap-b")
    ns = with_templates(cluster, "gap")
    try:
        with contextlib.ExitStack() as stack:
            a = stack.enter_context(rolled_agent(node_runs, pod_a, "agent-gap-a.log"))
            published = set(devices_of(slices_of(cluster.admin, NODE_NAME)))
            watch = stack.enter_context(SliceWatch(cluster))
            by_a = long_pods(cluster, ns)

            stopped = time.monotonic()
            a.stop()
            a_gone = time.monotonic()
            # Pods created in the window: the kubelet tries them and fails, for want of a plugin.
            window = [f"w-{kind}" for kind in KINDS]
            for name, kind in zip(window, KINDS, strict=True):
                cluster.admin.post(ns.path("pods"), pod(name, kind, stream=False))
            eventually(lambda: any(NOT_REGISTERED in f for f in prepare_failures(ns)),
                       "the kubelet fails a window pod's prepare: no plugin is registered")
            b_started = time.monotonic()
            b = stack.enter_context(rolled_agent(node_runs, pod_b, "agent-gap-b.log"))
            b_registered = time.monotonic()
            for name in window:
                eventually(lambda n=name: ns.get("pods", n)["status"].get("phase") == "Running",
                           f"pod {name} of the window runs once agent B registered", RUNS_WITHIN)
            window_ran = time.monotonic() - b_registered
            for name in [*by_a, *window]:
                cluster.admin.delete(ns.path("pods", name))
            eventually(lambda: set(by_a.values()) <= prepared(b, ns, "unprepared"),
                       "agent B unprepares the claims agent A prepared")
            eventually(lambda: not cdi_specs(root), "every claim's CDI spec goes")

            failures = prepare_failures(ns)
            print(f"\nrolling update without overlap: no plugin for {b_registered - stopped:.1f} s (A stopped "
                  f"{a_gone - stopped:.1f} s after SIGTERM; B registered {b_registered - b_started:.1f} s after "
                  f"it started); {len(failures)} failed prepares in the window, every window pod ran "
                  f"{window_ran:.1f} s after B registered at the latest (the kubelet's retry)")
            # The only failures were the window's: no plugin registered.
            assert failures and all(NOT_REGISTERED in f for f in failures), failures
            assert prepare_errors(b) == 0
            assert not watch.errors and watch.deleted() == [], watch.deleted()
            # Once no claim is left, every device is published as before (a GPU's MIG mode is off again).
            eventually(lambda: set(watch.devices()) == published, "the node's devices are all published")
            assert [p for p in pod_a.sockets(root) if p.exists()] == []
            assert all(p.exists() for p in pod_b.sockets(root))
            assert a.messages("error") == [] and b.messages("error") == []
    finally:
        ns.clean()


# -- the kubelet restarted -------------------------------------------------------------------------------

def test_a_restarted_kubelet_deletes_the_slices_and_the_agent_publishes_them_again(
        node_cluster: Cluster, real_node: Node, node_runs: AgentRuns) -> None:
    """The kubelet restarted under the agent while pods start: as it starts it deletes every slice of its
    node; the agent sees the deletion (its watch of the pool's slices) and publishes them again. Printed: the
    time from the deletion to the slices back (a whole pool again). The pods created meanwhile all run: those
    scheduled before the deletion and tried by the kubelet before it registered the plugin are tried again, and
    those created while the slices were away wait for them. A running pod's claim is kept (its container runs on),
    prepared once, and unprepared once when the pod goes; then every device is published as before."""
    cluster, root = node_cluster, node_runs.base / AGENT_ROOT
    who = agent_pod(cluster, "dra-agent-kubelet")
    ns = with_templates(cluster, "kubelet-restart")
    try:
        with contextlib.ExitStack() as stack:
            agent = stack.enter_context(rolled_agent(node_runs, who, "agent-kubelet.log"))
            published = set(devices_of(slices_of(cluster.admin, NODE_NAME)))
            keeper = long_pods(cluster, ns)["long-gpu"]
            container = ns.get("pods", "long-gpu")["status"]["containerStatuses"][0]["containerID"]
            watch = stack.enter_context(SliceWatch(cluster))
            stream = stack.enter_context(PodStream(cluster, ns))
            stream.wait_ran(2, "before the restart")

            restarted = time.monotonic()
            real_node.restart_kubelet()
            eventually(lambda: watch.deleted(), "the restarted kubelet deletes the node's slices")
            deleted_at = watch.deleted()[0].at
            eventually(lambda: watch.back_at(deleted_at), "the agent publishes the slices again")
            back_at = watch.back_at(deleted_at)
            assert back_at is not None
            eventually(lambda: ready(node_object(cluster)), "the Node is Ready again")
            at_restart = len(stream.ran)
            stream.wait_ran(at_restart + 4, "after the restart")
            stream.done()

            print(f"\nkubelet restart: slices deleted {deleted_at - restarted:.1f} s after the restart began, "
                  f"back {back_at - deleted_at:.2f} s after their deletion; {len(stream.created)} pods created, "
                  f"{len(prepare_failures(ns))} failed prepares")
            assert not stream.failed, stream.failed
            assert all(NOT_REGISTERED in f for f in prepare_failures(ns)), prepare_failures(ns)
            assert prepare_errors(agent) == 0
            (now,) = ns.get("pods", "long-gpu")["status"]["containerStatuses"]
            assert now["containerID"] == container and now.get("state", {}).get("running")
            assert sum(m == f"prepared claim {keeper}" for m in agent.messages()) == 1
            for name in (f"long-{k}" for k in KINDS):
                cluster.admin.delete(ns.path("pods", name))
            eventually(lambda: not cdi_specs(root), "every claim's CDI spec goes")
            eventually(lambda: sum(m == f"unprepared claim {keeper}" for m in agent.messages()) == 1,
                       "the agent unprepares the kept claim once")
            eventually(lambda: set(watch.devices()) == published, "the node's devices are all published")
            assert not watch.errors
            assert agent.messages("error") == []
    finally:
        ns.clean()

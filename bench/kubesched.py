"""What the agent's slices cost the real kube-scheduler: pods with claim templates scheduled onto N fake
Nodes whose slices are exactly what the agent renders for them, beside the same rounds on a plain
inventory (the same 8 GPUs as whole devices, no counters) in the same run.

The control plane is the cluster tests' (`make cluster-components`: etcd, kube-apiserver,
kube-scheduler and kube-controller-manager 1.37.2, tests/cluster/controlplane.py), with the
scheduler's and the controller-manager's client QPS and burst raised to 5,000, as upstream's
scheduler_perf raises the scheduler's, so that neither client's rate limiter sets the pace. No
kubelet: the Nodes are registered as a kubelet would (Ready, allocatable cpu, memory and pods), the
pods stay bound and never run. deploy/ is applied as a user applies it (its DeviceClasses).

Each inventory's slices are rendered in the bench's own process by the agent's code, as `dra-agent
slices -o json` renders them (discovery once per inventory on the simulated dgx-h100, then the pool
of each Node: its name, its pool, the Node as owner). Each round (one kind of request on one
inventory) runs in a fresh namespace with nothing allocated: M pods, each with a claim from the
kind's template (the controller-manager's resourceclaim controller makes the claims), created from 4
threads; a watch sees each pod bound. Per round:
- pods/s: M over first creation to last bound;
- scheduler CPU ms per pod: the kube-scheduler process's user + system time (/proc/<pid>/stat) over the
  round, divided by M;
- p99 (and p50) creation-to-bound: from the bench's own clock when the pod's create returned to when
  the watch saw `spec.nodeName` (a pod's creationTimestamp has 1 s resolution).
- scheduling attempts per pod (`scheduler_schedule_attempts_total` from the scheduler's /metrics): a pod
  tried again pays its filters again.
The pods are then deleted (grace 0: no kubelet would confirm) and the round waits for their claims to
be gone (deallocated, the devices free again) before the next one. With `profile`, an extra round of
each kind named on the richest inventory runs under the scheduler's CPU profile (pprof). With
`what_if`, the WHAT_IF inventories too: changes to the agent's slices measured before they are made.

Gates: `default` is every DRA gate at the default the built kube-apiserver states in its `--help`;
`alpha` is the cluster tests' set (every DRA gate of 1.37 on, alpha ones included): what the agent's
node-allocatable, partition-type and compatibility-group features need.

Run alone: `.venv/bin/python bench/kubesched.py --nodes 10 --pods 10` (JSON on stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import fleet  # noqa: E402  (the cluster tests' kit, loaded as the fleet loads it)

from agent.app import oneshot  # noqa: E402
from agent.config import build_settings  # noqa: E402
from agent.kube import NodeInfo  # noqa: E402
from agent.publish import dropped, slices  # noqa: E402

DRIVER = "dra.example.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NVML = "sim:dgx-h100"
# Upstream's scheduler_perf gives the scheduler's client QPS and burst of 5,000; the defaults (50 and 100
# for the scheduler, 20 and 30 for the controller-manager, which makes every claim) would time the
# client-side rate limiters instead of the scheduler.
CLIENT_RATE = ("--kube-api-qps=5000", "--kube-api-burst=5000")
# The scheduler's CPU profile (--profile), fetched from its secure port without credentials.
PPROF = "/debug/pprof/profile"
METRICS = "/metrics"  # its scheduling attempts, read the same way
CREATORS = 4  # threads creating pods: faster than the plain inventory schedules on 2 cores
PROFILE_SECONDS = 20  # the profile's window: the profiled round is sized to keep the scheduler busy through it
ROUND_LIMIT = 120.0  # seconds a round may take beyond 1 s a pod: a bound, not an expectation
GONE_LIMIT = 60.0  # seconds for a round's claims to be deallocated and deleted


@dataclass(frozen=True)
class Inventory:
    name: str
    what: str
    settings: Mapping[str, Any]  # the agent's settings over the bench's (simulated dgx-h100)
    plain: bool = False  # the GPUs alone: whole devices, no counters, one slice
    # What-ifs, not what the agent renders (--what-if): `lean`, the MIG placements with only the attributes
    # and capacity a MIG request selects by (what each attribute a placement carries costs); `by_gpu`, the
    # devices of no GPU first, then each GPU's forms together (whole, passthrough, shared, its placements),
    # in slices named in that order (what the walk to the first free device costs each kind).
    lean: bool = False
    by_gpu: bool = False


INVENTORIES = (
    Inventory("plain", "the same 8 GPUs as whole devices, no counters (1 slice)", {"dynamic_mig": False}, plain=True),
    Inventory("least", "--dynamic-mig=false: whole GPUs and passthrough forms, with counters", {"dynamic_mig": False}),
    Inventory("default", "the agent's defaults: dynamic MIG, passthrough forms", {}),
    Inventory("rich", "--gpu-sharing=true over the defaults: dynamic MIG + sharing + passthrough",
              {"gpu_sharing": True}),
    Inventory("all", "--mig-profiles=all over rich: every placement of every MIG profile",
              {"gpu_sharing": True, "mig_profiles": "all"}),
)
RICHEST = "rich"
WHAT_IF = (Inventory("rich-lean", "what-if: the rich inventory, its MIG placements with only type, profile, "
                     "parentUUID and memory", {"gpu_sharing": True}, lean=True),
           Inventory("rich-by-gpu", "what-if: the rich inventory, the devices of no GPU first, then GPU by GPU",
                     {"gpu_sharing": True}, by_gpu=True))
GPU_FORMS = {"gpu": 0, "vfio": 1, "shared": 2, "mig": 3}  # a GPU's forms in the by_gpu what-if, in its order
# What the lean what-if keeps of a MIG placement.
LEAN_ATTRIBUTES = ("type", "profile", "parentUUID")
LEAN_CAPACITY = ("memory",)


@dataclass(frozen=True)
class Kind:
    """One kind of request: a claim template of one request of a deploy/ class."""

    name: str
    device_class: str  # deploy/'s name, without ".<driver>"
    type: str  # the device's `type` attribute (and `nativeType` for passthrough forms)
    native: str = ""
    profile: str = ""
    selector: str = ""
    capacity: Mapping[str, str] = field(default_factory=dict)
    per_node: int = 0  # at most this many fit a node (0: more than any round asks)

    def request(self) -> dict[str, Any]:
        exactly: dict[str, Any] = {"deviceClassName": f"{self.device_class}.{DRIVER}"}
        if self.selector:
            exactly["selectors"] = [{"cel": {"expression": self.selector}}]
        if self.capacity:
            exactly["capacity"] = {"requests": dict(self.capacity)}
        return {"name": "d", "exactly": exactly}

    def matches(self, device: Mapping[str, Any]) -> bool:
        """Whether the inventory has such a device (the scheduler decides which: this only skips rounds
        that could schedule nothing)."""
        attrs = device.get("attributes") or {}

        def text(name: str) -> str:
            return str((attrs.get(name) or {}).get("string", ""))

        return text("type") == self.type and (not self.native or text("nativeType") == self.native) and \
            (not self.profile or text("profile") == self.profile)


KINDS = (
    Kind("gpu", "gpu", "gpu", per_node=8),
    Kind("mig", "mig", "mig", profile="1g.10gb", selector=f"device.attributes['{DRIVER}'].profile == '1g.10gb'"),
    Kind("share", "gpu-shared", "shared", capacity={"memory": "10Gi"}),
    Kind("compute", "gpu-shared", "shared", capacity={"compute": "250m"}),
    Kind("passthrough", "gpu-passthrough", "vfio", native="gpu", per_node=8),
    # The NIC functions the simulated machine has beside this host's own NIC (the uplink, which the
    # `nic` class leaves out): its SR-IOV VFs, for VMs.
    Kind("nic", "nic-passthrough", "vfio", native="nic", per_node=4),
    Kind("cpu", "cpu", "cpu", per_node=1),
)


@dataclass
class Round:
    pods: int
    bound: int
    seconds: float
    cpu_s: float
    latencies_ms: list[float]
    attempts: dict[str, float] = field(default_factory=dict)  # scheduling attempts by result, over the round

    @property
    def pods_per_s(self) -> float | None:
        return self.bound / self.seconds if self.bound == self.pods and self.seconds > 0 else None

    @property
    def cpu_ms_per_pod(self) -> float | None:
        return self.cpu_s * 1000 / self.pods if self.bound == self.pods else None

    def pct(self, q: int) -> float | None:
        if self.bound != self.pods or not self.latencies_ms:
            return None
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


@dataclass
class Options:
    nodes: int = 100
    pods: int = 20
    gates: tuple[str, ...] = ("default", "alpha")
    profile: tuple[str, ...] = ()  # kinds whose extra round on the richest inventory is profiled (CPU)
    what_if: bool = False  # also the WHAT_IF inventories (not the agent's: a change measured before it is made)
    out: Path = ROOT / ".bench"


def default_gates(apiserver: Path, names: Sequence[str]) -> dict[str, bool]:
    """Each gate at the default the binary states (`kube:Name=true|false (STAGE - default=X)`); a gate
    it does not list (GA and locked) stays on, as the cluster tests set it."""
    text = subprocess.run([str(apiserver), "--help"], capture_output=True, text=True, check=False).stdout
    found: dict[str, bool] = {}
    for m in re.finditer(r"kube:(\w+)=true\|false \(\w+ - default=(true|false)\)", text):
        found.setdefault(m[1], m[2] == "true")  # the first: the default at the binary's own version
    return {g: found.get(g, True) for g in names}


def render(inventory: Inventory, nodes: Mapping[str, str], work: Path) -> dict[str, list[dict[str, Any]]]:
    """Each Node's slices (name -> uid given), as the agent renders them for that Node."""
    settings = build_settings({"nvml": NVML, "node_name": next(iter(nodes)), "driver_name": DRIVER,
                               "state_dir": work / f"agent-{inventory.name}", "offline": work / "offline",
                               **inventory.settings})
    with _quiet_logs():
        devices, _ = asyncio.run(oneshot.discover_once(settings))
    out: dict[str, list[dict[str, Any]]] = {}
    for name, uid in nodes.items():
        node = NodeInfo(name=name, uid=uid)
        out[name] = slices.build_slices(devices, driver=DRIVER, node=name, owner=slices.NodeRef(name=name, uid=uid),
                                        compatibility_groups=settings.compatibility_groups,
                                        layout=dropped.layout(settings, node))
        if inventory.plain:
            out[name] = [plain(out[name])]
        elif inventory.lean:
            out[name] = [lean(s) for s in out[name]]
        elif inventory.by_gpu:
            out[name] = by_gpu(out[name], name)
    return out


def plain(rendered: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The GPUs of the agent's slices as a driver without partitions would publish them: whole devices,
    no counters, in one slice."""
    gpus = [{k: v for k, v in d.items() if k != "consumesCounters"} for s in rendered for d in s["spec"].get("devices")
            or [] if (d.get("attributes") or {}).get("type", {}).get("string") == "gpu"]
    first = rendered[0]
    spec = {k: v for k, v in first["spec"].items() if k not in ("devices", "sharedCounters")}
    spec["pool"] = {**spec["pool"], "resourceSliceCount": 1}
    spec["devices"] = gpus
    return {**first, "spec": spec}


def lean(rendered: Mapping[str, Any]) -> dict[str, Any]:
    """The slice with its MIG placements' attributes and capacity cut to LEAN_ATTRIBUTES and LEAN_CAPACITY."""
    def cut(d: Mapping[str, Any]) -> dict[str, Any]:
        if (d.get("attributes") or {}).get("type", {}).get("string") != "mig":
            return dict(d)
        return {**d, "attributes": {k: v for k, v in d["attributes"].items() if k in LEAN_ATTRIBUTES},
                "capacity": {k: v for k, v in (d.get("capacity") or {}).items() if k in LEAN_CAPACITY}}

    devices = rendered["spec"].get("devices")
    if not devices:
        return dict(rendered)
    return {**rendered, "spec": {**rendered["spec"], "devices": [cut(d) for d in devices]}}


def by_gpu(rendered: Sequence[Mapping[str, Any]], node: str) -> list[dict[str, Any]]:
    """The by_gpu what-if: the counter slices as they are, then the devices of no GPU (in the agent's order),
    then each GPU's forms (by bus ID; whole, passthrough, shared, placements), cut into slices of at most 64,
    named `<driver>-<node>-<NN>-w` so that the allocator's order by name is this one."""
    def key(item: tuple[int, Mapping[str, Any]]) -> tuple[int, str, int, int]:
        i, d = item
        attrs = d.get("attributes") or {}
        kind = attrs.get("type", {}).get("string", "")
        gpu = kind in GPU_FORMS and (kind != "vfio" or attrs.get("nativeType", {}).get("string") == "gpu")
        if not gpu:
            return 0, "", 0, i
        bus = attrs.get("resource.kubernetes.io/pciBusID", {}).get("string", "")
        return 1, bus, GPU_FORMS[kind], i

    counters = [s for s in rendered if not s["spec"].get("devices")]
    devices = [d for _, d in sorted(enumerate(d for s in rendered for d in s["spec"].get("devices") or []), key=key)]
    first = next(s for s in rendered if s["spec"].get("devices"))
    chunks = [devices[i:i + 64] for i in range(0, len(devices), 64)]
    out = [{**c, "metadata": named(c, f"{DRIVER}-{node}-{i:02d}-w")} for i, c in enumerate(counters)]
    for j, chunk in enumerate(chunks):
        spec = {**first["spec"], "devices": chunk}
        out.append({**first, "metadata": named(first, f"{DRIVER}-{node}-{len(counters) + j:02d}-w"), "spec": spec})
    count = len(out)
    return [{**s, "spec": {**s["spec"], "pool": {**s["spec"]["pool"], "resourceSliceCount": count}}} for s in out]


def named(rendered: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A slice's metadata (its owner kept) with a name of its own instead of the agent's generated one."""
    meta = {k: v for k, v in rendered["metadata"].items() if k != "generateName"}
    return {**meta, "name": name}


class Bench:
    """One control plane (one set of gates), its Nodes, and the rounds run on it."""

    def __init__(self, work: Path, nodes: int, gates: Mapping[str, bool], progress: Callable[[str], None]) -> None:
        build, self.kit, plane_mod, pki = fleet._cluster_kit()
        components = build.ensure(build_missing=False)
        self.work, self.progress = work, progress
        self.plane = plane_mod.ControlPlane(Path(components.bin), work / "plane", pki.Pki(work / "pki"),
                                            gates=dict(gates))
        # The plane's own arguments for each component, plus ours: the client rates, and the profile's
        # path open on the scheduler's port. Set on this instance only, before anything starts.
        original = self.plane._component

        def component(name: str, args: Sequence[str]) -> Any:
            extra: tuple[str, ...] = ()
            if name == "kube-scheduler":
                extra = (*CLIENT_RATE, f"--authorization-always-allow-paths=/healthz,/readyz,/livez,{PPROF},{METRICS}")
            elif name == "kube-controller-manager":
                extra = CLIENT_RATE
            return original(name, [*args, *extra])

        self.plane._component = component
        try:
            self.plane.start()
            self.plane.wait_components()
        except BaseException:
            self.plane.stop()
            raise
        self.cluster = self.kit.Cluster(self.plane, work)
        self.scheduler = next(c for c in self.plane.components if c.name == "kube-scheduler")
        self.nodes: dict[str, str] = {}
        self.rounds = 0
        self._local = threading.local()
        self._clients: list[Any] = []  # every thread's client, closed with the plane
        # The creators, for the bench's life: their clients (and connections) are made once.
        self.pool = ThreadPoolExecutor(CREATORS)

    @property
    def admin(self) -> Any:
        return self.cluster.admin

    def rest(self) -> Any:
        """A client of this thread's own (the creators' requests go out in parallel)."""
        if not hasattr(self._local, "rest"):
            assert self.plane.admin is not None
            self._local.rest = self.kit.Rest(self.plane.server, self.plane.pki.ca,
                                             cert=(self.plane.admin.cert, self.plane.admin.key))
            self._clients.append(self._local.rest)
        return self._local.rest

    def prepare(self, count: int) -> None:
        self.cluster.apply_deploy()
        for i in range(count):
            name = f"sched-{i:04d}"
            self.nodes[name] = self.cluster.add_node(name)["metadata"]["uid"]

    def cpu(self) -> float:
        assert self.scheduler.proc is not None
        return float(fleet.cpu_seconds(self.scheduler.proc.pid))

    def attempts(self) -> dict[str, float]:
        """`scheduler_schedule_attempts_total` by result (scheduled, unschedulable, error): a pod tried
        again costs its filters again."""
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        url = self.plane.scheduler_health.replace("/healthz", METRICS)
        with urllib.request.urlopen(url, timeout=30, context=insecure) as answer:
            text = answer.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "scheduler_schedule_attempts_total":
                    result = sample.labels.get("result", "")
                    out[result] = out.get(result, 0.0) + sample.value
        return out

    def quiet(self, limit: float = 15.0) -> None:
        """Until the scheduler has done with what came before (slices, deletions): under 2% of a core
        over half a second, so that a round is not billed for it."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            before = self.cpu()
            time.sleep(0.5)
            if self.cpu() - before < 0.01:
                return

    def publish(self, inventory: Inventory) -> int:
        """The inventory's slices for every Node, in place of the last one's; the devices per Node."""
        # Node by Node: one collection of thousands of slices takes the API server longer than a client's
        # timeout.
        list(self.pool.map(lambda node: self.rest().request(
            "DELETE", SLICES, params={"fieldSelector": f"spec.driver={DRIVER},spec.nodeName={node}"}), self.nodes))
        self.kit.eventually(lambda: not self.admin.get(SLICES, limit="1")["items"], "the old slices deleted", 120)
        rendered = render(inventory, self.nodes, self.work)
        list(self.pool.map(lambda s: self.rest().post(SLICES, s), [s for v in rendered.values() for s in v]))
        self.quiet()
        first = next(iter(rendered.values()))
        self.devices = [d for s in first for d in s["spec"].get("devices") or []]
        return len(self.devices)

    def has(self, kind: Kind) -> bool:
        return any(kind.matches(d) for d in self.devices)

    def round(self, kind: Kind, pods: int, profile: Path | None = None) -> Round:
        self.rounds += 1
        ns = f"r{self.rounds:03d}-{kind.name}"
        self.admin.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        self.admin.post(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": kind.name, "namespace": ns},
            "spec": {"spec": {"devices": {"requests": [kind.request()]}}}})
        limit = ROUND_LIMIT + pods
        rv = self.admin.get(f"/api/v1/namespaces/{ns}/pods")["metadata"]["resourceVersion"]
        watch = BoundWatch(self.rest, ns, rv, pods, limit)
        watch.start()
        created: dict[str, float] = {}
        profiler = Profiler(self, profile, PROFILE_SECONDS) if profile else None
        self.quiet()
        attempts_before = self.attempts()
        cpu_before = self.cpu()
        started = time.monotonic()

        def create(i: int) -> None:
            name = f"p-{i:04d}"
            self.rest().post(f"/api/v1/namespaces/{ns}/pods", pod(ns, name, kind))
            created[name] = time.monotonic()

        list(self.pool.map(create, range(pods)))
        watch.done.wait(limit)
        last = max(watch.bound.values(), default=time.monotonic())
        cpu = self.cpu() - cpu_before
        attempts = {k: v - attempts_before.get(k, 0.0) for k, v in self.attempts().items()}
        if profiler is not None:
            profiler.finish()
        latencies = [max(0.0, (watch.bound[n] - created[n]) * 1000) for n in watch.bound if n in created]
        self.clean(ns)
        return Round(pods, len(watch.bound), last - started, cpu, latencies, attempts)

    def clean(self, ns: str) -> None:
        """The round's pods deleted at once (no kubelet confirms a graceful deletion), then their claims
        waited for: deallocated by the resourceclaim controller and deleted by the garbage collector. A
        claim still there after GONE_LIMIT has its finalizer taken off and is deleted by the bench."""
        self.admin.request("DELETE", f"/api/v1/namespaces/{ns}/pods",
                           {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        claims = f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
        deadline = time.monotonic() + GONE_LIMIT
        while self.admin.get(claims)["items"]:
            if time.monotonic() > deadline:
                self.progress(f"sched: {ns}: claims not gone within {GONE_LIMIT:g} s, removed by the bench")
                for c in self.admin.get(claims)["items"]:
                    with contextlib.suppress(Exception):
                        self.admin.merge_patch(f"{claims}/{c['metadata']['name']}", {"metadata": {"finalizers": None}})
                        self.admin.delete(f"{claims}/{c['metadata']['name']}")
                deadline = time.monotonic() + GONE_LIMIT
            time.sleep(0.2)
        self.admin.delete(f"/api/v1/namespaces/{ns}")

    def close(self) -> None:
        self.pool.shutdown()
        for client in self._clients:
            client.close()
        self.cluster.close()
        self.plane.stop()


def pod(ns: str, name: str, kind: Kind) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"resourceClaims": [{"name": "d", "resourceClaimTemplateName": kind.name}],
                     "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"claims": [{"name": "d"}]}}],
                     "terminationGracePeriodSeconds": 0}}


class BoundWatch(threading.Thread):
    """A watch of the round's pods: when each was first seen with a node (the bench's clock)."""

    def __init__(self, rest: Callable[[], Any], ns: str, rv: str, expected: int, limit: float) -> None:
        super().__init__(daemon=True)
        self.rest, self.ns, self.rv, self.expected, self.limit = rest, ns, rv, expected, limit
        self.bound: dict[str, float] = {}
        self.done = threading.Event()
        self.ready = threading.Event()

    def start(self) -> None:
        super().start()
        self.ready.wait(10)

    def run(self) -> None:
        params = {"watch": "true", "resourceVersion": self.rv, "timeoutSeconds": str(int(self.limit) + 5)}
        try:
            with self.rest().client.stream("GET", f"/api/v1/namespaces/{self.ns}/pods", params=params,
                                           timeout=self.limit + 30) as answer:
                self.ready.set()
                for line in answer.iter_lines():
                    if not line:
                        continue
                    obj = orjson.loads(line).get("object") or {}
                    name = (obj.get("metadata") or {}).get("name")
                    if name and (obj.get("spec") or {}).get("nodeName") and name not in self.bound:
                        self.bound[name] = time.monotonic()
                        if len(self.bound) >= self.expected:
                            return
        finally:
            self.ready.set()
            self.done.set()


class Profiler:
    """The scheduler's CPU profile (pprof) over a round, fetched while the round runs."""

    def __init__(self, bench: Bench, path: Path, seconds: int) -> None:
        self.path, self.seconds = path, seconds
        url = bench.plane.scheduler_health.replace("/healthz", f"{PPROF}?seconds={seconds}")
        self.data = b""
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE

        def fetch() -> None:
            with urllib.request.urlopen(url, timeout=seconds + 30, context=insecure) as r:
                self.data = r.read()

        self.thread = threading.Thread(target=fetch, daemon=True)
        self.thread.start()

    def finish(self) -> None:
        self.thread.join(self.seconds + 30)
        self.path.write_bytes(self.data)


# Where the scheduler's CPU goes, by the functions of its DRA plugin and allocator (k8s.io/kubernetes
# pkg/scheduler/framework/plugins/dynamicresources, k8s.io/dynamic-resource-allocation/structured):
# key -> the function whose cumulative share of the profile's samples it reports.
PROFILE_PARTS = {
    "dra_filter": "dynamicresources.(*DynamicResources).Filter",
    "class_selectors": "(*allocator).selectorsMatch",  # CEL selectors evaluated on devices, matching or not
    "gather_pools": "GatherPools",  # each node's slices converted and its pools built, for every pod
    "counters": "validateDeviceCounterConsumption",
    "gc": "runtime.gcBgMarkWorker",
}


def top(profile: Path, limit: int = 60) -> tuple[str, dict[str, float]]:
    """`go tool pprof -top -cum` of a profile (where the time goes, callers included), and the
    percentage of samples under each of PROFILE_PARTS; nothing without Go."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["go", "tool", "pprof", "-top", "-cum", f"-nodecount={limit}", str(profile)],
                              capture_output=True, text=True, timeout=120, check=True)
        parts: dict[str, float] = {}
        for line in done.stdout.splitlines():
            fields = line.split()
            if len(fields) < 6 or not fields[4].endswith("%"):
                continue
            for key, function in PROFILE_PARTS.items():
                if fields[5].endswith(function) and key not in parts:
                    parts[key] = float(fields[4].rstrip("%"))
        return done.stdout, parts
    return "", {}


def put(r: dict[str, Any], prefix: str, inventory: str, kind: str, result: Round) -> None:
    key = f"{prefix}{inventory}_{kind}"
    r[f"{key}_pods_per_s"] = result.pods_per_s
    r[f"{key}_cpu_ms_per_pod"] = result.cpu_ms_per_pod
    r[f"{key}_p99_ms"] = result.pct(99)
    r[f"{key}_p50_ms"] = result.pct(50)
    r[f"{key}_attempts_per_pod"] = sum(result.attempts.values()) / result.pods
    if result.bound != result.pods:
        r[f"{key}_unbound"] = result.pods - result.bound


def ratios(r: dict[str, Any], prefix: str) -> None:
    """`<prefix>cpu_ratio_<inventory>_<kind>`: scheduler CPU per pod over the plain inventory's whole GPU
    (the plain inventory has no MIG, share, NIC or CPU devices: its whole GPU is every kind's baseline);
    `<prefix>cpu_ratio_<kind>` is the richest inventory's; `<prefix>cpu_kind_spread`, the costliest
    kind over the cheapest on it."""
    base = r.get(f"{prefix}plain_gpu_cpu_ms_per_pod")
    richest: list[float] = []
    for inventory in (*INVENTORIES[1:], *WHAT_IF):
        for kind in KINDS:
            cpu = r.get(f"{prefix}{inventory.name}_{kind.name}_cpu_ms_per_pod")
            if f"{prefix}{inventory.name}_{kind.name}_pods_per_s" not in r:
                continue
            value = cpu / base if cpu is not None and base else None
            r[f"{prefix}cpu_ratio_{inventory.name}_{kind.name}"] = value
            if inventory.name == RICHEST:
                r[f"{prefix}cpu_ratio_{kind.name}"] = value
                if cpu is not None:
                    richest.append(cpu)
    if richest:
        r[f"{prefix}cpu_kind_spread"] = max(richest) / min(richest)


def profile(bench: Bench, kind: Kind, opts: Options, r: dict[str, Any], progress: Callable[[str], None]) -> None:
    """An extra round of `kind`, its pods enough to keep the scheduler busy through the profile's window at
    the rate just measured, with the scheduler's CPU profile over that window: the file, and its top
    functions (cumulative) in `sched_profile_top_<kind>`."""
    rate = r.get(f"sched_{RICHEST}_{kind.name}_pods_per_s") or 1.0
    count = max(opts.pods, int(rate * PROFILE_SECONDS * 1.5))
    count = min(count, kind.per_node * opts.nodes) if kind.per_node else count
    opts.out.mkdir(parents=True, exist_ok=True)
    path = opts.out / f"sched-profile-{kind.name}.pb.gz"
    progress(f"sched: the scheduler's CPU profile over {count} {kind.name} pods ({PROFILE_SECONDS} s), {path}")
    bench.round(kind, count, profile=path)
    text, parts = top(path)
    path.with_suffix("").with_suffix(".txt").write_text(text)
    for key, pct in parts.items():
        r[f"sched_profile_{kind.name}_{key}_pct"] = pct


def run(opts: Options, progress: Callable[[str], None] = print) -> dict[str, Any]:
    r: dict[str, Any] = {"sched_nodes": opts.nodes, "sched_pods_per_round": opts.pods,
                         "sched_gates": ",".join(opts.gates)}
    for gates in opts.gates:
        prefix = "sched_" if gates == "default" else f"sched_{gates}_"
        with tempfile.TemporaryDirectory(prefix="drasched-", dir="/tmp") as tmp:
            build, _, plane_mod, _ = fleet._cluster_kit()
            apiserver = Path(build.ensure(build_missing=False).bin) / "kube-apiserver"
            names = (*plane_mod.DRA_GATES, *plane_mod.DEPENDENCY_GATES)
            chosen = default_gates(apiserver, names) if gates == "default" else {}
            progress(f"sched ({gates} gates): control plane, {opts.nodes} Nodes, deploy/")
            bench = Bench(Path(tmp), opts.nodes, chosen, progress)
            try:
                bench.prepare(opts.nodes)
                for inventory in (*INVENTORIES, *(WHAT_IF if opts.what_if else ())):
                    devices = bench.publish(inventory)
                    r[f"sched_devices_per_node_{inventory.name}"] = devices
                    r[f"sched_slices_per_node_{inventory.name}"] = len(
                        bench.admin.get(SLICES, fieldSelector=f"spec.nodeName={next(iter(bench.nodes))}")["items"])
                    for kind in KINDS:
                        if (inventory.plain and kind.name != "gpu") or not bench.has(kind):
                            continue
                        count = min(opts.pods, kind.per_node * opts.nodes) if kind.per_node else opts.pods
                        progress(f"sched ({gates} gates): {inventory.name} inventory ({devices} devices a node), "
                                 f"{count} {kind.name} pods")
                        put(r, prefix, inventory.name, kind.name, bench.round(kind, count))
                    if gates == "default" and inventory.name == RICHEST:
                        for kind in (k for k in KINDS if k.name in opts.profile):
                            profile(bench, kind, opts, r, progress)
            finally:
                bench.close()
        ratios(r, prefix)
    return r


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """The agent's discovery warns about this host (no IOMMU groups): not the bench's business."""
    import logging

    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.getLogger().setLevel(level)


def gate_sets(text: str) -> tuple[str, ...]:
    sets = tuple(s for s in text.split(",") if s)
    if not sets or any(s not in ("default", "alpha") for s in sets):
        raise argparse.ArgumentTypeError("a comma-separated list of default and alpha")
    return sets


def kinds(text: str) -> tuple[str, ...]:
    names = tuple(s for s in text.split(",") if s)
    known = {k.name for k in KINDS}
    if any(n not in known for n in names):
        raise argparse.ArgumentTypeError(f"kinds among {', '.join(sorted(known))}")
    return names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--pods", type=int, default=20, help="pods per round, a round per kind and inventory")
    p.add_argument("--gates", type=gate_sets, default=("default", "alpha"))
    p.add_argument("--profile", type=kinds, default=(),
                   help="kinds (comma-separated) whose extra round on the richest inventory is profiled")
    p.add_argument("--what-if", action="store_true", help="also the what-if inventories (WHAT_IF)")
    args = p.parse_args()
    r = run(Options(args.nodes, args.pods, args.gates, args.profile, what_if=args.what_if),
            progress=lambda m: print(m, file=sys.stderr, flush=True))
    sys.stdout.buffer.write(orjson.dumps(r, option=orjson.OPT_INDENT_2) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())


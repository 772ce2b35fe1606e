"""Prometheus metrics.

Each `Agent` has its own `Metrics` and registry (tests run several agents in one
process). Events are counted where they happen (`engine/prepare.py`, `publish/loop.py`,
`app/daemon.py`, the inventory's scans); what is a state rather than an event
(prepared claims, devices by health, registration, what is published) is read
from the running agent when scraped, through `Metrics.state`. The HTTP server that
serves them with the probes is `agent.app.httpserver`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from agent import __version__

log = logging.getLogger(__name__)

# No `*_created` series beside every counter and histogram: they double the output and nothing reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

PREFIX = "dra_agent_"
# Prepare is milliseconds on a healthy node; the kubelet gives up after 45 s.
CLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 45.0)
SCAN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PUBLISH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

OPERATIONS = ("prepare", "unprepare")
RESULTS = ("success", "error", "cancelled")
SLICE_ACTIONS = ("create", "update", "delete")
RECOVERY_ACTIONS = ("repaired", "removed", "quarantined")
HEALTH_STATES = ("HEALTHY", "UNHEALTHY", "UNKNOWN")
STATUS_WRITE_RESULTS = ("ok", "unchanged", "retry", "gave_up")


@dataclass
class AgentState:
    """What the running agent is, read at each scrape (see `Agent.metrics_state`)."""

    devices: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (kind, health) -> devices
    failing_sources: Sequence[str] = ()  # kinds whose latest scans failed
    prepared_claims: int = 0
    prepared_devices: int = 0  # the devices of those claims, one per allocation result
    registered: bool | None = None  # what the kubelet last said (None: nothing yet)
    health_watchers: int = 0
    published_devices: int = 0
    published_slices: int = 0
    dropped_values: int = 0
    publish_up_to_date: bool = False
    publish_failures: int = 0  # in a row
    taints: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (cause kind, effect) -> devices
    nvml_up: bool | None = None  # whether NVML answers the GPU probe (None: no NVML on this node)


# gRPC status codes as Go spells them (codes.Code.String()), the values of `grpc_code` wherever it is scraped.
GRPC_OK, GRPC_CANCELED, GRPC_UNKNOWN = "OK", "Canceled", "Unknown"


class ClaimOperation:
    """One prepare or unprepare of one claim, while it runs (`Metrics.claim_operation`)."""

    __slots__ = ("failed",)

    def __init__(self) -> None:
        self.failed = False


# Gauges read from the running agent at each scrape: (name, help, value).
_STATE_GAUGES: tuple[tuple[str, str, Callable[[AgentState], float]], ...] = (
    ("prepared_claims", "Claims prepared on this node (records in the state directory)",
     lambda s: s.prepared_claims),
    ("prepared_devices", "Devices of the claims prepared on this node, one per allocation result (a device two "
     "claims share counts twice)", lambda s: s.prepared_devices),
    ("kubelet_registered", "1 when the kubelet reported the plugin registered, 0 otherwise",
     lambda s: 1 if s.registered else 0),
    ("health_watchers", "Device health streams open (the kubelet holds one)", lambda s: s.health_watchers),
    ("published_devices", "Devices in the ResourceSlices last published (0 before the first publish)",
     lambda s: s.published_devices),
    ("published_slices", "ResourceSlices in the pool last published", lambda s: s.published_slices),
    ("publish_dropped_values", "Attribute and capacity values left out of the last publish because the API "
     "server would reject them (each is logged with its device)", lambda s: s.dropped_values),
    ("publish_up_to_date", "1 when the latest inventory is published", lambda s: 1 if s.publish_up_to_date else 0),
    ("publish_consecutive_failures", "Publish attempts that failed since the last success",
     lambda s: s.publish_failures),
)


class _StateCollector(Collector):
    def __init__(self, state: Callable[[], AgentState | None]) -> None:
        self._state = state

    def describe(self) -> Iterable[Metric]:
        return _state_families(None)

    def collect(self) -> Iterable[Metric]:
        return _state_families(self._state())


def _state_families(s: AgentState | None) -> list[Metric]:
    """The scrape-time families; without a state (before the agent started), without samples."""
    devices = GaugeMetricFamily(PREFIX + "devices", "Devices this node publishes or knows of, by kind and "
                                "health (as on the kubelet's health stream)", labels=["kind", "health"])
    failing = GaugeMetricFamily(PREFIX + "discovery_source_failing", "1 while a discovery source's scans "
                                "fail (its last good devices stay published)", labels=["kind"])
    taints = GaugeMetricFamily(PREFIX + "device_taints", "Device taints the agent publishes now, by cause "
                               "(xid, gpu-lost, link-down, undo-failed, nvml-lost) and effect (None, NoSchedule, "
                               "NoExecute)", labels=["cause", "effect"])
    nvml = GaugeMetricFamily(PREFIX + "nvml_up", "1 while NVML answers the agent's GPU probe, 0 while it is lost "
                             "(the NVIDIA driver unloaded: the GPUs are tainted nvml-lost); no sample on a node "
                             "without NVML")
    out: list[Metric] = [devices, failing, taints, nvml]
    if s is not None:
        if s.nvml_up is not None:
            nvml.add_metric([], 1 if s.nvml_up else 0)
        for (cause, effect), n in sorted(s.taints.items()):
            taints.add_metric([cause, effect], n)
        for kind in sorted({kind for kind, _ in s.devices}):
            for health in HEALTH_STATES:
                devices.add_metric([kind, health], s.devices.get((kind, health), 0))
        for kind in sorted(set(s.failing_sources)):
            failing.add_metric([kind], 1)
    for name, doc, value in _STATE_GAUGES:
        family = GaugeMetricFamily(PREFIX + name, doc)
        if s is not None:
            family.add_metric([], value(s))
        out.append(family)
    return out


class Metrics:
    """The agent's metric objects, on a registry of its own."""

    def __init__(self, *, process: bool = True) -> None:
        r = self.registry = CollectorRegistry()
        self.state: Callable[[], AgentState | None] = lambda: None
        if process:  # process_* (memory, CPU, open files) and python_info, as the default registry has
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
        info = Gauge(PREFIX + "build_info", "The agent's version (always 1)", ["version", "python"], registry=r)
        info.labels(__version__, platform.python_version()).set(1)
        self.claim_operations = Counter(
            PREFIX + "claim_operations", "Prepare and unprepare operations on single claims (a kubelet call "
            "may carry several), by result: success, error (the claim's error went back to the kubelet) or "
            "cancelled (the kubelet gave up waiting; the operation still finishes)",
            ["operation", "result"], registry=r)
        self.claim_duration = Histogram(
            PREFIX + "claim_operation_duration_seconds", "Time to prepare or unprepare one claim",
            ["operation"], buckets=CLAIM_BUCKETS, registry=r)
        self.claims_in_flight = Gauge(
            PREFIX + "claim_operations_in_flight", "Prepares and unprepares of claims running now",
            ["operation"], registry=r)
        # Each operation's children, looked up once: `labels()` takes a lock and builds a key per call.
        self._op_children = {op: (self.claims_in_flight.labels(op), self.claim_duration.labels(op),
                                  {result: self.claim_operations.labels(op, result) for result in RESULTS})
                             for op in OPERATIONS}
        self.publish_syncs = Counter(
            PREFIX + "publish_syncs", "Attempts to bring the published ResourceSlices up to date, by result "
            "(success, failure)", ["result"], registry=r)
        self.publish_duration = Histogram(
            PREFIX + "publish_duration_seconds", "Time of one publish attempt (list, writes, deletes)",
            buckets=PUBLISH_BUCKETS, registry=r)
        self.slice_writes = Counter(
            PREFIX + "slice_writes", "ResourceSlices created, updated and deleted", ["action"], registry=r)
        self.last_publish = Gauge(
            PREFIX + "publish_last_success_timestamp_seconds", "When the slices were last found or made up "
            "to date (unix time)", registry=r)
        self.device_plugin_held = Gauge(
            PREFIX + "device_plugin_held_gpus", "GPUs published with the device-plugin taint now: a device plugin "
            "serves them here, or a pod it gave one to still runs (docs/migration.md)", registry=r)
        for result in ("success", "failure"):
            self.publish_syncs.labels(result)
        for action in SLICE_ACTIONS:
            self.slice_writes.labels(action)
        self.scans = Counter(
            PREFIX + "discovery_scans", "Discovery scans by kind of device (gpu: NVML) and result (success, "
            "failure)", ["kind", "result"], registry=r)
        self.scan_duration = Histogram(
            PREFIX + "discovery_scan_duration_seconds", "Time of one discovery scan of one kind of device",
            ["kind"], buckets=SCAN_BUCKETS, registry=r)
        self.netlink_events = Counter(
            PREFIX + "netlink_events", "Netlink link and address events received (before debouncing), by kind",
            ["kind"], registry=r)
        self.recovery = Counter(
            PREFIX + "recovery_actions", "Start-up recovery: files repaired from their records, orphaned files "
            "removed, unreadable records set aside", ["action"], registry=r)
        for action in RECOVERY_ACTIONS:
            self.recovery.labels(action)
        self.records_quarantined = Counter(
            PREFIX + "records_quarantined", "Claim records set aside as <uid>.rec.corrupt, unreadable or saying "
            "what the agent never writes (the claim's "
            "files removed, the claim no longer prepared), at start-up or while running; each is also a Warning "
            "Event ClaimRecordQuarantined on the Node and a line of /readyz", registry=r)
        self.claims_garbage_collected = Counter(
            PREFIX + "claims_garbage_collected", "Prepared claims unprepared by garbage collection because "
            "their ResourceClaim was gone (deleted, or re-created with another UID) for longer than "
            "--gc-grace-period", registry=r)
        self.api_requests = Counter(
            PREFIX + "api_requests", "Requests this agent sent to the Kubernetes API server (each retry and each "
            "watch request too), by verb and resource as the API server's apiserver_request_total names them "
            "(LIST, WATCH, GET, CREATE, UPDATE, PATCH, DELETE; a subresource as resource/sub)",
            ["verb", "resource"], registry=r)
        self.gc_sweeps = Counter(
            PREFIX + "gc_sweeps", "Passes of garbage collection over the prepared claims (in a cluster each asks the "
            "kubelet's pod resources service which claims the pods on the node use, and reads only a claim no pod "
            "has used for --gc-grace-period; offline each looks every claim up)", registry=r)
        self.gc_skipped = Counter(
            PREFIX + "gc_skipped", "Passes of garbage collection that collected nothing because the kubelet's pod "
            "resources service did not say which claims the pods on the node use (its socket absent, the kubelet "
            "not answering)", registry=r)
        self.claim_status_writes = Counter(
            PREFIX + "claim_status_writes", "Writes of this driver's ResourceClaim status.devices entries (server-side "
            "apply, or the offline file), by result: ok, unchanged (not sent: after a restart, the stored entries "
            "were what it would send), retry (failed, tried again after a backoff) or gave_up (the claim is gone "
            "or was re-created, or the API server refused the write)", ["result"], registry=r)
        for result in STATUS_WRITE_RESULTS:
            self.claim_status_writes.labels(result)
        self.claim_status_queue = Gauge(
            PREFIX + "claim_status_queue", "Claims whose status.devices write is waiting or in flight (coalesced: "
            "one per claim)", registry=r)
        # The DRA socket's calls, named as go-grpc-prometheus's server metrics are, which Go DRA drivers expose
        # through the kubelet plugin helper's gRPC interceptors: dashboards and alerts made for those read these.
        grpc_labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.grpc_started = Counter(
            "grpc_server_started_total", "gRPC calls started on the DRA socket (NodePrepareResources, "
            "NodeUnprepareResources, NodeWatchResources)", grpc_labels, registry=r)
        self.grpc_handled = Counter(
            "grpc_server_handled_total", "gRPC calls finished on the DRA socket, by status code (a claim's error is "
            "in its answer, which is OK; Canceled: the kubelet gave up waiting or closed its stream)",
            [*grpc_labels, "grpc_code"], registry=r)
        self.grpc_handling = Histogram(
            "grpc_server_handling_seconds", "Time from the start of a gRPC call on the DRA socket to its answer (a "
            "stream: to its end)", grpc_labels, buckets=CLAIM_BUCKETS, registry=r)
        r.register(_StateCollector(lambda: self.state()))

    # -- events -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def claim_operation(self, operation: str) -> Iterator[ClaimOperation]:
        """Count and time one prepare or unprepare; set `.failed` on what it yields."""
        op = ClaimOperation()
        in_flight, duration, results = self._op_children[operation]
        in_flight.inc()
        started = time.monotonic()
        result = "error"
        try:
            yield op
            result = "error" if op.failed else "success"
        except asyncio.CancelledError:
            result = "cancelled"
            raise
        finally:
            in_flight.dec()
            duration.observe(time.monotonic() - started)
            results[result].inc()

    @contextlib.contextmanager
    def grpc_call(self, grpc_type: str, service: str, method: str) -> Iterator[None]:
        """Count and time one call of the DRA socket (`grpc_type`: unary, server_stream); an exception out of
        it is Unknown, a cancellation Canceled."""
        labels = (grpc_type, service, method)
        self.grpc_started.labels(*labels).inc()
        started = time.monotonic()
        code = GRPC_UNKNOWN
        try:
            yield
            code = GRPC_OK
        except (asyncio.CancelledError, GeneratorExit):  # a stream's generator is closed when its call ends
            code = GRPC_CANCELED
            raise
        finally:
            self.grpc_handling.labels(*labels).observe(time.monotonic() - started)
            self.grpc_handled.labels(*labels, code).inc()

    def scanned(self, kind: str, ok: bool, seconds: float) -> None:
        """A discovery scan finished (called from the scan's worker thread)."""
        self.scans.labels(kind, "success" if ok else "failure").inc()
        self.scan_duration.labels(kind).observe(seconds)

    def published(self, seconds: float, created: int = 0, updated: int = 0, deleted: int = 0,
                  *, ok: bool = True) -> None:
        self.publish_duration.observe(seconds)
        self.publish_syncs.labels("success" if ok else "failure").inc()
        if ok:
            self.last_publish.set(time.time())
        for action, n in zip(SLICE_ACTIONS, (created, updated, deleted), strict=True):
            if n:
                self.slice_writes.labels(action).inc(n)

    def recovered(self, repaired: int, removed: int, quarantined: int) -> None:
        for action, n in zip(RECOVERY_ACTIONS, (repaired, removed, quarantined), strict=True):
            if n:
                self.recovery.labels(action).inc(n)

    # -- exposition ---------------------------------------------------------------------------------

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The registry in the format the scraper asked for, and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

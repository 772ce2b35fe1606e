"""The running agent: discovery, publishing, the kubelet's sockets, and keeping it all current.

Start-up order: roots checked -> metrics and probes server -> connect -> open discovery -> first
scan and the listing of claim records (concurrently) -> DRA socket -> registration socket -> background
work (each record's check, then orphan removal and the claims' status and metadata; publishing,
rescans, netlink events, health, preparing ahead of binding). SIGTERM stops the servers and removes the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.app.assembly import (
    PublishedForm,
    build_sources,
    prepare_roots,
    set_node_features,
    start_sim_kernel,
    vf_links,
)
from agent.config import Settings
from agent.kubelet.server import Servers

# This module is imported light: discovery, the engine, the API client and their dependencies are
# imported where first used (`agent.app.process` imports them in a worker thread meanwhile).
if TYPE_CHECKING:
    from agent.app.connection import Connection
    from agent.app.httpserver import Check
    from agent.app.probes import DevicesView, PublishView, SocketsView
    from agent.app.quarantine import QuarantineReporter
    from agent.engine.gc import ClaimCollector
    from agent.engine.prepare import PrepareEngine
    from agent.engine.recovery import RecoveryReport
    from agent.engine.selfheal import SelfHealer
    from agent.health.claimstatus import ClaimStatusWriter
    from agent.health.pluginholds import PluginHolds
    from agent.inventory.netwatch import NetEvent
    from agent.kube.podresources import PodResourcesClient
    from agent.metrics import AgentState
    from agent.model import Device
    from agent.publish.loop import PublishLoop
    from agent.sim.kernel.emulator import KernelEmulator

log = logging.getLogger(__name__)

RECOVERY_BATCH = 64  # records checked per worker-thread call in the background start-up check


@dataclass(eq=False)
class Running:
    """The parts that start with the agent's connection (to the cluster, or its offline directory),
    made by `Agent.start` once every one of them has started."""

    conn: Connection
    engine: PrepareEngine
    claim_status: ClaimStatusWriter
    kernel: KernelEmulator | None  # the simulated machine's kernel (--nvml sim)
    selfheal: SelfHealer | None  # None: self-healing is off (no inotify instance or watch to be had)
    quarantines: QuarantineReporter  # unreadable records set aside, reported (an Event on the Node)
    publish: PublishLoop | None = None  # from when the Node is known
    pods: PodResourcesClient | None = None  # the kubelet's pod resources service (None: offline)
    holds: PluginHolds | None = None  # GPUs a device plugin holds (None: none looked for, or offline)


class Agent:
    def __init__(self, settings: Settings, servers: Servers | None = None) -> None:
        """`servers`: the kubelet's sockets, opened by `start`."""
        from agent.app.httpserver import MAX_PROBE_CONNECTIONS, MetricsServer, Serves, SocketServer, identity_headers
        from agent.claims.store import ClaimStore
        from agent.health.service import DeviceHealthService
        from agent.inventory import Inventory
        from agent.kubelet.health import HealthTracker
        from agent.metrics import Metrics

        self.settings = settings
        self.inventory = Inventory(build_sources(settings), refine=PublishedForm(settings))
        self.store = ClaimStore(settings.claims_state_dir)
        self.tracker = HealthTracker(pool=settings.node_name)
        self.servers = servers if servers is not None else Servers(settings)
        self.health = DeviceHealthService(settings, self.inventory, self._conditions_changed)
        self.metrics = Metrics()
        self.metrics.state = self.metrics_state
        self.inventory.on_scan = self.metrics.scanned
        # `http`: the listener that answers the probes (their own with --probe-address, else the metrics
        # one); `metrics_http`: the metrics listener when the probes have their own (`agent.app.httpserver`).
        endpoint, probe_endpoint = settings.metrics_endpoint, settings.probe_endpoint
        identity = identity_headers(settings)
        self.http: MetricsServer | None = None
        self.metrics_http: MetricsServer | None = None
        if probe_endpoint is not None:
            self.http = MetricsServer(self.metrics, *probe_endpoint, healthz=self.healthz, readyz=self.readyz,
                                      identity=identity, serves=Serves.PROBES, max_connections=MAX_PROBE_CONNECTIONS)
            if endpoint is not None:
                self.metrics_http = MetricsServer(self.metrics, *endpoint, healthz=self.healthz, readyz=self.readyz,
                                                  serves=Serves.METRICS)
        elif endpoint is not None:
            self.http = MetricsServer(self.metrics, *endpoint, healthz=self.healthz, readyz=self.readyz,
                                      identity=identity)
        # `probe_socket`: the probes on a unix socket, for the kubelet's exec probes: no TCP port in the way.
        self.probe_socket = None if settings.probe_socket is None else SocketServer(
            self.metrics, settings.probe_socket, healthz=self.healthz, readyz=self.readyz, identity=identity)
        self._running: Running | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._devices: dict[str, Device] = {}
        self._mig_rescan = asyncio.Event()  # a claim's MIG device came or went: the GPUs are rescanned
        self.recovered = asyncio.Event()  # every record listed at start-up is checked, orphans removed
        self.refreshed = asyncio.Event()  # the start-up refresh of prepared claims is done
        self._summaries_saved = -1  # the book's change count the summaries on disk were saved at

    @property
    def running(self) -> Running:
        if self._running is None:
            raise RuntimeError("the agent has not started")
        return self._running

    # The running parts by name (for tests and tools that drive an agent in-process).
    @property
    def conn(self) -> Connection:
        return self.running.conn

    @property
    def engine(self) -> PrepareEngine:
        return self.running.engine

    @property
    def selfheal(self) -> SelfHealer | None:
        return self._running.selfheal if self._running is not None else None

    @property
    def publish(self) -> PublishLoop | None:
        return self._running.publish if self._running is not None else None

    async def start(self) -> None:
        """Everything, the kubelet's sockets last; a start that fails closes the sockets before the
        error goes on."""
        try:
            await self._start(self.servers)
        except BaseException:
            await self.servers.stop(grace=0)
            raise

    async def _start(self, servers: Servers) -> None:
        from agent.app.connection import connect
        from agent.app.quarantine import QuarantineReporter
        from agent.engine.gc import ClaimCollector, collection_off
        from agent.engine.prepare import PrepareEngine
        from agent.engine.recovery import begin_recovery
        from agent.health.claimstatus import ClaimStatusWriter
        from agent.health.statussinks import sink_for
        from agent.inventory.gpus import GpuSource

        s = self.settings
        started = time.monotonic()
        for server in (self.probe_socket, self.http, self.metrics_http):
            if server is not None:
                await server.start()
        async with contextlib.AsyncExitStack() as undo:  # a start that fails stops what started below
            conn = await connect(s, count=lambda verb, resource: self.metrics.api_requests.labels(verb, resource).inc())
            undo.push_async_callback(conn.close)
            log.info("mode: %s (%s)", conn.mode, conn.reason)
            await asyncio.to_thread(prepare_roots, s)  # again: checked before the engine writes below them
            await asyncio.to_thread(self.inventory.open)
            kernel = await asyncio.to_thread(start_sim_kernel, s)
            if kernel is not None:
                undo.push_async_callback(asyncio.to_thread, kernel.stop)
            set_node_features(self.inventory, conn.node, s)
            engine = PrepareEngine(s, self.inventory, conn.claim_source(s), self.store, metrics=self.metrics,
                                   vf_links=vf_links(s))
            engine.on_quarantine = reporter = QuarantineReporter(asyncio.get_running_loop(), conn, s)
            undo.push_async_callback(reporter.stop)
            self.health.follow(engine.leftovers)  # what unprepares left undone: the devices' undo-failed taints
            # Records are only listed here; each is checked in the background or by the first operation
            # on its claim, whichever comes first (agent.engine.recovery). The toolkit's CDI specs are
            # looked for here too: the CDI directory holds two specs per prepared claim, and listing it
            # (some 30 ms with 10,000 claims) was the first prepare's to pay while the kubelet waited.
            _, report, _ = await asyncio.gather(self.inventory.scan(), asyncio.to_thread(begin_recovery, engine),
                                                asyncio.to_thread(engine.toolkit.warm))
            await self.health.start()
            for source in self.inventory.sources:
                if isinstance(source, GpuSource):
                    self.health.watch_gpus(source)
            snapshot = self.inventory.snapshot()
            self._devices = snapshot.devices
            self.health.observe(snapshot)
            await self.tracker.update(snapshot, self.health.conditions, self.health.aliases(snapshot))
            claim_status = ClaimStatusWriter(
                s.driver_name, sink_for(conn.client, conn.offline, s.driver_name, engine.claims), self.health,
                engine.book, readiness=self.health, metrics=self.metrics, binding_kinds=s.binding_kinds)
            undo.push_async_callback(claim_status.stop)
            engine.listeners.append(claim_status)
            from agent.hostprep.migmode import MigModeRescans

            engine.listeners.append(MigModeRescans(self._mig_rescan))
            servers.attach(engine, self.tracker)
            await servers.start_dra()
            # Only now does the kubelet learn of the plugin: right after registering it, it calls the
            # endpoint GetInfo names (NodeWatchResources, then the prepares of pods waiting for the
            # driver), and a call refused there failed a pod's start that kubelet 1.37 did not retry.
            await servers.start_registration()
            running = Running(conn, engine, claim_status, kernel, await self._self_healing(engine), reporter)
            running.pods = self._pod_claims(conn)
            undo.push_async_callback(self._close_pods, running)
            running.holds = self.health.holds = self._plugin_holds(running)
            self._running = running
            undo.pop_all()
        log.info("ready in %.2fs: %d devices, %d claim records (checked in the background)",
                 time.monotonic() - started, len(self._devices), len(engine.unverified()))
        self._spawn(self._recover(running, report), "recover")
        self._spawn(self._publishing(running), "publish")
        self._spawn(self._rescans(), "rescan")
        self._spawn(self._mig_mode_rescans(), "rescan after MIG mode changes")
        self._spawn(self._netlink_events(), "netlink")
        if (off := collection_off(s, conn.offline)) is None:
            self._spawn(self._collecting(ClaimCollector(engine, s.gc_grace_period, metrics=self.metrics,
                                                        pods=running.pods)), "gc")
        else:
            log.info("garbage collection is off: %s", off)

    async def _self_healing(self, engine: PrepareEngine) -> SelfHealer | None:
        from agent.engine.selfheal import SelfHealer

        selfheal = SelfHealer(self.settings, engine, self.servers)
        try:
            await selfheal.start()
        except OSError as exc:  # out of inotify instances or watches: the agent still serves
            log.warning("self-healing is off: %s", exc)
            await selfheal.stop()
            return None
        return selfheal

    async def _recover(self, running: Running, report: RecoveryReport) -> None:
        """Check every record listed at start-up (batches in worker threads, prepares answered in between),
        remove orphaned files, bring claim status and metadata up to date, start preparing ahead of binding."""
        from agent.engine.recovery import check_records, finish_recovery

        engine = running.engine
        pending = engine.unverified()
        for i in range(0, len(pending), RECOVERY_BATCH):
            await asyncio.to_thread(check_records, engine, pending[i:i + RECOVERY_BATCH])
        await asyncio.to_thread(finish_recovery, engine, report)
        log.info("state: %s", report.summary())
        await self._save_summaries(engine)  # the book knows every record now
        self._spawn(self._keep_summaries(engine), "summaries")
        self.metrics.recovered(len(report.repaired), len(report.removed), len(report.quarantined))
        report.records.clear()  # every record, whole: the book keeps what is needed, and far less
        # The API may have missed writes while no agent ran (or they were queued when it stopped).
        await self._restore_status(running)  # what the last orderly stop wrote: not read back
        running.claim_status.resync(engine.records.values())
        self.recovered.set()
        if self.settings.binding_conditions and running.conn.client is not None:  # the book knows every claim now
            from agent.engine.prebind import prebind_claims
            self._spawn(prebind_claims(engine, running.claim_status, running.conn.client), "prebind")
        await self._refresh_prepared(engine)

    async def _refresh_prepared(self, engine: PrepareEngine) -> None:
        """Devices may have changed while no agent was running (a NIC got its IP): bring every
        prepared claim's metadata up to date with the first scan. In the background, so the
        kubelet is served at once; each claim is refreshed under its own lock."""
        updated = await engine.refresh_claims(sorted(engine.records))
        if updated:
            log.info("metadata of %d prepared claims brought up to date after the start", updated)
        self.refreshed.set()

    async def _keep_summaries(self, engine: PrepareEngine) -> None:
        """Save the book's summaries for the next start while they change (`agent.claims.summaries`): a
        process that is killed, or an agent started beside this one in a rolling update, finds most of
        them still valid."""
        from agent.claims.summaries import SAVE_INTERVAL

        while True:
            await asyncio.sleep(SAVE_INTERVAL)
            await self._save_summaries(engine)

    async def _save_summaries(self, engine: PrepareEngine) -> None:
        from agent.claims import summaries

        changes = engine.book.changes  # (read first: a change during the save is saved again next time)
        if changes == self._summaries_saved:
            return
        try:
            await asyncio.to_thread(summaries.save, summaries.path_of(self.settings.state_dir), engine.book)
        except OSError as exc:
            log.warning("could not keep the claim summaries for the next start, which reads every record "
                        "instead: %s", exc)
            return
        self._summaries_saved = changes

    def _pod_claims(self, conn: Connection) -> PodResourcesClient | None:
        """In a cluster, the kubelet's pod resources service says which claims pods here use (garbage
        collection); offline every claim comes from the directory, and is read from there."""
        from agent.kube.podresources import PodResourcesClient

        return None if conn.offline is not None else PodResourcesClient(self.settings.pod_resources_socket)

    @staticmethod
    async def _collecting(collector: ClaimCollector) -> None:
        await collector.run()

    @staticmethod
    async def _close_pods(running: Running) -> None:
        if running.pods is not None:
            await running.pods.close()

    def _plugin_holds(self, running: Running) -> PluginHolds | None:
        """Who holds the GPUs a device plugin serves (`agent.health.pluginholds`): in a cluster, unless
        `--device-plugin-resources` is empty."""
        from agent.events import NodeEvents
        from agent.health.pluginholds import PluginHolds, gpus_of
        from agent.health.requests import health_dir

        conn, names = running.conn, self.settings.plugin_resources
        if conn.client is None or running.pods is None or not names:
            return None
        events = NodeEvents(conn.client, self.settings.node_name, conn.node.uid if conn.node is not None else "",
                            self.settings.driver_name)
        holds = PluginHolds(names, self.settings.driver_name, running.pods,
                            lambda: gpus_of(self.inventory.snapshot().devices.values()), self._holds_changed,
                            mig_parents=self._mig_parents, events=events,
                            directory=health_dir(self.settings))
        # Read when scraped: the holds change on the Node's watch, the pods' reads and rescans alike.
        self.metrics.device_plugin_held.set_function(lambda: len(holds.held))
        return holds

    def _mig_parents(self) -> dict[str, str]:
        """MIG device UUID -> its GPU's UUID, of every GPU source (`GpuSource.mig_parents`). Blocking."""
        from agent.inventory.gpus import GpuSource

        out: dict[str, str] = {}
        for source in self.inventory.sources:
            if isinstance(source, GpuSource):
                out.update(source.mig_parents())
        return out

    async def _holds_changed(self) -> None:
        """The GPUs a device plugin holds changed: the slices follow."""
        if (publish := self.publish) is not None:
            publish.update(self.health.published(self.inventory.snapshot()))

    async def _restore_status(self, running: Running) -> None:
        """The claim status the last orderly stop left (`agent.health.statuswritten`), for the resync."""
        from agent.health import statuswritten

        try:
            known = await asyncio.to_thread(statuswritten.take, statuswritten.path_of(self.settings.state_dir),
                                            running.engine.writers)
        except OSError as exc:
            log.warning("could not read what the last run wrote of the claims' status (read back instead): %s", exc)
            return
        running.claim_status.restore_written(known)

    async def _keep_status(self, running: Running) -> None:
        from agent.health import statuswritten

        try:
            await asyncio.to_thread(statuswritten.save, statuswritten.path_of(self.settings.state_dir),
                                    running.claim_status.written(), running.engine.writers)
        except OSError as exc:
            log.warning("could not keep what was written of the claims' status for the next start, which reads "
                        "it back instead: %s", exc)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    @staticmethod
    def _task_done(task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s died", task.get_name(), exc_info=task.exception())

    async def _publishing(self, running: Running) -> None:
        from agent.app.connection import wait_for_node
        from agent.publish.loop import PublishLoop

        conn = running.conn
        node = conn.node
        if node is None:
            node = await wait_for_node(conn, self.settings.node_name)
            set_node_features(self.inventory, node, self.settings)
            await self.rescan()  # every source: node-allocatable fields, the form of numaNode
        publish = PublishLoop(conn.publisher(self.settings, node),
                              verify_interval=max(self.settings.rescan_interval, 60.0), metrics=self.metrics)
        publish.on_published = lambda devices: self.tracker.pool_published([d.name for d in devices])
        if (holds := running.holds) is not None:
            # Known before the first publish: a GPU a device-plugin pod has is never published free, not even once.
            holds.node_seen(node.allocatable, node.capacity)
            await holds.read_pods()
            await holds.refresh()
            self._spawn(holds.run(conn.client, self.settings.node_name), "device plugin holds")
        running.publish = publish
        # A kubelet deletes every ResourceSlice of its node when it starts, and registers the plugin
        # again a little later: the slices are checked, and published again, at each registration.
        self.servers.registration_state.on_registered = publish.verify_now
        # A pool someone else changed is verified against the devices as they are now (another agent's writes
        # are of its own scan: `PublishLoop.before_verify`).
        publish.before_verify = self.rescan
        publish.update(self.health.published(self.inventory.snapshot()))
        await publish.run()

    async def _rescans(self) -> None:
        while True:
            due = time.monotonic() + self.settings.rescan_interval
            # Between periodic rescans, a source whose scan failed is retried on its backoff.
            while (left := due - time.monotonic()) > 0:
                if retry := await self.inventory.wait_retry(left):
                    await self.rescan(retry)
            await self.rescan()

    async def _mig_mode_rescans(self) -> None:
        while True:
            await self._mig_rescan.wait()
            self._mig_rescan.clear()
            await self.rescan(["gpu"])

    async def _netlink_events(self) -> None:
        from agent.inventory.netwatch import NetlinkWatcher, debounced

        try:
            watcher = NetlinkWatcher()
            await watcher.start()
        except Exception as exc:
            log.warning("no netlink events (%s): NICs are rescanned every %.0fs only", exc,
                        self.settings.rescan_interval)
            return
        try:
            # The first scan ran before the socket was subscribed: a change in between has no event.
            await self.rescan(["nic"])
            log.info("watching netlink link and address events")
            async for _ in debounced(self._counted(watcher.events()), self.settings.netlink_debounce):
                await self.rescan(["nic"])
        finally:
            await watcher.close()

    async def _counted(self, events: AsyncIterator[NetEvent]) -> AsyncIterator[NetEvent]:
        async for event in events:
            self.metrics.netlink_events.labels(event.kind).inc()
            yield event

    async def rescan(self, kinds: Iterable[str] | None = None) -> bool:
        """Rescan these kinds of device (all by default); when anything changed, the slices, the health
        stream, the prepared claims' metadata and their status follow. True when something changed."""
        changed = await self.inventory.scan(kinds)
        if changed:
            await self._changed()
        return changed

    async def _changed(self) -> None:
        snapshot = self.inventory.snapshot()
        changed = {name for name, dev in snapshot.devices.items() if self._devices.get(name) != dev}
        changed |= set(self._devices) - set(snapshot.devices)  # gone: its claims say DeviceMissing now
        self._devices = snapshot.devices
        self.health.observe(snapshot)
        if (holds := self.health.holds) is not None:  # a GPU found while a device plugin serves is held too
            await holds.refresh(notify=False)
        if (publish := self.publish) is not None:
            publish.update(self.health.published(snapshot))
        await self.tracker.update(snapshot, self.health.conditions, self.health.aliases(snapshot))
        if changed and (running := self._running) is not None:
            await running.engine.refresh_devices(changed)
            running.claim_status.devices_changed(changed)  # a device gone or back: its Ready condition

    async def _conditions_changed(self, devices: set[str], rescan: set[str]) -> None:
        """Device conditions changed (an XID, a link down or up again, a taint cleared): the
        slices, the health stream and the claims holding those devices follow."""
        if rescan:
            await self.rescan(sorted(rescan))
        snapshot = self.inventory.snapshot()
        if (publish := self.publish) is not None:
            publish.update(self.health.published(snapshot))
        await self.tracker.update(snapshot, self.health.conditions, self.health.aliases(snapshot))
        if (running := self._running) is not None:
            running.claim_status.devices_changed(devices)

    async def stop(self) -> None:
        running = self._running
        if running is not None and running.selfheal is not None:  # first: the sockets removed below stay gone
            await running.selfheal.stop()
        await self.health.stop()  # first its GPU watcher: NVML is shut down below
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.servers.stop()
        for server in (self.probe_socket, self.http, self.metrics_http):
            if server is not None:
                await server.stop()
        if running is not None:
            await self._close_pods(running)
        if running is not None:  # what is still queued is written again by the next start's resync
            await running.claim_status.stop()
            await self._keep_status(running)
            await running.quarantines.stop()
            await self._save_summaries(running.engine)  # for the next start (an upgrade's, mostly)
        await asyncio.to_thread(self.inventory.close)
        if running is not None:
            if running.kernel is not None:
                await asyncio.to_thread(running.kernel.stop)
            await running.conn.close()

    # -- what the probes and the metrics read (`agent.app.probes.Observed`) --------------------------

    async def healthz(self) -> list[Check]:
        from agent.app import probes

        return await probes.healthz(self)

    async def readyz(self) -> list[Check]:
        from agent.app import probes

        return await probes.readyz(self)

    def metrics_state(self) -> AgentState:
        from agent.app import probes

        return probes.metrics_state(self)

    def sockets_view(self) -> SocketsView:
        from agent.app.probes import SocketsView

        s, state = self.settings, self.servers.registration_state
        return SocketsView(registration=s.registration_socket if self.servers.registration_started else None,
                           dra=s.dra_socket if self.servers.dra_started else None, registry_dir=s.registry_dir,
                           registered=state.registered, rejection=state.error)

    def publish_view(self) -> PublishView | None:
        from agent.app.probes import PublishedView, PublishView

        if (loop := self.publish) is None:
            return None
        r = loop.last_result
        last = None if r is None else PublishedView(r.devices, r.slices, r.generation, len(r.dropped))
        return PublishView(last, loop.up_to_date, loop.failures, loop.last_error, offline=self.conn.offline is not None)

    def devices_view(self) -> DevicesView:
        from agent.app.probes import DevicesView

        snapshot = self.inventory.snapshot()
        engine = self._running.engine if self._running is not None else None
        return DevicesView(health=tuple((h.device, h.status) for h in self.tracker.current()),
                           kinds={name: d.kind for name, d in snapshot.devices.items()},
                           failing_sources=tuple(f.kind for f in snapshot.failing_sources),
                           taints=self.health.conditions.taint_counts(),
                           health_watchers=self.tracker.watchers, prepared_claims=len(engine.book) if engine else 0,
                           prepared_devices=engine.book.device_count() if engine else 0,
                           quarantined=tuple(engine.quarantined) if engine else (), nvml_up=self.health.nvml_up)

"""The running agent: discovery, publishing, the kubelet's sockets, and keeping it all current.

Start-up order: roots checked -> registration socket (this module and the servers' import light;
the rest is imported in a worker thread meanwhile) -> metrics and probes server -> connect -> open
discovery -> first scan and the listing of claim records (concurrently) -> DRA socket -> background
work (each record's check, then orphan removal and the claims' status and metadata; publishing,
rescans, netlink events, health).
SIGTERM stops the servers and removes the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from agent import config as config_mod
from agent.app.assembly import (
    PublishedForm,
    build_sources,
    prepare_roots,
    set_node_features,
    start_sim_kernel,
)
from agent.config import Settings
from agent.kubelet.server import Servers

# This module is imported light (issue 11): the registration socket opens before discovery, the
# engine, the API client and their dependencies are imported. They are imported where first used.
if TYPE_CHECKING:
    from agent.app.connection import Connection
    from agent.engine.prepare import PrepareEngine
    from agent.engine.recovery import RecoveryReport
    from agent.engine.selfheal import SelfHealer
    from agent.health.claimstatus import ClaimStatusWriter
    from agent.inventory.netwatch import NetEvent
    from agent.metrics import AgentState, Check, MetricsServer
    from agent.model import Device
    from agent.publish.apiserver import PublishLoop
    from agent.sim.kernel.emulator import KernelEmulator

log = logging.getLogger(__name__)

RECOVERY_BATCH = 64  # records checked per worker-thread call in the background start-up check


class Agent:
    def __init__(self, settings: Settings, servers: Servers | None = None) -> None:
        from agent.claims.store import ClaimStore
        from agent.health.service import DeviceHealthService
        from agent.inventory import Inventory
        from agent.kubelet.health import HealthTracker
        from agent.metrics import Metrics

        self.settings = settings
        self.inventory = Inventory(build_sources(settings), refine=PublishedForm(settings))
        self.store = ClaimStore(settings.claims_state_dir)
        self.tracker = HealthTracker(pool=settings.node_name)
        self.conn: Connection | None = None
        self.engine: PrepareEngine | None = None
        self.servers = servers  # with the registration server started already (`open_registration`)
        self.selfheal: SelfHealer | None = None
        self.publish: PublishLoop | None = None
        self.health = DeviceHealthService(settings, self.inventory, self._conditions_changed)
        self.claim_status: ClaimStatusWriter | None = None
        self.metrics = Metrics()
        self.metrics.state = self.metrics_state
        self.inventory.on_scan = self.metrics.scanned
        self.http: MetricsServer | None = None
        self.kernel: KernelEmulator | None = None  # the simulated machine's kernel (--nvml sim)
        self._tasks: list[asyncio.Task[Any]] = []
        self._devices: dict[str, Device] = {}
        self.recovered = asyncio.Event()  # every record listed at start-up is checked, orphans removed
        self.refreshed = asyncio.Event()  # the start-up refresh of prepared claims is done

    async def start(self) -> None:
        """Registration first (unless `run` opened it already), then the rest; a start that fails
        closes the sockets before the error goes on."""
        if self.servers is None:
            self.servers = await open_registration(self.settings)
        try:
            await self._start(self.servers)
        except BaseException:
            await self.servers.stop(grace=0)
            raise

    async def _start(self, servers: Servers) -> None:
        from agent.app.connection import connect
        from agent.engine.gc import ClaimCollector, collection_off
        from agent.engine.prepare import PrepareEngine
        from agent.engine.recovery import begin_recovery
        from agent.engine.selfheal import SelfHealer
        from agent.health.claimstatus import ClaimStatusWriter
        from agent.health.statussinks import sink_for
        from agent.inventory.gpus import GpuSource
        from agent.metrics import MetricsServer

        s = self.settings
        started = time.monotonic()
        if s.metrics_endpoint is not None:
            host, port = s.metrics_endpoint
            self.http = MetricsServer(self.metrics, host, port, healthz=self.healthz, readyz=self.readyz)
            await self.http.start()
        self.conn = await connect(s)
        log.info("mode: %s (%s)", self.conn.mode, self.conn.reason)
        await asyncio.to_thread(prepare_roots, s)  # again: checked before the engine writes below them
        await asyncio.to_thread(self.inventory.open)
        self.kernel = await asyncio.to_thread(start_sim_kernel, s)
        set_node_features(self.inventory, self.conn.node, s)
        self.engine = PrepareEngine(s, self.inventory, self.conn.claim_source(s), self.store, metrics=self.metrics)
        # Records are only listed here; each is checked in the background or by the first operation
        # on its claim, whichever comes first (agent.engine.recovery).
        _, report = await asyncio.gather(self.inventory.scan(), asyncio.to_thread(begin_recovery, self.engine))
        await self.health.start()
        for source in self.inventory.sources:
            if isinstance(source, GpuSource):
                self.health.watch_gpus(source)
        snapshot = self.inventory.snapshot()
        self._devices = snapshot.devices
        self.health.observe(snapshot)
        await self.tracker.update(snapshot, self.health.conditions, self.health.aliases(snapshot))
        self.claim_status = ClaimStatusWriter(
            s.driver_name, sink_for(self.conn.client, self.conn.offline, s.driver_name), self.health,
            self.engine.book, readiness=self.health, metrics=self.metrics)
        self.engine.listeners.append(self.claim_status)
        servers.attach(self.engine, self.tracker)
        await servers.start_dra()
        self.selfheal = SelfHealer(s, self.engine, servers)
        try:
            await self.selfheal.start()
        except OSError as exc:  # out of inotify instances or watches: the agent still serves
            log.warning("self-healing is off: %s", exc)
            await self.selfheal.stop()
            self.selfheal = None
        log.info("ready in %.2fs: %d devices, %d claim records (checked in the background)",
                 time.monotonic() - started, len(self._devices), len(self.engine.unverified()))
        self._spawn(self._recover(report), "recover")
        self._spawn(self._publishing(), "publish")
        self._spawn(self._rescans(), "rescan")
        self._spawn(self._netlink_events(), "netlink")
        if (off := collection_off(s, self.conn.offline)) is None:
            self._spawn(ClaimCollector(self.engine, s.gc_grace_period, metrics=self.metrics).run(), "gc")
        else:
            log.info("garbage collection is off: %s", off)

    async def _recover(self, report: RecoveryReport) -> None:
        """Check every record listed at start-up, a batch per worker-thread call with the event loop
        free in between (prepares keep being answered meanwhile), then remove orphaned files and bring
        the claims' status and metadata up to date."""
        from agent.engine.recovery import check_records, finish_recovery

        assert self.engine is not None and self.claim_status is not None
        pending = self.engine.unverified()
        for i in range(0, len(pending), RECOVERY_BATCH):
            await asyncio.to_thread(check_records, self.engine, pending[i:i + RECOVERY_BATCH])
        await asyncio.to_thread(finish_recovery, self.engine, report)
        log.info("state: %s", report.summary())
        self.metrics.recovered(len(report.repaired), len(report.removed), len(report.quarantined))
        report.records.clear()  # every record, whole: the book keeps what is needed, and far less
        # The API may have missed writes while no agent ran (or they were queued when it stopped).
        self.claim_status.resync(self.engine.records.values())
        self.recovered.set()
        await self._refresh_prepared()

    async def _refresh_prepared(self) -> None:
        """Devices may have changed while no agent was running (a NIC got its IP): bring every
        prepared claim's metadata up to date with the first scan. In the background, so the
        kubelet is served at once; each claim is refreshed under its own lock."""
        assert self.engine is not None
        updated = await self.engine.refresh_claims(sorted(self.engine.records))
        if updated:
            log.info("metadata of %d prepared claims brought up to date after the start", updated)
        self.refreshed.set()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    @staticmethod
    def _task_done(task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s died", task.get_name(), exc_info=task.exception())

    async def _publishing(self) -> None:
        from agent.app.connection import wait_for_node
        from agent.publish.apiserver import PublishLoop

        assert self.conn is not None
        node = self.conn.node
        if node is None:
            node = await wait_for_node(self.conn, self.settings.node_name)
            set_node_features(self.inventory, node, self.settings)
            await self.rescan()  # every source: node-allocatable fields, the form of numaNode
        self.publish = PublishLoop(self.conn.publisher(self.settings, node),
                                   verify_interval=max(self.settings.rescan_interval, 60.0), metrics=self.metrics)
        self.publish.on_published = lambda devices: self.tracker.pool_published([d.name for d in devices])
        self.publish.update(self.health.published(self.inventory.snapshot()))
        await self.publish.run()

    async def _rescans(self) -> None:
        while True:
            due = time.monotonic() + self.settings.rescan_interval
            # Between periodic rescans, a source whose scan failed is retried on its backoff.
            while (left := due - time.monotonic()) > 0:
                if retry := await self.inventory.wait_retry(left):
                    await self.rescan(retry)
            await self.rescan()

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
        if self.publish is not None:
            self.publish.update(self.health.published(snapshot))
        await self.tracker.update(snapshot, self.health.conditions, self.health.aliases(snapshot))
        if changed and self.engine is not None:
            await self.engine.refresh_devices(changed)
        if changed and self.claim_status is not None:
            self.claim_status.devices_changed(changed)  # a device gone or back: its Ready condition

    async def _conditions_changed(self, devices: set[str], rescan: set[str]) -> None:
        """Device conditions changed (an XID, a link down or up again, a taint cleared): the
        slices, the health stream and the claims holding those devices follow."""
        if rescan:
            await self.rescan(sorted(rescan))
        snapshot = self.inventory.snapshot()
        if self.publish is not None:
            self.publish.update(self.health.published(snapshot))
        await self.tracker.update(snapshot, self.health.conditions, self.health.aliases(snapshot))
        if self.claim_status is not None:
            self.claim_status.devices_changed(devices)

    async def stop(self) -> None:
        if self.selfheal is not None:  # first: the sockets removed below must not come back
            await self.selfheal.stop()
        await self.health.stop()  # first its GPU watcher: NVML is shut down below
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.servers is not None:
            await self.servers.stop()
        if self.http is not None:
            await self.http.stop()
        if self.claim_status is not None:  # what is still queued is written again by the next start's resync
            await self.claim_status.stop()
        await asyncio.to_thread(self.inventory.close)
        if self.kernel is not None:
            await asyncio.to_thread(self.kernel.stop)
        if self.conn is not None:
            await self.conn.close()


    # -- probes and metrics (agent.metrics serves them; `agent.app.probes` works them out) ------------

    async def healthz(self) -> list[Check]:
        from agent.app import probes

        return await probes.healthz(self)

    async def readyz(self) -> list[Check]:
        from agent.app import probes

        return await probes.readyz(self)

    def metrics_state(self) -> AgentState:
        from agent.app import probes

        return probes.metrics_state(self)


_MODULES = (
    "agent.engine.prepare",
    "agent.engine.recovery",
    "agent.app.connection",
    "agent.health.service",
    "agent.health.claimstatus",
    "agent.health.statussinks",
    "agent.engine.selfheal",
    "agent.engine.gc",
    "agent.publish.apiserver",
    "agent.metrics",
    "agent.inventory.gpus",
    "agent.inventory.nics",
    "agent.inventory.cpus",
    "agent.inventory.memory",
    "agent.inventory.netwatch",
)


def _import_modules() -> None:
    for name in _MODULES:
        importlib.import_module(name)


async def open_registration(settings: Settings) -> Servers:
    """The agent's roots checked and its registration server listening: the kubelet's GetInfo is
    answered while discovery and the engine start (the kubelet retries its calls to the DRA socket,
    GetInfo's endpoint, until that socket answers)."""
    await asyncio.to_thread(prepare_roots, settings)
    servers = Servers(settings)
    await servers.start_registration()
    return servers


async def run(settings: Settings) -> int:
    from agent.health.policy import PolicyError, load_policy

    for flag, value in config_mod.describe(settings):
        log.debug("setting %s = %s", flag, value)
    log.info("dra-agent starting: driver %s, node %s, nvml %s", settings.driver_name, settings.node_name,
             settings.nvml)
    try:
        load_policy(settings.taint_policy)  # a configuration error stops the agent before any socket opens
    except PolicyError as exc:
        log.error("cannot start: %s", exc)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Worker threads mostly wait on the disk: enough of them that 16+ claims in flight are not
    # queued behind the default pool's handful (cores + 4).
    loop.set_default_executor(ThreadPoolExecutor(max_workers=32, thread_name_prefix="dra-io"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent: Agent | None = None
    try:
        servers = await open_registration(settings)
    except Exception as exc:
        from agent.app.connection import StartupError  # (imported on this path only: it pulls in the API client)

        if not isinstance(exc, (StartupError, OSError, RuntimeError)):
            raise
        log.error("cannot start: %s", exc)
        return 1
    # The rest of the agent's modules are imported in a worker thread: the event loop keeps
    # answering GetInfo meanwhile (an import holds the interpreter only in short slices).
    await asyncio.to_thread(_import_modules)
    from agent.app.connection import StartupError
    from agent.inventory import DiscoveryError

    try:
        agent = Agent(settings, servers)
        await agent.start()
    except (DiscoveryError, StartupError, OSError, RuntimeError, PolicyError) as exc:
        log.error("cannot start: %s", exc)
        await (agent.stop() if agent is not None else servers.stop())
        return 1
    except BaseException:
        # The registration socket is open already: it goes before the error does.
        await (agent.stop() if agent is not None else servers.stop())
        raise
    await stop.wait()
    log.info("stopping")
    await agent.stop()
    return 0

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
import collections
import contextlib
import dataclasses
import importlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc

from agent import config as config_mod
from agent import kubelet_client
from agent.config import Settings
from agent.fsutil import UnsafeRoot, check_root, makedirs
from agent.server import Servers

# This module is imported light (issue 11): the registration socket opens before discovery, the
# engine, the API client and their dependencies are imported. They are imported where first used.
if TYPE_CHECKING:
    from agent.claimstatus import ClaimStatusWriter
    from agent.connection import Connection
    from agent.inventory import Inventory, Source
    from agent.inventory.netwatch import NetEvent
    from agent.kube import NodeInfo
    from agent.metrics import AgentState, Check, MetricsServer
    from agent.model import Device
    from agent.prepare import PrepareEngine
    from agent.publisher import PublishLoop
    from agent.recovery import RecoveryReport
    from agent.selfheal import SelfHealer
    from agent.simkernel.emulator import KernelEmulator

log = logging.getLogger(__name__)

RECOVERY_BATCH = 64  # records checked per worker-thread call in the background start-up check


def build_sources(settings: Settings) -> list[Source]:
    from agent.inventory.cpus import CpuSource
    from agent.inventory.gpus import GpuSource
    from agent.inventory.memory import MemorySource
    from agent.inventory.nics import NicSource
    from agent.inventory.simnics import SimNicSource

    sources: list[Source] = [GpuSource(settings), NicSource(settings, passthrough=settings.nic_passthrough),
                             CpuSource(settings), MemorySource(settings)]
    if settings.nvml.kind == "sim":
        # The simulated NIC's functions have no netdev for NIC discovery to find; listed after GPU
        # discovery, whose opening writes the simulated machine this source reads.
        sources.append(SimNicSource(settings))
    return sources


def start_sim_kernel(settings: Settings) -> KernelEmulator | None:
    """With `--nvml sim`, the simulated machine's kernel, which applies binding writes (the agent's
    VFIO binds, an operator's echo into sysfs) while the agent runs. The running agent starts it, not
    GPU discovery: one-shot CLI commands open the same machine and must not run a second one on it.
    Started before recovery, which may bind functions again."""
    if settings.nvml.kind != "sim":
        return None
    from agent.inventory.nvml_profiles import load_profile
    from agent.simkernel.emulator import KernelEmulator
    from agent.vfio.host import VfioHost

    root = VfioHost.of(settings).sysfs.parent
    if not (root / "sys" / "bus" / "pci" / "drivers").is_dir():
        return None  # no simulated machine was written (GPU discovery is not among the sources)
    kernel = KernelEmulator(load_profile(settings.nvml.profile), root)
    kernel.start()
    return kernel


class PublishedForm:
    """Reduces a scanned device to what the API server accepts, so slices, metadata files and the
    CLI all show the same device. Each problem is logged once, not on every rescan."""

    def __init__(self) -> None:
        self._reported: set[str] = set()

    def __call__(self, device: Device) -> Device | None:
        out, problems = published_form(device)
        for message in problems:
            if message not in self._reported:
                self._reported.add(message)
                log.warning("not published: %s", message)
        return out


def published_form(device: Device) -> tuple[Device | None, list[str]]:
    """The device without what the API server would reject, and what was removed."""
    from agent import slices

    wire, problems = slices.sanitize_device(device)
    if wire is None:
        return None, problems
    attrs, caps = wire.get("attributes", {}), wire.get("capacity", {})
    if len(attrs) == len(device.attributes) and len(caps) == len(device.capacity):
        return device, problems
    return dataclasses.replace(
        device,
        attributes={k: v for k, v in device.attributes.items() if k in attrs},
        capacity={k: v for k, v in device.capacity.items() if k in caps},
    ), problems


def prepare_roots(settings: Settings) -> None:
    """Create the directories the agent writes below, and refuse to start on one that another user
    could plant links or files in (unless --allow-unsafe-roots): the agent never follows a link
    below its roots, but it must also trust the roots themselves."""
    roots = [("state directory", settings.state_dir, 0o700), ("records directory", settings.claims_state_dir, 0o700),
             ("CDI directory", settings.cdi_dir, 0o755), ("plugin directory", settings.plugin_dir, 0o755),
             ("metadata directory", settings.metadata_dir, 0o755),
             ("plugin registry directory", settings.registry_dir, 0o755)]
    for what, path, mode in roots:
        makedirs(path, mode)
        try:
            check_root(path, what)
        except UnsafeRoot as exc:
            if not settings.allow_unsafe_roots:
                from agent.connection import StartupError

                raise StartupError(f"{exc}: refusing to start (--allow-unsafe-roots overrides)") from None
            log.warning("%s (allowed by --allow-unsafe-roots)", exc)


def set_node_allocatable(inventory: Inventory, node: NodeInfo | None) -> None:
    enabled = bool(node and node.node_allocatable)
    for source in inventory.sources:
        if hasattr(source, "node_allocatable"):
            source.node_allocatable = enabled


class Agent:
    def __init__(self, settings: Settings, servers: Servers | None = None) -> None:
        from agent.devhealth import DeviceHealthService
        from agent.health import HealthTracker
        from agent.inventory import Inventory
        from agent.metrics import Metrics
        from agent.state import ClaimStore

        self.settings = settings
        self.inventory = Inventory(build_sources(settings), refine=PublishedForm())
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
        from agent.claimstatus import ClaimStatusWriter
        from agent.claimstatus_sinks import sink_for
        from agent.connection import connect
        from agent.gc import ClaimCollector, collection_off
        from agent.inventory.gpus import GpuSource
        from agent.metrics import MetricsServer
        from agent.prepare import PrepareEngine
        from agent.recovery import begin_recovery
        from agent.selfheal import SelfHealer

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
        set_node_allocatable(self.inventory, self.conn.node)
        self.engine = PrepareEngine(s, self.inventory, self.conn.claim_source(s), self.store, metrics=self.metrics)
        # Records are only listed here; each is checked in the background or by the first operation
        # on its claim, whichever comes first (agent.recovery).
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
        from agent.recovery import check_records, finish_recovery

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
        from agent.connection import wait_for_node
        from agent.publisher import PublishLoop

        assert self.conn is not None
        node = self.conn.node
        if node is None:
            node = await wait_for_node(self.conn, self.settings.node_name)
            set_node_allocatable(self.inventory, node)
            if await self.inventory.scan(["cpu", "memory", "gpu"]):
                await self._changed()
        self.publish = PublishLoop(self.conn.publisher(self.settings, node),
                                   verify_interval=max(self.settings.rescan_interval, 60.0), metrics=self.metrics)
        self.publish.update(self.health.published(self.inventory.snapshot()))
        await self.publish.run()

    async def _rescans(self) -> None:
        while True:
            due = time.monotonic() + self.settings.rescan_interval
            # Between periodic rescans, a source whose scan failed is retried on its backoff.
            while (left := due - time.monotonic()) > 0:
                if (retry := await self.inventory.wait_retry(left)) and await self.inventory.scan(retry):
                    await self._changed()
            if await self.inventory.scan():
                await self._changed()

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
            if await self.inventory.scan(["nic"]):
                await self._changed()
            log.info("watching netlink link and address events")
            async for _ in debounced(self._counted(watcher.events()), self.settings.netlink_debounce):
                if await self.inventory.scan(["nic"]):
                    await self._changed()
        finally:
            await watcher.close()

    async def _counted(self, events: AsyncIterator[NetEvent]) -> AsyncIterator[NetEvent]:
        async for event in events:
            self.metrics.netlink_events.labels(event.kind).inc()
            yield event

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
        if rescan and await self.inventory.scan(sorted(rescan)):
            await self._changed()
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


    # -- probes and metrics (agent.metrics serves them) -----------------------------------------

    async def healthz(self) -> list[Check]:
        """Alive: this answer comes from the event loop, and both gRPC servers answer a call."""
        from agent.metrics import Check

        checks = [Check("event-loop", True)]
        if self.servers is None:
            why = "starting: recovering state and scanning devices before the sockets open"
            return [*checks, Check("registration-server", False, why), Check("dra-server", False, why)]
        s = self.settings
        registration = _answers("registration-server", lambda: kubelet_client.get_info(s.registration_socket))
        if not self.servers.dra_started:
            why = "starting: scanning devices and listing claim records before the DRA socket opens"
            return [*checks, await registration, Check("dra-server", False, why)]
        return [*checks, *await asyncio.gather(
            registration, _answers("dra-server", lambda: kubelet_client.empty_prepare(s.dra_socket)))]

    async def readyz(self) -> list[Check]:
        """Ready: the kubelet registered the plugin, and this node's slices have been published."""
        from agent.metrics import Check

        if self.servers is None:
            registration = Check("kubelet-registration", False, "starting: the sockets are not open yet")
        else:
            state = self.servers.registration_state
            if state.registered:
                registration = Check("kubelet-registration", True, "the kubelet registered the plugin")
            elif state.registered is False:
                registration = Check("kubelet-registration", False,
                                     f"the kubelet rejected the plugin: {state.error or '(no reason given)'}")
            else:
                registration = Check("kubelet-registration", False, "the kubelet has not registered the plugin "
                                     f"yet (it watches {self.settings.registry_dir})")
        loop = self.publish
        if loop is None:
            slices_check = Check("slices", False, "not publishing yet (waiting for the Node)")
        elif loop.last_result is None:
            why = f": {loop.failures} failed attempts, the last: {loop.last_error}" if loop.failures else ""
            slices_check = Check("slices", False, "not published yet" + why)
        else:
            r = loop.last_result
            detail = f"{r.devices} devices in {r.slices} slices, generation {r.generation}"
            if not loop.up_to_date:
                detail += " (a newer inventory is being published" + (
                    f": {loop.failures} failed attempts, the last: {loop.last_error})" if loop.failures else ")")
            slices_check = Check("slices", True, detail)
        return [registration, slices_check]

    def metrics_state(self) -> AgentState:
        from agent.metrics import AgentState

        snapshot = self.inventory.snapshot()
        kinds = {name: d.kind for name, d in snapshot.devices.items()}
        # A device that failed is known by name only; the names start with the kind (gpu-3, nic-...).
        devices = collections.Counter((kinds.get(h.device) or h.device.split("-", 1)[0], h.status)
                                      for h in self.tracker.current())
        # One per published taint: a device's XIDs make one taint (agent.conditions).
        taints = collections.Counter((c.kind, c.effect) for c in self.health.conditions.causes()
                                     if c.kind != "xid")
        taints.update(("xid", t.effect) for name in self.health.conditions.tainted()
                      for t in self.health.conditions.taints(name) if t.key.endswith("/xid"))
        state = AgentState(devices=dict(devices), failing_sources=[f.kind for f in snapshot.failing_sources],
                           taints=dict(taints),
                           prepared_claims=len(self.engine.book) if self.engine else 0,
                           health_watchers=self.tracker.watchers)
        if self.servers is not None:
            state.registered = self.servers.registration_state.registered
        if self.publish is not None:
            state.publish_up_to_date = self.publish.up_to_date
            state.publish_failures = self.publish.failures
            if (r := self.publish.last_result) is not None:
                state.published_devices, state.published_slices = r.devices, r.slices
                state.dropped_values = len(r.dropped)
        return state


PROBE_TIMEOUT = 2.0


async def _answers(name: str, call: Callable[[], Awaitable[Any]]) -> Check:
    from agent.metrics import Check

    started = time.monotonic()
    try:
        async with asyncio.timeout(PROBE_TIMEOUT):
            await call()
    except TimeoutError:
        return Check(name, False, f"no answer within {PROBE_TIMEOUT:g}s")
    except grpc.aio.AioRpcError as exc:
        return Check(name, False, f"{exc.code().name}: {exc.details()}")
    except Exception as exc:
        return Check(name, False, f"{type(exc).__name__}: {exc}")
    return Check(name, True, f"answered in {(time.monotonic() - started) * 1000:.1f} ms")


_MODULES = ("agent.prepare", "agent.recovery", "agent.connection", "agent.devhealth", "agent.claimstatus",
            "agent.claimstatus_sinks", "agent.selfheal", "agent.gc", "agent.publisher", "agent.metrics",
            "agent.inventory.gpus", "agent.inventory.nics", "agent.inventory.cpus", "agent.inventory.memory",
            "agent.inventory.netwatch")


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
    from agent.taintpolicy import PolicyError, load_policy

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
        from agent.connection import StartupError  # (imported on this path only: it pulls in the API client)

        if not isinstance(exc, (StartupError, OSError, RuntimeError)):
            raise
        log.error("cannot start: %s", exc)
        return 1
    # The rest of the agent's modules are imported in a worker thread: the event loop keeps
    # answering GetInfo meanwhile (an import holds the interpreter only in short slices).
    await asyncio.to_thread(_import_modules)
    from agent.connection import StartupError
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

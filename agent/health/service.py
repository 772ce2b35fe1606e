"""The running agent's device health: events in, taints, health stream and claim readiness out.

`DeviceHealthService` owns the device conditions (`agent.health.conditions`) and everything that
feeds them while the agent runs:
- each inventory snapshot: the link state of every NIC (`observe`);
- the GPU event watcher's events (XIDs, lost and answering GPUs, each GPU's first answer, which
  XID taints restored from the last run are checked against), handed over from its thread
  (`gpu_event`);
- operators' clear requests (`agent.health.requests.RequestWatcher`);
- time: informational XID taints expiring, link taints held until the link stays up.

When the causes of devices change it calls the daemon's `changed(devices, kinds)` once per
burst, which rescans the kinds named (a GPU lost or answering again changes what discovery
finds), republishes the slices (`published` lays the taints over the inventory's devices),
updates the health stream and re-applies the status of the claims holding those devices.

A GPU's other forms (its passthrough variant, MIG placements, vGPU devices, shared form: the
same PCI function) are the same hardware: they carry the GPU's taints, health and readiness, and
a change of the GPU's causes re-applies the status of the claims holding any of them.

A GPU that is lost drops out of discovery (no NVML call about it answers), and so do the forms
discovery derives from it. While its `gpu-lost` cause lasts, the GPU and those forms are still
published as they were last seen, tainted (NoExecute by default), so the scheduler and the
eviction controller see them; a restarted agent that never saw the GPU answer cannot publish
it and reports it UNHEALTHY only.

NVML lost as a whole (`NvmlLost`: the NVIDIA driver unloaded, as the GPU Operator's driver container does
to reload it) puts an `nvml-lost` cause on every GPU discovery has (and so on their forms): they stay
published as the last good scan saw them (the GPU scans fail meanwhile, and the inventory keeps their last
good result), tainted, UNHEALTHY on the health stream. `NvmlBack` takes the causes away and rescans the
GPUs. `nvml_up` says which, for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from agent.claims.leftovers import Leftover, Leftovers, leftovers_dir
from agent.config import Settings
from agent.facts import GpuFacts, NicFacts, PassthroughFacts
from agent.health.conditions import GPU_LOST, UNDO_FAILED, Cause, DeviceConditions, Readiness
from agent.health.pluginholds import PluginHolds
from agent.health.policy import TaintPolicy, load_policy
from agent.health.requests import RequestWatcher, health_dir, requests_dir
from agent.host.vfio.host import VfioHost
from agent.inventory import Inventory, Snapshot
from agent.inventory.gpu_events import (
    DoubleBitEcc,
    GpuAnswering,
    GpuBaseline,
    GpuEvent,
    GpuEventWatcher,
    GpuLost,
    NvmlBack,
    NvmlLost,
    XidError,
)
from agent.inventory.gpus import GpuSource
from agent.kinds import Kind
from agent.model import Device

log = logging.getLogger(__name__)

# The longest the service sleeps between looks at the clock when nothing is due (a bound, so a
# wall-clock jump cannot leave a held link taint for long).
IDLE_WAKE = 30.0
DOUBLE_BIT_ECC_XID = 48  # the XID the driver logs for a double-bit ECC error


class DeviceHealthService:
    def __init__(self, settings: Settings, inventory: Inventory,
                 changed: Callable[[set[str], set[str]], Awaitable[None]], policy: TaintPolicy | None = None) -> None:
        self.settings = settings
        self.inventory = inventory
        self.conditions = DeviceConditions(settings.driver_name,
                                           policy if policy is not None else load_policy(settings.taint_policy),
                                           health_dir(settings))
        self.conditions.on_change = self._note
        self._changed_cb = changed
        self.requests = RequestWatcher(requests_dir(settings), self.conditions)
        self._last_seen: dict[str, Device] = {}
        # PCI bus ID -> native device, as of the last snapshot observed: readiness and get, called per
        # claim device on every status write, look forms up here instead of going over every device.
        self._bus_native: dict[str, str] = {}
        self._nics: set[str] = set()
        self._dirty: set[str] = set()
        self._rescan: set[str] = set()  # kinds to rescan: a lost GPU answering is back in discovery
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.gpu_events: GpuEventWatcher | None = None
        # Host changes gone claims left (`agent.claims.leftovers`): their devices carry an undo-failed
        # cause; the engine keeps them, `note_leftovers` says they changed, an operator's clear drops them.
        self.leftovers = Leftovers(leftovers_dir(settings.state_dir))
        self._leftovers: list[Leftover] = []
        self._leftovers_due = True
        self.conditions.on_cleared = self._cleared
        # GPUs a device plugin holds (`agent.health.pluginholds`): their taint is laid over a GPU and its forms
        # as the health taints are, beside them; None: no device plugin is looked for.
        self.holds: PluginHolds | None = None

    async def start(self) -> None:
        # The kernel's boot ID (the simulated machine's with --nvml sim): XID causes of another boot
        # are not restored.
        boot_id = await asyncio.to_thread(VfioHost.of(self.settings).boot_id)
        await asyncio.to_thread(self.conditions.load, boot_id)
        await asyncio.to_thread(self.conditions.save)  # `dra-agent taints` tells "none" from "no agent"
        await self._load_leftovers()  # kept by unprepares of an earlier run: their taints come back
        try:
            await self.requests.start()
        except OSError as exc:  # out of inotify watches: listing works, clearing waits for a restart
            log.warning("taint clear requests are not watched: %s", exc)
        self._task = asyncio.create_task(self._run(), name="device-health")

    def watch_gpus(self, source: GpuSource) -> None:
        """Start the GPU event watcher on the source's NVML, with what else the source says drives its GPUs:
        its thread hands each event to the loop. A node without NVML has no GPU events."""
        if source.nvml is None:
            return
        loop = asyncio.get_running_loop()

        def hand_over(event: GpuEvent) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the agent is stopping
                loop.call_soon_threadsafe(self.gpu_event, event)

        self.gpu_events = GpuEventWatcher(source.nvml, hand_over, probe_interval=self.settings.gpu_probe_interval,
                                          commands=source.commands, name_hint=source.device_name,
                                          baseline=True, gate=source.gate)
        self.gpu_events.start()

    async def stop_gpus(self) -> None:
        """Stop the watcher (before NVML is shut down)."""
        if self.gpu_events is not None:
            watcher, self.gpu_events = self.gpu_events, None
            await asyncio.to_thread(watcher.stop)

    async def stop(self) -> None:
        await self.stop_gpus()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.requests.stop()

    # -- inputs -----------------------------------------------------------------------------------

    def observe(self, snapshot: Snapshot) -> None:
        """Fold in a new inventory snapshot: remember devices as last seen, and NIC link states."""
        nics = set()
        due = self.conditions.next_deadline()
        for name, dev in snapshot.devices.items():
            self._last_seen[name] = dev
            if isinstance(dev.node, NicFacts):
                nics.add(name)
                self.conditions.link(name, dev.node.link_up)
        if (soon := self.conditions.next_deadline()) is not None and (due is None or soon < due):
            # A link came up: its hold ends before the loop's current sleep does (which may be the idle one).
            self._wake.set()
        gone = self._nics - nics
        if gone:
            self.conditions.forget(gone)
        self._nics = nics
        # Forget devices gone for good; keep lost GPUs (published from memory) and devices discovery
        # still names but cannot read (a GPU failing its calls may be reported lost a moment later),
        # and the forms of both (published from memory with them).
        keep = self._lost()
        keep |= {f.device for f in snapshot.failed_devices}
        natives = self._natives()
        for name in set(self._last_seen) - set(snapshot.devices) - keep:
            if _native_of(self._last_seen[name], natives) not in keep:
                del self._last_seen[name]
        self._bus_native = self._natives()
        self._fold_leftovers()  # (their hardware's native devices as this snapshot names them)

    def follow(self, leftovers: Leftovers) -> None:
        """Read the ledger again whenever `leftovers` (the engine's) keeps or removes an entry: told from
        the engine's worker threads, handed to the loop (call from the loop)."""
        loop = asyncio.get_running_loop()

        def changed() -> None:
            loop.call_soon_threadsafe(self.note_leftovers)
        leftovers.on_change = changed

    def note_leftovers(self) -> None:
        """The leftovers changed (the engine kept or undid one): read again by the loop."""
        self._leftovers_due = True
        self._wake.set()

    async def _load_leftovers(self) -> None:
        self._leftovers_due = False
        self._leftovers = await asyncio.to_thread(self.leftovers.all)
        self._fold_leftovers()

    def _fold_leftovers(self) -> None:
        """Each leftover's cause on the native devices of its hardware (a form's taint is its native
        device's: a GPU's MIG instance left behind taints the GPU, and so every form of it)."""
        causes: dict[str, str] = {}
        for lo in self._leftovers:
            for name in self._leftover_devices(lo):
                detail = f"claim {lo.claim} ({lo.uid}) left host changes on {', '.join(lo.devices)}: {lo.reason}"
                causes[name] = f"{causes[name]}; {detail}" if name in causes else detail
        self.conditions.undo_failed(causes)

    def _leftover_devices(self, lo: Leftover) -> set[str]:
        names = {native for bus in lo.functions if (native := self._bus_native.get(bus)) is not None}
        for device in lo.devices if not names else ():
            dev = self.inventory.get(device) or self._last_seen.get(device)
            names.add(_native_of(dev, self._bus_native) if dev is not None else device)
        return names

    def _cleared(self, device: str, causes: list[Cause]) -> None:
        """An operator cleared the device: the leftovers its undo-failed cause stood for go with it (the
        operator has undone them, or takes the device as it is)."""
        if not any(c.kind == UNDO_FAILED for c in causes):
            return
        for lo in self._leftovers:
            if device in self._leftover_devices(lo) and self.leftovers.remove(lo.uid):
                log.warning("%s: an operator cleared it: claim %s (%s)'s host changes on %s are no longer "
                            "tracked (%s)", device, lo.claim, lo.uid, ", ".join(lo.devices), lo.reason)
        self._leftovers = [lo for lo in self._leftovers if device not in self._leftover_devices(lo)]

    def gpu_event(self, event: GpuEvent) -> None:
        if isinstance(event, XidError):
            self.conditions.xid(event.device, event.xid, event.recovery_action.value, at=event.at.timestamp())
        elif isinstance(event, DoubleBitEcc):
            self.conditions.xid(event.device, DOUBLE_BIT_ECC_XID, event.recovery_action.value,
                                at=event.at.timestamp())
        elif isinstance(event, GpuLost):
            self._rescan.add("gpu")
            self.conditions.gpu_lost(event.device, event.reason)
        elif isinstance(event, GpuAnswering):
            self._rescan.add("gpu")
            self.conditions.gpu_answering(event.device, event.recovery_action.value)
            self._wake.set()
        elif isinstance(event, GpuBaseline):
            self.conditions.baseline(event.device, event.uuid, event.recovery_action.value)
        elif isinstance(event, NvmlLost):
            self.conditions.nvml_lost(self._gpus(), event.reason)
        elif isinstance(event, NvmlBack):
            self._rescan.add("gpu")  # the scans failed meanwhile: the GPUs as NVML says them now
            self.conditions.nvml_back()
            self._wake.set()

    @property
    def nvml_up(self) -> bool | None:
        """Whether NVML answered the GPU event watcher's latest probe (None: no NVML, or not probed yet)."""
        return None if self.gpu_events is None else self.gpu_events.nvml_up

    def _gpus(self) -> set[str]:
        """The GPUs discovery has, each named by its native device (a form whose whole GPU is not published,
        as in MIG mode, by its own name)."""
        snapshot = self.inventory.snapshot()
        natives = self._natives(snapshot)
        return {_native_of(dev, natives) for dev in snapshot.devices.values()
                if isinstance(dev.node, GpuFacts)
                or (isinstance(dev.node, PassthroughFacts) and dev.node.native is Kind.GPU)}

    # -- outputs ----------------------------------------------------------------------------------

    def published(self, snapshot: Snapshot) -> list[Device]:
        """The devices to publish: the inventory's, with their taints, and lost GPUs and their forms
        as last seen."""
        out = []
        remembered = self._remembered(snapshot)
        aliases = self.aliases(snapshot)
        for name in sorted({*snapshot.devices, *remembered}):
            dev = snapshot.devices.get(name) or remembered[name]
            native = aliases.get(name, name)
            taints = self.conditions.taints(native)
            if self.holds is not None:
                taints += self.holds.taints(native)
            out.append(dataclasses.replace(dev, taints=[*dev.taints, *taints]) if taints else dev)
        return out

    def get(self, name: str) -> Device | None:
        """The device as published: the inventory's, or a lost GPU or one of its forms as last seen
        (so the status of a claim holding it says GpuLost, not that the device is missing)."""
        if (dev := self.inventory.get(name)) is not None:
            return dev
        seen = self._last_seen.get(name)
        return seen if seen is not None and _native_of(seen, self._bus_native) in self._lost() else None

    def aliases(self, snapshot: Snapshot) -> dict[str, str]:
        """Passthrough variant, MIG, vGPU or shared device -> its native device (same PCI function): a form
        of a GPU is the same hardware, so it carries the native device's taints and health. A GPU
        that is lost is found by its last-seen form; its own forms, gone from discovery with it, are
        named too (published from memory: the health stream reports them with the GPU's health)."""
        natives = self._natives(snapshot)
        devices = {**self._remembered(snapshot), **snapshot.devices}
        return {name: native for name, dev in devices.items()
                if (native := _native_of(dev, natives)) != name}

    def readiness(self, device: Device) -> Readiness:
        """For the claim status writer (`agent.health.statusentry.DeviceReadiness`): a form of a GPU is as
        ready as its GPU."""
        own = self.conditions.readiness(device.name)
        return own if not own.ready else self.conditions.readiness(_native_of(device, self._bus_native))

    def with_forms(self, names: set[str]) -> set[str]:
        """`names` and every form of them, present or remembered (the claims holding a form of a GPU
        follow the GPU's conditions)."""
        snapshot = self.inventory.snapshot()
        natives = self._natives(snapshot)
        devices = {**self._remembered(snapshot), **snapshot.devices}
        return names | {name for name, dev in devices.items() if _native_of(dev, natives) in names}

    # -- what is remembered -----------------------------------------------------------------------

    def _lost(self) -> set[str]:
        return {c.device for c in self.conditions.causes() if c.kind == GPU_LOST}

    def _natives(self, snapshot: Snapshot | None = None) -> dict[str, str]:
        """PCI bus ID -> the native device there, among the devices seen (and `snapshot`'s)."""
        native: dict[str, str] = {}
        for name, dev in (*self._last_seen.items(), *(snapshot.devices.items() if snapshot else ())):
            if not dev.kind.form and (bus := dev.pci_bus_id):
                native[bus] = name
        return native

    def _remembered(self, snapshot: Snapshot) -> dict[str, Device]:
        """Devices published from memory: lost GPUs, and their forms discovery no longer finds."""
        lost = self._lost()
        natives = self._natives(snapshot)
        return {name: dev for name, dev in self._last_seen.items()
                if name not in snapshot.devices and _native_of(dev, natives) in lost}

    # -- the loop ---------------------------------------------------------------------------------

    def _note(self, devices: set[str]) -> None:
        self._dirty |= devices
        self._wake.set()

    async def _run(self) -> None:
        while True:
            deadline = self.conditions.next_deadline()
            timeout = IDLE_WAKE if deadline is None else min(IDLE_WAKE, max(0.0, deadline - time.time()))
            # `asyncio.timeout`, not `wait_for`: Python 3.11's wait_for swallows a cancellation that comes
            # as the wake-up does, and `stop` would then wait for a task that goes on looping.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            self.conditions.tick()
            if self._leftovers_due:
                try:
                    await self._load_leftovers()
                except Exception:
                    log.exception("reading the leftover host changes failed")
            if not self._dirty and not self._rescan:
                continue
            devices, self._dirty = self.with_forms(self._dirty), set()
            kinds, self._rescan = self._rescan, set()
            try:
                await self._changed_cb(devices, kinds)
            except Exception:
                log.exception("applying the device conditions of %s failed", ", ".join(sorted(devices)))


def _native_of(device: Device, natives: dict[str, str]) -> str:
    """The name of the native device `device` is a form of (the one on the PCI function its facts name:
    a GPU form's GPU, a passthrough variant's function), or its own name."""
    if device.kind.form and (native := natives.get(device.pci_bus_id)) is not None:
        return native
    return device.name

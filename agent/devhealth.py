"""The running agent's device health: events in, taints, health stream and claim readiness out.

`DeviceHealthService` owns the device conditions (`agent.conditions`) and everything that
feeds them while the agent runs:
- each inventory snapshot: the link state of every NIC (`observe`);
- the GPU event watcher's events (XIDs, lost and answering GPUs), handed over from its
  thread (`gpu_event`);
- operators' clear requests (`agent.taintctl.RequestWatcher`);
- time: informational XID taints expiring, link taints held until the link stays up.

When the causes of devices change it calls the daemon's `changed(devices)` once per burst,
which republishes the slices (`published` lays the taints over the inventory's devices),
updates the health stream and re-applies the status of the claims holding those devices.

A GPU that is lost drops out of discovery (no NVML call about it answers). While its
`gpu-lost` cause lasts, the device is still published as it was last seen, tainted
(NoExecute by default), so the scheduler and the eviction controller see it; a restarted
agent that never saw the GPU answer cannot publish it and reports it UNHEALTHY only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from agent.conditions import GPU_LOST, DeviceConditions, Readiness
from agent.config import Settings
from agent.inventory import Snapshot
from agent.model import Device
from agent.taintctl import RequestWatcher, health_dir, requests_dir
from agent.taintpolicy import TaintPolicy, load_policy

log = logging.getLogger(__name__)

# The longest the service sleeps between looks at the clock when nothing is due (a bound, so a
# wall-clock jump cannot leave a held link taint for long).
IDLE_WAKE = 30.0


class DeviceHealthService:
    def __init__(self, settings: Settings, changed: Callable[[set[str]], Awaitable[None]],
                 policy: TaintPolicy | None = None) -> None:
        self.settings = settings
        self.conditions = DeviceConditions(settings.driver_name,
                                           policy if policy is not None else load_policy(settings.taint_policy),
                                           health_dir(settings))
        self.conditions.on_change = self._note
        self._changed_cb = changed
        self.requests = RequestWatcher(requests_dir(settings), self.conditions)
        self._last_seen: dict[str, Device] = {}
        self._nics: set[str] = set()
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self.conditions.load)
        await asyncio.to_thread(self.conditions.save)  # `dra-agent taints` tells "none" from "no agent"
        try:
            await self.requests.start()
        except OSError as exc:  # out of inotify watches: listing works, clearing waits for a restart
            log.warning("taint clear requests are not watched: %s", exc)
        self._task = asyncio.create_task(self._run(), name="device-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.requests.stop()

    # -- inputs -----------------------------------------------------------------------------------

    def observe(self, snapshot: Snapshot) -> None:
        """Fold in a new inventory snapshot: remember devices as last seen, and NIC link states."""
        nics = set()
        for name, dev in snapshot.devices.items():
            self._last_seen[name] = dev
            if dev.kind == "nic":
                nics.add(name)
                self.conditions.link(name, dev.attributes.get("linkUp") is True)
        gone = self._nics - nics
        if gone:
            self.conditions.forget(gone)
        self._nics = nics
        # Forget devices gone for good, except lost GPUs that are still published from memory.
        lost = {c.device for c in self.conditions.causes() if c.kind == GPU_LOST}
        for name in set(self._last_seen) - set(snapshot.devices) - lost:
            del self._last_seen[name]

    def xid(self, device: str, xid: int, action: str) -> None:
        self.conditions.xid(device, xid, action)

    def gpu_lost(self, device: str, reason: str) -> None:
        self.conditions.gpu_lost(device, reason)

    def gpu_answering(self, device: str, action: str) -> None:
        self.conditions.gpu_answering(device, action)

    # -- outputs ----------------------------------------------------------------------------------

    def published(self, snapshot: Snapshot) -> list[Device]:
        """The devices to publish: the inventory's, with their taints, and lost GPUs as last seen."""
        out = []
        names = set(snapshot.devices)
        names |= {c.device for c in self.conditions.causes() if c.kind == GPU_LOST and c.device in self._last_seen}
        for name in sorted(names):
            dev = snapshot.devices.get(name) or self._last_seen[name]
            taints = self.conditions.taints(name)
            out.append(dataclasses.replace(dev, taints=[*dev.taints, *taints]) if taints else dev)
        return out

    def readiness(self, device: str) -> Readiness:
        return self.conditions.readiness(device)

    # -- the loop ---------------------------------------------------------------------------------

    def _note(self, devices: set[str]) -> None:
        self._dirty |= devices
        self._wake.set()

    async def _run(self) -> None:
        while True:
            deadline = self.conditions.next_deadline()
            timeout = IDLE_WAKE if deadline is None else min(IDLE_WAKE, max(0.0, deadline - time.time()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            self.conditions.tick()
            if not self._dirty:
                continue
            devices, self._dirty = self._dirty, set()
            try:
                await self._changed_cb(devices)
            except Exception:
                log.exception("applying the device conditions of %s failed", ", ".join(sorted(devices)))

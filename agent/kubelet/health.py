"""Device health as the kubelet's health stream reports it.

HEALTHY: the device is in the inventory and answering, with no cause that taints
it beyond effect None (an application's XID leaves it healthy, with a message).
UNHEALTHY: a device condition taints it (an XID, a lost GPU, a link down: the
message names the cause, `agent.health.conditions`), or discovery knows it by name but
could not read it (an NVML call failing), or it was seen before and is gone now.
UNKNOWN: the device is
still published from its source's last good scan, but that source has failed
for longer than the inventory's bound (`agent.inventory.STALE_AFTER`).
Only device names are ever reported: failures that name no device (an
interface that cannot be identified, a GPU without a minor number) are the
inventory's `problems`, not devices of the pool. Watchers get the complete
list on connect, on every change, and at least every `interval` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from agent.health.conditions import DeviceConditions
from agent.inventory import Snapshot

HEALTHY = "HEALTHY"
UNHEALTHY = "UNHEALTHY"
UNKNOWN = "UNKNOWN"
MAX_MESSAGE = 1024


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    device: str
    status: str
    message: str
    since: int  # unix seconds of the last change of status or message


def _clip(message: str) -> str:
    data = message.encode()
    if len(data) <= MAX_MESSAGE:
        return message
    return data[: MAX_MESSAGE - 3].decode(errors="ignore") + "..."


class HealthTracker:
    def __init__(self, pool: str, interval: float = 30.0, timeout_seconds: int = 90) -> None:
        self.pool = pool
        self.interval = interval
        self.timeout_seconds = timeout_seconds
        self._state: dict[str, DeviceHealth] = {}
        self._version = 0
        self._changed = asyncio.Condition()
        self.watchers = 0  # streams open now (metrics)

    def current(self) -> list[DeviceHealth]:
        return [self._state[k] for k in sorted(self._state)]

    async def update(self, snapshot: Snapshot, conditions: DeviceConditions | None = None,
                     aliases: Mapping[str, str] | None = None) -> bool:
        """Fold in a new inventory snapshot and the device conditions; True (and watchers woken)
        when anything changed. `aliases`: devices that are another device's hardware (a
        passthrough variant, a MIG placement -> its native device), reported with that device's
        health; those it names beyond the snapshot's are a lost GPU's forms, still published as
        last seen (`agent.health.service`)."""
        now = int(time.time())
        new: dict[str, DeviceHealth] = {}
        failed = {f.device: f.reason for f in snapshot.failed_devices}
        aliases = aliases or {}
        for name in [*snapshot.devices, *(n for n in aliases if n not in snapshot.devices)]:
            source = aliases.get(name, name)
            verdict = conditions.health(source) if conditions is not None else None
            if source != name and source in failed:
                lost = f"{verdict[1]}; {failed[source]}" if verdict else failed[source]
                new[name] = self._keep(name, UNHEALTHY, _clip(f"{source}: {lost}"), now)
            elif verdict is not None and not verdict[0]:
                new[name] = self._keep(name, UNHEALTHY, _clip(verdict[1]), now)
            elif (why := snapshot.unknown.get(name)) is not None:
                new[name] = self._keep(name, UNKNOWN, _clip(why), now)
            else:
                new[name] = self._keep(name, HEALTHY, _clip(verdict[1]) if verdict else "", now)
        for failure in snapshot.failed_devices:
            if failure.device not in new:
                verdict = conditions.health(failure.device) if conditions is not None else None
                why = f"{verdict[1]}; {failure.reason}" if verdict else failure.reason
                new[failure.device] = self._keep(failure.device, UNHEALTHY, _clip(why), now)
        for name, old in self._state.items():
            if name not in new:
                msg = old.message if old.status == UNHEALTHY else "device is no longer found on this node"
                new[name] = self._keep(name, UNHEALTHY, msg, now)
        if new == self._state:
            return False
        self._state = new
        async with self._changed:
            self._version += 1
            self._changed.notify_all()
        return True

    def _keep(self, name: str, status: str, message: str, now: int) -> DeviceHealth:
        old = self._state.get(name)
        if old is not None and old.status == status and old.message == message:
            return old
        return DeviceHealth(name, status, message, now)

    def _newer_than(self, version: int) -> Callable[[], bool]:
        return lambda: self._version != version

    async def watch(self) -> AsyncIterator[list[DeviceHealth]]:
        """The full list now, then on every change and at least every `interval` seconds."""
        seen = -1
        self.watchers += 1
        try:
            while True:
                async with self._changed:
                    if seen == self._version:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._changed.wait_for(self._newer_than(seen)), self.interval)
                    seen = self._version
                    devices = self.current()
                yield devices
        finally:
            self.watchers -= 1

"""Device health as the kubelet's health stream reports it.

HEALTHY: the device is in the inventory and answering, with no cause that taints
it beyond effect None (an application's XID leaves it healthy, with a message).
UNHEALTHY: a device condition taints it (an XID, a lost GPU, a link down: the
message names the cause, `agent.health.conditions`), or discovery knows it by name but
could not read it (an NVML call failing), or it was reported before and discovery no
longer finds it (see below).
UNKNOWN: the device is still published from its source's last good scan, but that
source has failed for longer than the inventory's bound (`agent.inventory.STALE_AFTER`).
Only device names are ever reported: failures that name no device (an
interface that cannot be identified, a GPU without a minor number) are the
inventory's `problems`, not devices of the pool.

What the kubelet (1.37) does with a report decides the rest. It stamps each reported device
with the time it received it and reads a device as Unknown once that is older than the
device's `health_check_timeout_seconds` (30 s when 0); a device left out of a report is kept
until its timeout, then turns Unknown and is dropped. So:
- every report is the complete list: every device, changed or not;
- every device carries `timeout_seconds` (`HEALTH_TIMEOUT`), and the list is sent again at
  least every `interval` seconds (a third of the timeout), so a device the agent still
  reports never decays to Unknown, even when one or two sends come late;
- a device discovery no longer finds is reported UNHEALTHY ("no longer found", or the
  cause it was UNHEALTHY for) for as long as the published pool may still hold it: until a
  publish of a pool without it has completed (`pool_published`). Only then is it left out,
  and the kubelet turns it Unknown one timeout later and forgets it: the list stays bounded
  by what the node has, and a device never silently disappears while the scheduler can
  still see it.
Watchers get the list on connect, on every change, and at least every `interval` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass

from agent.health.conditions import DeviceConditions
from agent.inventory import Snapshot

HEALTHY = "HEALTHY"
UNHEALTHY = "UNHEALTHY"
UNKNOWN = "UNKNOWN"
MAX_MESSAGE = 1024
# `health_check_timeout_seconds` of every device: a stalled agent (its socket open, its loop
# stuck) shows as Unknown within a minute, and three sends fit in each timeout.
HEALTH_TIMEOUT = 60
RESENDS_PER_TIMEOUT = 3
GONE = "device is no longer found on this node"


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
    def __init__(self, pool: str, timeout_seconds: int = HEALTH_TIMEOUT, interval: float | None = None) -> None:
        """`timeout_seconds`: sent on every device; `interval`: the longest between two sends (a
        third of the timeout unless given), which must be shorter than the timeout."""
        interval = timeout_seconds / RESENDS_PER_TIMEOUT if interval is None else interval
        if timeout_seconds < 1 or not 0 < interval < timeout_seconds:
            raise ValueError(f"the health stream must be resent ({interval} s) within its timeout "
                             f"({timeout_seconds} s)")
        self.pool = pool
        self.interval = interval
        self.timeout_seconds = timeout_seconds
        self._state: dict[str, DeviceHealth] = {}
        self._gone: set[str] = set()  # no longer discovered: reported until the published pool drops them
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
        self._gone -= set(new)  # back again
        for name, old in self._state.items():
            if name not in new:
                msg = old.message if old.status == UNHEALTHY else GONE
                new[name] = self._keep(name, UNHEALTHY, msg, now)
                self._gone.add(name)
        if new == self._state:
            return False
        self._state = new
        async with self._changed:
            self._version += 1
            self._changed.notify_all()
        return True

    def pool_published(self, names: Collection[str]) -> None:
        """A publish of the pool holding `names` completed: devices no longer discovered and not in
        it are left out of the reports from now on (the kubelet turns them Unknown one timeout
        later, then forgets them)."""
        retired = self._gone - set(names)
        for name in retired:
            del self._state[name]
        self._gone -= retired

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

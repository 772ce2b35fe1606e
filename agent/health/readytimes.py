"""The `Ready` condition of each prepared device in a claim's status, and when it last changed.

A condition's `lastTransitionTime` moves only when its status does. Within one process that is
memory: each (claim, device, share) whose Ready status changed since the prepare keeps its status
and time. A first Ready=True dates from the prepare (the record's `prepared_at`) and is not kept:
it is the same on every write until a change, and 10,000 prepared claims would hold 10,000 of them.

Across a restart the memory is gone, but the API server still holds what was written. An agent that
stopped in order left what it wrote and the transitions it kept (`agent.health.statuswritten`), and the
next start restores them (`restore`). The conditions of any other claim prepared before this process
started are read back (`StatusSink.read`) before its first write, and a stored time is kept while the
status stays the same. Without that,
a restart dated a Ready that had gone False and back again from the prepare (backwards in time),
and a Ready still False from the restart (forwards). A claim prepared by this process needs no
reading: nothing but this process wrote its status.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.claims.book import ClaimSummary, DeviceSummary
from agent.health.conditions import Readiness

READY = "Ready"


@dataclass(frozen=True, slots=True)
class Transition:
    status: str
    time: str


def rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ReadyTransitions:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.started = clock()
        self._kept: dict[tuple[str, str, str], Transition] = {}  # (uid, device, share) -> since the last change
        self._read: set[str] = set()  # claims prepared before the start whose stored conditions were read

    def unread(self, record: ClaimSummary) -> bool:
        """Whether the claim's stored conditions must be read (`learn`) before its entries are built."""
        return record.prepared_at < self.started and record.uid not in self._read

    def learn(self, record: ClaimSummary, stored: Sequence[Mapping[str, Any]]) -> None:
        """Take the Ready conditions of the claim's entries as the API server holds them now."""
        self._read.add(record.uid)
        first = rfc3339(record.prepared_at)
        prepared = {(d.device, d.share_id) for d in record.devices}
        for entry in stored:
            key = (record.uid, str(entry.get("device", "")), str(entry.get("shareID") or ""))
            ready = next((c for c in entry.get("conditions") or [] if c.get("type") == READY), None)
            if key[1:] not in prepared or key in self._kept or ready is None:
                continue
            status, when = str(ready.get("status", "")), str(ready.get("lastTransitionTime") or "")
            if when and not (status == "True" and when == first):  # (what a first True gets anyway)
                self._kept[key] = Transition(status, when)

    def kept_of(self, record: ClaimSummary) -> tuple[tuple[str, str, Transition], ...]:
        """The claim's kept transitions, (device, share, transition) each: what the next start restores."""
        return tuple((d.device, d.share_id, t) for d in record.devices
                     if (t := self._kept.get((record.uid, d.device, d.share_id))) is not None)

    def restore(self, uid: str, kept: Iterable[tuple[str, str, Transition]]) -> None:
        """The transitions a run before this one kept of a claim whose entries it wrote (so the API server holds
        what they date): its stored conditions need no reading then."""
        self._read.add(uid)
        for device, share, transition in kept:
            self._kept[(uid, device, share)] = transition

    def forget(self, record: ClaimSummary) -> None:
        """The claim was unprepared. The keys are its devices: O(devices), not a scan of every claim's."""
        self._read.discard(record.uid)
        for d in record.devices:
            self._kept.pop((record.uid, d.device, d.share_id), None)

    def condition(self, record: ClaimSummary, d: DeviceSummary, ready: Readiness) -> dict[str, Any]:
        status = "True" if ready.ready else "False"
        key = (record.uid, d.device, d.share_id)
        last = self._kept.get(key)
        if last is None and ready.ready and record.prepared_at:
            when = rfc3339(record.prepared_at)
        elif last is None or last.status != status:
            # Any later change (or a first False) dates from now.
            last = self._kept[key] = Transition(status, rfc3339(self.clock()))
            when = last.time
        else:
            when = last.time
        return {"type": READY, "status": status, "reason": ready.reason, "message": ready.message,
                "lastTransitionTime": when}

"""A claim record set aside (`PrepareEngine.set_aside`: unreadable, or saying what the agent never writes),
reported where operators look:
a Warning Event `ClaimRecordQuarantined` on the Node (in a cluster), beside the log line, the
`dra_agent_records_quarantined_total` counter and the `claim-records` line of /readyz (`agent.app.probes`).
Offline there is no API server to hold an Event: the log says so."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.app.connection import Connection
    from agent.config import Settings
    from agent.engine.prepare import Quarantined
    from agent.events import NodeEvent, NodeEvents

log = logging.getLogger(__name__)

REASON = "ClaimRecordQuarantined"


def event_of(q: Quarantined) -> NodeEvent:
    from agent.events import NodeEvent

    return NodeEvent(REASON, "SetAside", f"the record of claim UID {q.uid} cannot be used ({q.reason}): it is set "
                     f"aside as {q.path}, the claim's CDI specs and metadata files are removed, and the claim is no "
                     "longer prepared on this node")


class QuarantineReporter:
    """`PrepareEngine.on_quarantine` of the running agent: called from the worker thread that set a record
    aside, it posts the Event from the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: Connection, settings: Settings) -> None:
        self.loop = loop
        self.node = settings.node_name
        self.conn = conn
        self.events: NodeEvents | None = None
        if conn.client is not None:  # (offline the API client, which the Events need, is never loaded)
            from agent.events import NodeEvents

            self.events = NodeEvents(conn.client, settings.node_name, conn.node.uid if conn.node is not None else "",
                                     settings.driver_name)
        self._tasks: set[asyncio.Task[bool]] = set()

    def __call__(self, q: Quarantined) -> None:
        self.loop.call_soon_threadsafe(self.report, q)

    def report(self, q: Quarantined) -> None:
        if self.events is None:
            log.warning("claim record set aside as %s: offline (%s), so no Event is posted on node %s",
                        q.path, self.conn.mode, self.node)
            return
        task = self.loop.create_task(self.events.post(event_of(q)), name=f"event {REASON}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Wait briefly for Events being posted (a record set aside just before a stop is still reported)."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        for task in self._tasks:
            task.cancel()

"""Writes to sysfs binding files that cannot hold the process: each runs in a thread of its own and is
waited for within a bound.

A write to `drivers/<driver>/unbind` returns when the driver has let go of the function, and the NVIDIA
driver does not let go of a GPU while any process has it open: the write blocks in the kernel until the
last one closes it, for as long as that takes. The agent checks for such processes first, but one may
open the GPU between the check and the write (or be out of the agent's sight), so every binding write
is made in a thread (`write`) and waited for until the step's deadline. A write that has not returned
by then is left to the kernel and the step fails; the function is marked outstanding, and any later
step about it (a retry, the rollback) first waits for that write (`wait_outstanding`): once it returns
and its effect shows, the function's state is read afresh; while it does not, the step fails with
`WritePending`, so nothing is stacked on a write the kernel may still carry out. An unbind whose write
returned but whose effect has not shown by the deadline (the simulated kernel applies writes a moment
after them, and holds an NVIDIA unbind until the GPU is closed) is outstanding the same way until it
shows. Blocking; the table is process-wide. A thread waiting for a write lets its claim slot go
meanwhile (`agent.workslots`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.host.vfio.errors import WritePending
from agent.workslots import PATIENCE, wait_until, waiting

log = logging.getLogger(__name__)

POLL = 0.01


@dataclass
class Write:
    """One write to a sysfs file, made in its own thread."""

    what: str  # the step it makes, for messages
    path: Path
    shown: Callable[[], bool]  # whether its effect shows in sysfs
    since: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    error: OSError | None = None

    def settled(self) -> bool:
        """Returned, and refused or in effect."""
        return self.done.is_set() and (self.error is not None or self.shown())


_TABLE = threading.Lock()
# (sysfs root, function) -> a write about it not known to have taken effect
_OUTSTANDING: dict[tuple[str, str], Write] = {}


def write(what: str, path: Path, text: str, shown: Callable[[], bool], deadline: float) -> Write:
    """Start writing `text` to `path` (the whole value in one write(), as the kernel parses it) and wait
    until it returns or `deadline` (time.monotonic()) passes; the write, returned or not."""
    w = Write(what, path, shown)

    def run() -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            w.error = exc
        finally:
            w.done.set()
            if time.monotonic() > deadline:  # left to the kernel by the step that made it
                log.info("%s: the write to %s returned after %.1fs (%s)", what, path, time.monotonic() - w.since,
                         w.error.strerror if w.error is not None else "accepted")

    threading.Thread(target=run, name=f"sysfs write: {what}", daemon=True).start()
    if not w.done.wait(min(PATIENCE, max(0.0, deadline - time.monotonic()))):
        with waiting():
            w.done.wait(max(0.0, deadline - time.monotonic()))
    return w


def mark_outstanding(sysfs: Path, bdf: str, w: Write) -> None:
    with _TABLE:
        _OUTSTANDING[str(sysfs), bdf] = w


def outstanding(sysfs: Path, bdf: str) -> Write | None:
    with _TABLE:
        return _OUTSTANDING.get((str(sysfs), bdf))


def wait_outstanding(sysfs: Path, bdf: str, deadline: float) -> None:
    """Before a step about `bdf`: wait (until `deadline`) for an outstanding write about it to settle;
    WritePending when it has not."""
    w = outstanding(sysfs, bdf)
    if w is None:
        return
    if not wait_until(w.settled, deadline, POLL):
        state = "has not returned" if not w.done.is_set() else "returned, but has not taken effect"
        raise WritePending(f"{bdf}: an earlier {w.what} ({time.monotonic() - w.since:.0f}s ago) {state}: the "
                           "driver is waiting (the NVIDIA driver finishes an unbind only once every process "
                           f"has closed the GPU); nothing more is done to {bdf} until it has")
    with _TABLE:
        if _OUTSTANDING.get((str(sysfs), bdf)) is w:
            del _OUTSTANDING[str(sysfs), bdf]
    log.info("%s: the earlier %s has settled (%s)", bdf, w.what,
             f"refused: {w.error.strerror}" if w.error is not None else "in effect")

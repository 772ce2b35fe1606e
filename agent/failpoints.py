"""Named points in the claim operations where tests inject a crash, an error or a delay.

`DRA_AGENT_FAILPOINTS="after-metadata-file=kill,after-record=raise"` makes the process
die (SIGKILL, as in a power cut or an OOM kill) or raise at those steps, and
`after-claim-spec=sleep:0.5` makes it pause there (a slow disk). `after-claim-spec=pause` holds
the thread that reaches the step until the test lets it go (`release`, or the next `configure`),
and says so (`wait_paused`): an in-process test knows the operation is exactly there (a kubelet
deadline passing mid-prepare) instead of guessing with a sleep. `*@7=kill` kills the process at
the 7th step reached, whichever it is: the crash suite (`make stress`) draws that number at
random. The crash tests thus exercise the same code that runs in production. Unset, `hit()` is
one lookup.

The steps: prepare `after-claim-spec`, `after-metadata-file`, `after-metadata-spec`,
`after-record`; unprepare `unprepare-after-record`, `unprepare-after-file`; metadata
refresh `refresh-after-record`, `refresh-after-metadata-file`. Passthrough (VFIO) devices
add, in prepare, `after-bind-intent` and around every binding step `bind-before-step` (its
"step k is next" record written) and `bind-after-step`, and for a VF whose MAC or VLAN the
claim sets `vf-before-set` / `vf-after-set` (before its first step); in unprepare
`unprepare-after-restore-intent`, `vf-before-restore` / `vf-after-restore` (the VF's MAC and VLAN
put back, before its first step) and `restore-before-step` / `restore-after-step`. MIG partitions
(`agent.hostprep.mig`) add, in prepare, `mig-before-<step>` (its "step is next" record written) and
`mig-after-<step>` for the steps `mode`, `gpu-instance`, `compute-instance` and `uuid`, and in
unprepare `mig-destroy-after-ci` and `mig-destroy-after-gi`. The check of a prepared record against
the host (`agent.engine.recheck`, at start-up and when a prepare is answered from a record) adds
`recheck-after-record`: the record that says what the devices are now is written, its files not yet.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Callable

_ACTIONS: dict[str, str] = {}
# Called with the step's name just before a `kill` (the crash suite counts where its kills land).
before_kill: Callable[[str], None] | None = None
_NTH: dict[int, str] = {}  # `*@N`: the action at the N-th step reached, counted from configure()
_counter = itertools.count(1)
_count_lock = threading.Lock()
# A pause nobody releases (a test that failed before it could) lets its thread go after this long,
# failing the step, so a broken test never hangs the suite.
PAUSE_LIMIT = 120.0


class FailpointError(RuntimeError):
    pass


class _Pause:
    """The threads held at one step: how many arrived, and whether the step is open again."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.arrived = 0
        self.open = False


_PAUSES: dict[str, _Pause] = {}
_pauses_lock = threading.Lock()


def _pause_of(name: str) -> _Pause:
    with _pauses_lock:
        return _PAUSES.setdefault(name, _Pause())


def _check_action(item: str, action: str) -> None:
    if action in ("kill", "raise", "pause"):
        return
    if action.startswith("sleep:"):
        try:
            if float(action[len("sleep:"):]) >= 0:
                return
        except ValueError:
            pass
    raise ValueError(f"failpoint {item!r}: action must be kill, raise, pause or sleep:SECONDS")


def configure(spec: str) -> None:
    global _counter
    with _pauses_lock:
        held = list(_PAUSES.values())
        _PAUSES.clear()
    for pause in held:  # a new configuration never strands a thread held by the old one
        with pause.cond:
            pause.open = True
            pause.cond.notify_all()
    _ACTIONS.clear()
    _NTH.clear()
    _counter = itertools.count(1)
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, action = item.partition("=")
        _check_action(item, action)
        if name.startswith("*@"):
            try:
                _NTH[int(name[2:])] = action
            except ValueError:
                raise ValueError(f"failpoint {item!r}: *@ takes a step number") from None
        else:
            _ACTIONS[name] = action


def hit(name: str) -> None:
    if not _ACTIONS and not _NTH:
        return
    action = _ACTIONS.get(name)
    if _NTH:
        with _count_lock:
            n = next(_counter)
        action = _NTH.get(n, action)
    if action is None:
        return
    if action == "kill":
        if before_kill is not None:
            before_kill(name)
        os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("sleep:"):
        time.sleep(float(action[len("sleep:"):]))
        return
    if action == "pause":
        _hold(name)
        return
    raise FailpointError(f"failpoint {name}")


def _hold(name: str) -> None:
    pause = _pause_of(name)
    with pause.cond:
        pause.arrived += 1
        pause.cond.notify_all()
        if not pause.cond.wait_for(lambda: pause.open, PAUSE_LIMIT):
            raise FailpointError(f"failpoint {name}: paused {PAUSE_LIMIT:g}s and never released")


def wait_paused(name: str, count: int = 1, timeout: float = 60.0) -> None:
    """Block until `count` threads in all have reached the paused step `name` (TimeoutError if they
    have not within `timeout` seconds). Blocking: from a coroutine, run it with asyncio.to_thread."""
    pause = _pause_of(name)
    with pause.cond:
        if not pause.cond.wait_for(lambda: pause.arrived >= count, timeout):
            raise TimeoutError(f"failpoint {name}: {pause.arrived} of {count} threads arrived in {timeout:g}s")


def release(name: str) -> None:
    """Let the threads held at `name` go on; later arrivals pass straight through."""
    pause = _pause_of(name)
    with pause.cond:
        pause.open = True
        pause.cond.notify_all()


configure(os.environ.get("DRA_AGENT_FAILPOINTS", ""))

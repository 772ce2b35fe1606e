"""Named points in the prepare path where tests can inject a crash.

`DRA_AGENT_FAILPOINTS="metadata-file=kill,record=raise"` makes the process die
(SIGKILL, as in a power cut or OOM kill) or raise at those steps, so the crash
tests exercise the same binary that runs in production. Unset, `hit()` is a
dictionary lookup.
"""

from __future__ import annotations

import os
import signal

_ACTIONS: dict[str, str] = {}


class FailpointError(RuntimeError):
    pass


def configure(spec: str) -> None:
    _ACTIONS.clear()
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, action = item.partition("=")
        if action not in ("kill", "raise"):
            raise ValueError(f"failpoint {item!r}: action must be kill or raise")
        _ACTIONS[name] = action


def hit(name: str) -> None:
    action = _ACTIONS.get(name)
    if action is None:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise FailpointError(f"failpoint {name}")


configure(os.environ.get("DRA_AGENT_FAILPOINTS", ""))

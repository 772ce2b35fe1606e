"""The taint requests an operator's `dra-agent taints clear` leaves for the running agent, and the
agent's side of that channel.

Clearing is a request file in `<state dir>/health/requests/`, written atomically; the agent watches
the directory (inotify, read on the event loop), applies each request in name order, writes what it
cleared beside it (`<request>.done`, read and removed by the CLI that asked, so it says exactly what
happened) and removes it. A request written while no agent runs is applied when one starts. Only the state
directory's owner (root on a node) can write there: no network endpoint can change a taint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from pathlib import Path

import orjson

from agent.config import Settings
from agent.fsutil import atomic_write, makedirs
from agent.health.conditions import DeviceConditions
from agent.inotify import Inotify
from agent.names import InvalidName, check_device_name

log = logging.getLogger(__name__)

HEALTH_DIR = "health"
REQUESTS_DIR = "requests"
REQUEST_SUFFIX = ".json"
RESULT_SUFFIX = ".done"
RESULT_KEEP = 60.0  # seconds a result no CLI read (it was killed while waiting) stays
CLEAR_WAIT = 5.0  # seconds the CLI waits for the running agent to apply a request


def health_dir(settings: Settings) -> Path:
    return settings.state_dir / HEALTH_DIR


def requests_dir(settings: Settings) -> Path:
    return health_dir(settings) / REQUESTS_DIR


# -- the request channel ---------------------------------------------------------------------------

def submit_clear(settings: Settings, device: str) -> Path:
    """Ask the agent to clear `device`'s XID taints; the request file's path."""
    check_device_name(device)
    directory = requests_dir(settings)
    makedirs(directory, 0o700)
    # Names sort in the order written: nanoseconds, then a random tie-breaker.
    path = directory / f"{time.time_ns():020d}-{secrets.token_hex(3)}{REQUEST_SUFFIX}"
    atomic_write(path, orjson.dumps({"action": "clear", "device": device}), mode=0o600)
    return path


def apply_requests(directory: Path, conditions: DeviceConditions) -> int:
    """Apply every request waiting in `directory`, oldest first; how many were applied."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(REQUEST_SUFFIX) and not n.startswith("."))
    except FileNotFoundError:
        return 0
    _remove_stale_results(directory)
    applied = 0
    for name in names:
        path = directory / name
        try:
            doc = orjson.loads(path.read_bytes())
            if not isinstance(doc, dict) or doc.get("action") != "clear":
                raise ValueError(f"unknown request {doc!r}")
            device = str(doc["device"])
            check_device_name(device)
        except FileNotFoundError:
            continue
        except (ValueError, KeyError, InvalidName, OSError) as exc:
            log.warning("taint request %s is not usable (%s): set aside as %s.bad", path, exc, name)
            with contextlib.suppress(OSError):
                os.replace(path, directory / f"{name}.bad")
            continue
        gone = conditions.clear(device, before=written_at(name))
        if not gone:
            log.info("taint request: %s has no XID taint to clear", device)
        try:  # before the request goes: the CLI reads it once the request is gone
            atomic_write(result_path(path), orjson.dumps({"device": device, "cleared": [c.detail for c in gone]}),
                         mode=0o600)
        except OSError as exc:
            log.warning("taint request %s: cannot write its result (%s)", path, exc)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        applied += 1
    return applied


def written_at(name: str) -> float | None:
    """When a request was written: its name starts with the nanoseconds (`submit_clear`)."""
    head = name.split("-", 1)[0]
    return int(head) / 1e9 if head.isdigit() else None


def result_path(request: Path) -> Path:
    return request.with_name(request.name + RESULT_SUFFIX)


def read_result(request: Path) -> list[str] | None:
    """What the agent cleared for `request` (the causes' details), removing the result; None when
    there is no readable result."""
    path = result_path(request)
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    cleared = doc.get("cleared") if isinstance(doc, dict) else None
    return [str(d) for d in cleared] if isinstance(cleared, list) else None


def _remove_stale_results(directory: Path) -> None:
    now = time.time()
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith(RESULT_SUFFIX):
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > RESULT_KEEP:
                        os.unlink(entry.path)


class RequestWatcher:
    """Applies taint requests as they appear (inotify), and those waiting at start."""

    def __init__(self, directory: Path, conditions: DeviceConditions) -> None:
        self.directory = directory
        self.conditions = conditions
        self._inotify: Inotify | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await asyncio.to_thread(makedirs, self.directory, 0o700)
        inotify = Inotify()
        try:
            await asyncio.to_thread(inotify.add, str(self.directory))
        except BaseException:
            inotify.close()
            raise
        self._inotify = inotify
        asyncio.get_running_loop().add_reader(inotify.fd, self._readable)
        self._wake.set()  # requests written while no agent ran
        self._task = asyncio.create_task(self._run(), name="taint-requests")

    def _readable(self) -> None:
        """(The event loop.) Events in the directory: what they are does not matter, the directory is read."""
        if self._inotify is not None:
            self._inotify.read()
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                apply_requests(self.directory, self.conditions)
            except Exception:
                log.exception("applying taint requests failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._inotify is not None:
            inotify, self._inotify = self._inotify, None
            asyncio.get_running_loop().remove_reader(inotify.fd)
            inotify.close()

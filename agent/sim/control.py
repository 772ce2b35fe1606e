"""The simulated machine's control channel: commands from outside the agent's process, as files.

`dra-agent sim xid|lose|recover DEVICE` (agent/app/simctl.py) writes one small JSON file per command
into `<state dir>/nvml-sim/control/`, atomically, named so that names sort in the order the
commands were written:

    {"command": "xid", "device": "gpu-3", "xid": 79}
    {"command": "lose", "device": "gpu-3"}
    {"command": "recover", "device": "gpu-3"}

A running simulated NVML watches the directory (inotify, `agent.inotify.WatchThread`), applies each command in
name order and deletes its file; the files already there when it starts watching are applied
then, so a command written while no agent runs waits for the next one. A file that cannot be
applied (not JSON, an unknown command or device, an XID out of range) is logged and renamed to
`<name>.bad`, never retried and never fatal. Temp files of the atomic writer are skipped.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, cast

import orjson

from agent.config import Settings
from agent.fsutil import is_temp_name, makedirs, unlink_quiet
from agent.inotify import WatchThread
from agent.sim.profiles import SimProfile

log = logging.getLogger(__name__)

CONTROL_DIR = "control"  # below the simulated machine's directory (`<state dir>/nvml-sim`)
BAD_SUFFIX = ".bad"
COMMANDS = ("xid", "lose", "recover")
XID_RANGE = range(1, 1000)

Action = Literal["xid", "lose", "recover"]



def control_dir(settings: Settings) -> Path:
    """Where the simulated machine of these settings takes its commands."""
    return settings.sim_root / CONTROL_DIR


class CommandError(ValueError):
    """A control command that cannot be applied, with why."""


@dataclass(frozen=True)
class SimCommand:
    command: Action
    device: str  # as published: gpu-<minor>
    xid: int | None = None  # for `xid` only
    # Unix seconds, read from the command file's name by the watcher (not in the file): an XID is as old
    # as the command that raised it, also when no agent ran then.
    written: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.command not in COMMANDS:
            raise CommandError(f"unknown command {self.command!r}; one of {', '.join(COMMANDS)}")
        if not self.device:
            raise CommandError("no device named")
        if self.command == "xid":
            if isinstance(self.xid, bool) or not isinstance(self.xid, int) or self.xid not in XID_RANGE:
                raise CommandError(f"XID must be an integer {XID_RANGE.start}..{XID_RANGE.stop - 1}, "
                                   f"not {self.xid!r}")
        elif self.xid is not None:
            raise CommandError(f"{self.command} takes no XID")

    def encode(self) -> bytes:
        body: dict[str, str | int] = {"command": self.command, "device": self.device}
        if self.xid is not None:
            body["xid"] = self.xid
        return orjson.dumps(body) + b"\n"

    @classmethod
    def decode(cls, data: bytes) -> SimCommand:
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise CommandError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise CommandError("not a JSON object")
        unknown = set(raw) - {"command", "device", "xid"}
        if unknown:
            raise CommandError(f"unknown keys {sorted(unknown)}")
        command, device, xid = raw.get("command"), raw.get("device"), raw.get("xid")
        if not isinstance(command, str) or not isinstance(device, str):
            raise CommandError("command and device must be strings")
        if command not in COMMANDS:
            raise CommandError(f"unknown command {command!r}; one of {', '.join(COMMANDS)}")
        if xid is not None and (isinstance(xid, bool) or not isinstance(xid, int)):
            raise CommandError(f"XID must be an integer, not {xid!r}")
        return cls(cast(Action, command), device, xid)


def device_index(profile: SimProfile, device: str) -> int:
    """The NVML index of the GPU published as `device` (`gpu-<minor>`) on the profile's machine."""
    for index, gpu in enumerate(profile.gpus):
        if f"gpu-{gpu.minor}" == device:
            return index
    names = ", ".join(f"gpu-{g.minor}" for g in profile.gpus) or "none"
    raise CommandError(f"no GPU {device!r} on the simulated machine {profile.name} (its GPUs: {names})")


def written_at(name: str) -> float | None:
    """When a command file was written: its name starts with the nanoseconds (None for another name)."""
    head = name.split("-", 1)[0]
    return int(head) / 1e9 if head.isdigit() else None


def is_command_name(name: str) -> bool:
    """A command file waiting to be applied (not a temp file, not one set aside)."""
    return name.endswith(".json") and not is_temp_name(name)


class ControlWatcher:
    """Applies the command files of one directory, in name order, through `apply`.

    `apply` raises `CommandError` for a command it cannot apply (the file is set aside); any other
    exception is logged the same way, so a bad command never stops the watcher. Commands are
    applied on this watcher's own thread, one at a time.
    """

    def __init__(self, directory: Path, apply: Callable[[SimCommand], None]) -> None:
        self.directory = directory
        self.apply = apply
        self.applied = 0
        self.rejected = 0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._watch: WatchThread | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        makedirs(self.directory)
        watch = WatchThread(lambda _event: self._wake.set(), "nvml-sim-control-watch")
        watch.add(str(self.directory))
        watch.start()
        self._watch = watch
        # Drained once at start whatever the events say: commands written before the watch began.
        self._wake.set()
        self._thread = threading.Thread(target=self._run, name="nvml-sim-control", daemon=True)
        self._thread.start()
        log.info("simulated NVML: applying commands written to %s", self.directory)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(5.0)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                self.drain()
            except Exception:  # a directory that vanished, say: logged, and the next event retries
                log.exception("simulated NVML: reading the control directory %s failed", self.directory)

    def drain(self) -> int:
        """Apply every command file now in the directory, in name order; how many were applied."""
        try:
            names = sorted(n for n in os.listdir(self.directory) if is_command_name(n))
        except FileNotFoundError:
            return 0
        done = 0
        for name in names:
            if self._stopping.is_set():
                break
            if self._apply_file(self.directory / name):
                done += 1
        return done

    def _apply_file(self, path: Path) -> bool:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return False  # taken by another watcher of the same directory
        try:
            command = replace(SimCommand.decode(data), written=written_at(path.name))
            self.apply(command)
        except Exception as exc:
            self.rejected += 1
            why = str(exc) if isinstance(exc, CommandError) else f"{type(exc).__name__}: {exc}"
            log.warning("simulated NVML: control command %s set aside as %s%s: %s", path.name, path.name,
                        BAD_SUFFIX, why)
            try:
                os.replace(path, path.with_name(path.name + BAD_SUFFIX))
            except OSError as move_exc:
                log.warning("simulated NVML: cannot set %s aside: %s", path, move_exc)
            return False
        self.applied += 1
        log.info("simulated NVML: applied %s %s%s", command.command, command.device,
                 f" XID {command.xid}" if command.xid is not None else "")
        unlink_quiet(path)
        return True

"""Host changes a claim's unprepare could not undo, kept after the claim is gone.

The kubelet retries an unprepare until it succeeds, and the claim's pods stay Terminating until then.
When the hardware a claim changed is gone or refuses (a lost GPU whose MIG instance cannot be
destroyed, a function that left the bus, an original driver that is not loaded), the unprepare
removes the claim's files and record all the same and succeeds; what could not be undone is kept
here, one durable file per claim (`<state dir>/leftovers/<uid>.json`):

    {"version": 1, "uid": ..., "namespace": ..., "name": ...,
     "devices": ["gpu-1-mig-1g10gb-4"], "functions": ["0000:2a:00.0"], "locks": ["pci/0000:2a:00.0"],
     "reason": "device gpu-1-mig-1g10gb-4: GPU ... does not answer NVML: ...", "since": 1800000000.0,
     "bootId": "...", "record": "DRAREC 3 ..."}

`record` is the claim's record as its undoing left it (state `restoring` or `binding`, every step
recorded), from which the undoing is tried again: at start-up, by garbage collection's sweeps, and
by a prepare that needs one of its devices (under their locks). It goes once the undoing succeeds
(after a reset or a reboot there is mostly nothing left to undo) or an operator clears the device
(`dra-agent taints clear`). Until then the device carries an `undo-failed` taint
(`agent.health.conditions`), a prepare of it is refused with the reason, and `dra-agent vfio status`
and `dra-agent doctor` list it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson

from agent.claims.records import ClaimRecord, RecordError, decode, encode
from agent.fsutil import Root, is_temp_name
from agent.names import InvalidName, check_uid

log = logging.getLogger(__name__)

DIRECTORY = "leftovers"
SUFFIX = ".json"
FORMAT_VERSION = 1


class LeftoverError(ValueError):
    """A leftover file that is not one."""


@dataclass(frozen=True, slots=True)
class Leftover:
    """What a claim's unprepare left on the host, and why."""

    uid: str
    namespace: str
    name: str
    devices: tuple[str, ...]  # the claim's devices whose host changes remain
    functions: tuple[str, ...]  # the PCI functions of that hardware (bus IDs)
    locks: tuple[str, ...]  # the claim's device lock keys (`pci/<bus>`, `device/<name>`)
    reason: str  # why the undoing failed
    since: float  # unix seconds
    boot_id: str  # the kernel boot it was left in
    record: ClaimRecord  # the record as the undoing left it: what remains, step by step

    @property
    def claim(self) -> str:
        return f"{self.namespace}/{self.name}"

    def describe(self) -> str:
        """One line for people: the devices, the claim and why."""
        return (f"{', '.join(self.devices)} (claim {self.claim}, {self.uid}): host changes not undone: "
                f"{self.reason}")

    def wire(self) -> bytes:
        return orjson.dumps({
            "version": FORMAT_VERSION, "uid": self.uid, "namespace": self.namespace, "name": self.name,
            "devices": list(self.devices), "functions": list(self.functions), "locks": list(self.locks),
            "reason": self.reason, "since": self.since, "bootId": self.boot_id,
            "record": encode(self.record).decode()}, option=orjson.OPT_INDENT_2)

    @classmethod
    def from_wire(cls, data: bytes) -> Leftover:
        try:
            doc = orjson.loads(data)
            if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
                raise LeftoverError(f"not a version-{FORMAT_VERSION} leftover")
            strings = {k: doc[k] for k in ("uid", "namespace", "name", "reason", "bootId", "record")}
            lists = {k: doc[k] for k in ("devices", "functions", "locks")}
            if not all(isinstance(v, str) for v in strings.values()) or not all(
                    isinstance(v, list) and all(isinstance(x, str) for x in v) for v in lists.values()):
                raise LeftoverError("a field has the wrong type")
            record = decode(strings["record"].encode())
            return cls(strings["uid"], strings["namespace"], strings["name"], tuple(lists["devices"]),
                       tuple(lists["functions"]), tuple(lists["locks"]), strings["reason"], float(doc["since"]),
                       strings["bootId"], record)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, RecordError) as exc:
            raise LeftoverError(str(exc)) from exc


class Leftovers:
    """The leftovers directory. Blocking: worker threads (the CLI reads it too). `on_change` is called
    (from the writing thread) after each leftover kept or removed."""

    def __init__(self, directory: Path) -> None:
        self.root = Root(directory, dir_mode=0o700)
        self.on_change: Callable[[], None] | None = None

    @property
    def directory(self) -> Path:
        return self.root.path

    def _path(self, uid: str) -> Path:
        check_uid(uid)
        return self.root.path / f"{uid}{SUFFIX}"

    def keep(self, leftover: Leftover) -> None:
        """Durable when it returns (written, fsync'd, renamed, the directory fsync'd)."""
        self.root.ensure()
        self.root.write(self._path(leftover.uid), leftover.wire(), mode=0o600, durable=True)
        self._changed()

    def remove(self, uid: str) -> bool:
        """Durable when it returns; True if there was one."""
        removed = self.root.unlink(self._path(uid), durable=True)
        if removed:
            self._changed()
        return removed

    def get(self, uid: str) -> Leftover | None:
        try:
            return Leftover.from_wire(self.root.read(self._path(uid)))
        except FileNotFoundError:
            return None

    def all(self) -> list[Leftover]:
        """Every readable leftover (an unreadable file is logged and skipped), oldest first."""
        out = []
        for name in self.root.listdir():
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            try:
                check_uid(name[: -len(SUFFIX)])
                found = Leftover.from_wire(self.root.read(self.root.path / name))
            except FileNotFoundError:
                continue
            except (OSError, LeftoverError, InvalidName) as exc:
                log.warning("leftover %s is not readable: %s", self.root.path / name, exc)
                continue
            out.append(found)
        return sorted(out, key=lambda lo: (lo.since, lo.uid))

    def temp_files(self) -> list[tuple[str, Path]]:
        """(claim UID, path) of each write an agent killed mid-way never renamed into place."""
        out = []
        for name in self.root.listdir():
            uid = name[1:].split(SUFFIX, 1)[0]
            if is_temp_name(name) and name.startswith(".") and is_uid(uid):
                out.append((uid, self.root.path / name))
        return out

    def holding(self, keys: Iterable[str]) -> list[Leftover]:
        """The leftovers on any of these device lock keys."""
        wanted = set(keys)
        return [lo for lo in self.all() if wanted & set(lo.locks)]

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:
                log.exception("telling of a changed leftover failed")


def is_uid(text: str) -> bool:
    try:
        check_uid(text)
    except InvalidName:
        return False
    return True


def leftovers_dir(state_dir: Path) -> Path:
    return state_dir / DIRECTORY



"""The simulated GPUs' MIG state as hardware keeps it: it outlives the agent.

A real GPU keeps its MIG mode and its GPU and compute instances when the process that made them dies;
only a reboot (or a GPU reset) clears the instances, and the MIG mode of an H100 even survives that.
`MigMachine` gives the simulated NVML (`nvml_sim_mig.SimMig`) the same property: the state of every
GPU is written atomically to `<machine>/nvml-mig.json` after each change, and read back when a
simulated NVML attaches to the machine, or whenever another process (a second agent, a test looking
at the "hardware") changed the file since. The file names the boot it was written in
(`proc/sys/kernel/random/boot_id` of the simulated machine): read in a later boot, its instances are
dropped and its modes kept, as the hardware does. A change is made under an flock of
`<machine>/nvml-mig.lock`, so two processes never lose each other's instances.

The driver's view of the instances is written too, as the kernel module shows it: each GPU instance's
and compute instance's access capability in `proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<id>/
[ci<id>/]access` (`DeviceFileMinor: <n>`). Like the driver, the simulated machine makes no device node
`dev/nvidia-caps/nvidia-cap<n>` for it: on a real host those exist only once someone creates them
(nvidia-modprobe, or the agent at prepare: `agent.host.nvcaps`), with the major of `nvidia-caps` in
`proc/devices` (`agent.sim.hardware`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from agent.fsutil import atomic_write, makedirs
from agent.host.nvcaps import caps_dir
from agent.sim.kernel.tree import SimTree
from agent.sim.migprofiles import MigProfileSpec

log = logging.getLogger(__name__)

STATE_FILE = "nvml-mig.json"
LOCK_FILE = "nvml-mig.lock"
VERSION = 1
# The driver's capability minors (/proc/driver/nvidia-caps/mig-minors): 1 and 2 are mig/config and
# mig/monitor, then per GPU minor 15 GPU instance ids, each one minor for itself and 8 for its compute
# instances.
_GIS_PER_GPU = 15
_PER_GI = 9


def caps_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    base = 3 + gpu_minor * _GIS_PER_GPU * _PER_GI + gi * _PER_GI
    return base if ci is None else base + 1 + ci


@dataclass(slots=True)
class SimGi:
    id: int
    spec: MigProfileSpec
    start: int
    cis: dict[int, int] = field(default_factory=dict)  # compute instance id -> its compute slices

    def covers(self) -> set[int]:
        return set(range(self.start, self.start + self.spec.size))


@dataclass(slots=True)
class SimGpuMig:
    table: tuple[MigProfileSpec, ...]
    mode: int
    gis: dict[int, SimGi] = field(default_factory=dict)


class MigStateError(ValueError):
    pass


class MigMachine:
    """The persisted MIG state of one simulated machine rooted at `root` (GPU i has minor `minors[i]`)."""

    def __init__(self, root: Path, minors: list[int]) -> None:
        self.tree = SimTree(root)
        self.path = root / STATE_FILE
        self.minors = minors
        self._seen: tuple[int, int, int] | None = None  # the file as last read or written

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fd = os.open(self.tree.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (releases the flock)

    def attach(self, gpus: list[SimGpuMig | None]) -> None:
        """Load the machine's state into `gpus` (kept as they are when there is none yet), then write it."""
        with self.locked():
            self.refresh(gpus, force=True)
            self.save(gpus)

    def refresh(self, gpus: list[SimGpuMig | None], force: bool = False) -> None:
        """Read the file into `gpus` when it changed since this process last read or wrote it."""
        stamp = self._stamp()
        if stamp is None or (stamp == self._seen and not force):
            return
        try:
            raw = orjson.loads(self.path.read_bytes())
            boot, states = _decode(raw, gpus)
        except (OSError, orjson.JSONDecodeError, MigStateError) as exc:
            log.warning("simulated MIG state %s is not readable (%s): starting from the profile", self.path, exc)
            self._seen = stamp
            return
        rebooted = boot != self._boot_id()
        for gpu, state in zip(gpus, states, strict=True):
            if gpu is None or state is None:
                continue
            gpu.mode, gis = state
            gpu.gis = {} if rebooted else gis
        self._seen = stamp
        if rebooted:
            log.info("simulated MIG state %s is from another boot: its GPU instances are gone", self.path)

    def save(self, gpus: list[SimGpuMig | None]) -> None:
        body = {"version": VERSION, "bootId": self._boot_id(), "gpus": [None if g is None else {
            "mode": g.mode,
            "gis": [{"id": gi.id, "profileId": gi.spec.id, "start": gi.start,
                     "cis": {str(c): s for c, s in sorted(gi.cis.items())}} for gi in sorted(
                         g.gis.values(), key=lambda gi: gi.id)]} for g in gpus]}
        # Atomic, not fsync'd: the state stands for the GPU's, which outlives the agent's process (the
        # page cache does that); the simulated machine has no power to lose, and an fsync here would
        # bill the agent for a cost real MIG changes do not have (`make bench` measures MIG prepares).
        atomic_write(self.path, orjson.dumps(body, option=orjson.OPT_INDENT_2), mode=0o644)
        self._seen = self._stamp()
        self._write_caps(gpus)

    def _write_caps(self, gpus: list[SimGpuMig | None]) -> None:
        """The driver's capability files and nodes of the instances there are now."""
        for gpu, minor in zip(gpus, self.minors, strict=True):
            if gpu is None:
                continue
            where = caps_dir(self.tree.root / "proc", minor)
            for name in os.listdir(where) if where.is_dir() else ():
                if name.startswith("gi") and (not name[2:].isdigit() or int(name[2:]) not in gpu.gis):
                    shutil.rmtree(where / name, ignore_errors=True)
            for gi in gpu.gis.values():
                _capability(where / f"gi{gi.id}", caps_minor(minor, gi.id))
                gi_dir = where / f"gi{gi.id}"
                for name in os.listdir(gi_dir):
                    if name.startswith("ci") and (not name[2:].isdigit() or int(name[2:]) not in gi.cis):
                        shutil.rmtree(gi_dir / name, ignore_errors=True)
                for ci in gi.cis:
                    _capability(gi_dir / f"ci{ci}", caps_minor(minor, gi.id, ci))

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _boot_id(self) -> str:
        return self.tree.read_boot_id()


def _capability(where: Path, minor: int) -> None:
    makedirs(where)
    access = where / "access"
    text = f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    if not access.is_file() or access.read_text() != text:
        atomic_write(access, text.encode())


def _decode(raw: object, gpus: list[SimGpuMig | None]) -> tuple[str, list[tuple[int, dict[int, SimGi]] | None]]:
    if not isinstance(raw, Mapping) or raw.get("version") != VERSION or not isinstance(raw.get("bootId"), str):
        raise MigStateError("not a version-1 MIG state")
    states = raw.get("gpus")
    if not isinstance(states, list) or len(states) != len(gpus):
        raise MigStateError("written for a machine with another number of GPUs")
    out: list[tuple[int, dict[int, SimGi]] | None] = []
    for gpu, state in zip(gpus, states, strict=True):
        if gpu is None or state is None:
            out.append(None)
            continue
        if not isinstance(state, Mapping) or type(state.get("mode")) is not int or not isinstance(
                state.get("gis"), list):
            raise MigStateError(f"GPU state {state!r} is malformed"[:200])
        gis: dict[int, SimGi] = {}
        for g in state["gis"]:
            try:
                spec = next(s for s in gpu.table if s.id == g["profileId"])
                cis = {int(c): int(s) for c, s in g["cis"].items()}
                gis[int(g["id"])] = SimGi(int(g["id"]), spec, int(g["start"]), cis)
            except (StopIteration, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise MigStateError(f"GPU instance {g!r} is malformed ({exc!r})"[:200]) from exc
        out.append((state["mode"], gis))
    return raw["bootId"], out

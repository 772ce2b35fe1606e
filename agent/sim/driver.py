"""The simulated machine's NVIDIA kernel driver: loaded or not, and which load of it.

On a GPU Operator node the driver is a container: reloading it (an upgrade, a restart of its pod) unloads
the kernel modules, takes the driver's libraries away with the container's root (`--driver-root`, below
`/run/nvidia/driver`) and removes `/dev/nvidia*`, then brings all of it back. `dra-agent sim driver
unload|load` (`agent.app.simctl`) does the same to the simulated machine, through `agent.sim.hardware`:
the device nodes and the driver's GPU list in procfs go and come back, and this state says to every
simulated NVML on the machine, in whatever process, that the driver is gone (`nvmlInit` answers
DRIVER_NOT_LOADED; a session opened before answers nothing) or which load it is (a session opened under
an earlier load is over: its calls answer UNINITIALIZED until NVML is initialized again).

The state is one small file, `<sim root>/nvidia-driver` (`loaded N` or `unloaded N`; none: loaded, load
0), written atomically; `DriverState.current` reads it again only when the file changed (a stat per
NVML call, no read).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from agent.fsutil import atomic_write

STATE_FILE = "nvidia-driver"


@dataclass(frozen=True, slots=True)
class Driver:
    loaded: bool = True
    load: int = 0  # counts the loads since the machine was first written (a simulated boot keeps it)


def read_driver(root: Path) -> Driver:
    try:
        text = (root / STATE_FILE).read_text()
    except FileNotFoundError:
        return Driver()
    word, _, number = text.strip().partition(" ")
    return Driver(word == "loaded", int(number) if number.isdigit() else 0)


def write_driver(root: Path, driver: Driver) -> None:
    atomic_write(root / STATE_FILE, f"{'loaded' if driver.loaded else 'unloaded'} {driver.load}\n".encode())


class DriverState:
    """The driver as the machine at `root` has it now, read again whenever its file changed."""

    def __init__(self, root: Path) -> None:
        self.path = root / STATE_FILE
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime ns, size) of the file read
        self._driver = Driver()

    def current(self) -> Driver:
        try:
            st = os.stat(self.path)
            key: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = None
        with self._lock:
            if key != self._seen:
                self._driver = read_driver(self.path.parent) if key is not None else Driver()
                self._seen = key
            return self._driver

"""What an initialized simulated NVML sees of its machine, and what it holds open: two facts of the real
library the simulation must model.

- A GPU bound to another driver than nvidia (vfio-pci for a VM, or none) is not NVML's: the library
  enumerates the GPUs the NVIDIA driver drives when it is initialized, and numbers them 0..n-1 in that
  order. So a GPU that left the driver is missing from a later `nvmlInit`, and the GPUs after it move
  down one index; one that comes back is listed again from the next `nvmlInit` on. A GPU whose
  function is not in the machine's sysfs at all (`inSysfs: false`) is always listed.
- A handle holds its GPU open: from the first handle of a GPU in an initialized session until the last
  `nvmlShutdown` (or until the simulated NVML is dropped: the real library's descriptors close with its
  process), and for every event set a GPU is registered with until the set is freed, this process has a
  file descriptor on the GPU's node (`<root>/dev/nvidia<minor>`, opened with O_PATH: the node of
  the simulated machine has no driver behind it). It shows in this process's /proc as a real open file
  does, and the simulated kernel holds an NVIDIA unbind while it is there (`agent.sim.kernel.opengpus`).

Slots are profile indexes (what handles encode); NVML indexes are positions among the GPUs listed.
Without a machine on disk (`attach` not called) every GPU is listed and nothing is held.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.sim.machine import SimGpu

NVIDIA = "nvidia"


class NvmlView:
    def __init__(self, gpus: Sequence[SimGpu]) -> None:
        self._gpus = list(gpus)
        self._root: Path | None = None
        self._lock = threading.Lock()
        self.listed: list[int] = list(range(len(self._gpus)))  # slots, in NVML index order
        self._held: dict[int, int] = {}  # slot -> descriptor of a handle
        self._registered: dict[tuple[int, int], int] = {}  # (event set, slot) -> descriptor
        # The real library's descriptors close with its process at the latest. A simulated NVML dropped while
        # initialized (a test's, never shut down) is that process gone: it closes them itself, or one long
        # test process piles them up.
        weakref.finalize(self, _close_held, self._held, self._registered)

    def attach(self, root: Path) -> None:
        self._root = root

    def enumerate(self) -> None:
        """At initialization: the GPUs bound to the NVIDIA driver now."""
        with self._lock:
            self.listed = [slot for slot, gpu in enumerate(self._gpus) if self._drives(gpu)]

    def slot(self, index: int) -> int | None:
        """The slot of NVML index `index`; None when there is no such index."""
        return self.listed[index] if 0 <= index < len(self.listed) else None

    def index(self, slot: int) -> int | None:
        return self.listed.index(slot) if slot in self.listed else None

    def hold(self, slot: int) -> None:
        """A handle of GPU `slot` was handed out: it holds the GPU open for the session."""
        with self._lock:
            if slot not in self._held and (fd := self._open(slot)) is not None:
                self._held[slot] = fd

    def register(self, event_set: int, slot: int) -> None:
        with self._lock:
            if (event_set, slot) not in self._registered and (fd := self._open(slot)) is not None:
                self._registered[event_set, slot] = fd

    def free_set(self, event_set: int) -> None:
        with self._lock:
            for key in [k for k in self._registered if k[0] == event_set]:
                _close(self._registered.pop(key))

    def close_all(self) -> None:
        """The last nvmlShutdown: every handle is gone (event sets go with it)."""
        with self._lock:
            for fd in [*self._held.values(), *self._registered.values()]:
                _close(fd)
            self._held.clear()
            self._registered.clear()

    def _drives(self, gpu: SimGpu) -> bool:
        if self._root is None:
            return True
        function = self._root / "sys" / "bus" / "pci" / "devices" / gpu.bus_id
        if not function.exists():
            return True  # not in this machine's sysfs: nothing says it left the driver
        try:
            return os.path.basename(os.readlink(function / "driver")) == NVIDIA
        except OSError:
            return False  # unbound

    def _open(self, slot: int) -> int | None:
        if self._root is None:
            return None
        try:
            return os.open(self._root / "dev" / f"nvidia{self._gpus[slot].minor}", os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return None  # no node: nothing to hold


def _close_held(*tables: dict[Any, int]) -> None:
    """Close what the tables still hold (`close_all` and `free_set` empty them as they close)."""
    for table in tables:
        for fd in table.values():
            _close(fd)
        table.clear()


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)

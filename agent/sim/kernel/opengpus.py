"""The simulated NVIDIA driver's unbind waits while the GPU is open, as the real driver's does: its
remove waits for the last process to close the GPU.

Open means a file descriptor on the GPU's node, `<root>/dev/nvidia<minor>`, held by a process of this
machine (its /proc: the simulated NVML's handles are such descriptors, `agent.sim.nvml`, and a test's
process holding the node is one), or a process the simulated machine's own `proc` lists with it open.
Such an unbind is carried out by a waiter thread once the last holder is gone; the kernel log says it
waits, and for whom. A real kernel keeps the writer inside write(2) meanwhile; here the write has
returned and only its effect is late, which the agent handles alike (`agent.host.vfio.writes`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from agent.host.vfio.inuse import open_holders
from agent.sim.kernel.tree import SimTree

log = logging.getLogger(__name__)

NVIDIA = "nvidia"
POLL = 0.02


class OpenGpus:
    """`minors`: bus ID -> minor of each GPU; `lock`: the emulator's, held by the caller of
    `wait_for_close` and taken by the waiter to carry the unbind out (`detach`)."""

    def __init__(self, tree: SimTree, minors: dict[str, int], lock: threading.Lock,
                 detach: Callable[[str], None]) -> None:
        self.tree = tree
        self.minors = minors
        self.lock = lock
        self.detach = detach
        self._waiting: dict[str, threading.Thread] = {}
        self._stopping = threading.Event()

    def holders(self, bdf: str) -> list[str]:
        minor = self.minors[bdf]
        node = self.tree.dev / f"nvidia{minor}"
        found = open_holders(Path("/proc"), {str(node)})  # by path: a real GPU's node is never this one
        found += open_holders(self.tree.root / "proc", {f"/dev/nvidia{minor}", str(node)})
        return [f"pid {h.pid} ({h.command or '?'}) fd {h.fd}" for h in found]

    def wait_for_close(self, bdf: str) -> bool:
        """For an unbind of `bdf` from nvidia (the emulator's lock held): True when the GPU is open and a
        waiter now carries the unbind out later; False when it may go ahead."""
        if bdf not in self.minors:
            return False
        holders = self.holders(bdf)
        if not holders:
            return False
        if bdf not in self._waiting:
            self.tree.log(f"unbind {NVIDIA} {bdf}: waits until the GPU is closed: {'; '.join(holders)}")
            thread = threading.Thread(target=self._wait, args=(bdf,), daemon=True, name=f"simulated unbind {bdf}")
            self._waiting[bdf] = thread
            thread.start()
        return True

    def stop(self) -> None:
        self._stopping.set()
        for thread in list(self._waiting.values()):
            thread.join(5.0)

    def _wait(self, bdf: str) -> None:
        try:
            while not self._stopping.wait(POLL):
                if self.holders(bdf):  # looked at without the lock: other writes go on meanwhile
                    continue
                with self.lock:
                    if self.tree.driver_of(bdf) != NVIDIA:
                        return  # gone another way meanwhile
                    if not self.holders(bdf):
                        self.tree.log(f"unbind {NVIDIA} {bdf}: done, the GPU was closed")
                        self.detach(bdf)
                        return
        except OSError:
            log.exception("simulated kernel: the waiting unbind of %s failed", bdf)
        finally:
            with self.lock:
                self._waiting.pop(bdf, None)

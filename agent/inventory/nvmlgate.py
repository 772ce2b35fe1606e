"""Who uses NVML now, and letting go of it whole while a GPU leaves or rejoins the NVIDIA driver.

NVML holds every GPU it has handed out a handle for open (`/dev/nvidia<N>`) until the last
`nvmlShutdown`, and an event set holds the GPUs registered with it until it is freed. The NVIDIA
driver's unbind of a GPU waits until nobody has it open, so the agent's own NVML would keep a GPU it
passes through to a VM (`agent.hostprep.vfio`) from ever leaving the driver; and NVML lists the GPUs the
driver drives at `nvmlInit`, so a GPU bound back to nvidia is seen only by a later initialization.

So every NVML user takes the gate shared (`use`): GPU discovery's scan, the GPU event watcher for each
probe and wait, MIG prepare, the passthrough's persistence-mode check. Moving a GPU between drivers
takes it away from them (`released`): it waits for the users in flight, runs the release hooks (the
event watcher frees its event set and forgets its handles), calls `nvmlShutdown` (the agent's one
initialization), lets the caller move the GPU, then initializes NVML again and counts a new
`generation`. Claims moving other GPUs at the same time share the release (one claim's unbind that
waits in the driver does not hold up another's); users wait until the last of them is done, which
every binding step's bound limits. NVML indexes and handles from an earlier generation mean nothing: a GPU that left the
driver is no longer listed and the ones after it moved down an index, so the users drop what they
kept by index when the generation changes. A re-initialization that fails is tried again by the next
user. Blocking; `released` must not be entered from inside `use` (it would wait for itself).

NVML can also go from under the agent: the NVIDIA driver unloaded (the GPU Operator's driver container
reloading it, docs/health.md "NVML lost"), its session over. The user that finds NVML failing as a whole
(the GPU event watcher's probe) calls `lost`, from inside its use: NVML is shut down (whatever the
library says to that), and every later use initializes it again until an initialization succeeds, which
counts a new generation (the handles and indexes of the session before mean nothing), as a release does.
The shutdown waits (a bounded while) for the other users in flight to leave, new ones waiting behind it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import pynvml

from agent.inventory.nvmlapi import Nvml

log = logging.getLogger(__name__)

LOST_WAIT = 5.0  # seconds `lost` waits for the other users in flight before it shuts NVML down


class NvmlGate:
    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml  # initialized once by the GPU source
        self._cond = threading.Condition()
        self._users = 0
        self._releasers = 0  # callers inside `released`: NVML is down for all of them at once
        self._wanting = 0  # callers waiting to release: new users wait behind them
        self._shut = False  # NVML is shut down (released, lost, or its initialization failed)
        self._init_failed: str | None = None  # why the last initialization failed (logged when it changes)
        self._letting_go = False  # the first caller of a release is shutting NVML down
        self.generation = 0
        self._hooks: list[Callable[[], None]] = []
        self._inside = threading.local()  # this thread's shared leases (a release from one would wait forever)

    def on_release(self, hook: Callable[[], None]) -> None:
        """Run `hook` (NVML still initialized, nobody using it) before each release."""
        with self._cond:
            self._hooks.append(hook)

    def forget(self, hook: Callable[[], None]) -> None:
        with self._cond:
            if hook in self._hooks:
                self._hooks.remove(hook)

    @contextlib.contextmanager
    def use(self) -> Iterator[int]:
        """Use NVML (shared with other users); yields the generation."""
        with self._use(wait=True) as generation:
            assert generation is not None
            yield generation

    @contextlib.contextmanager
    def use_if_up(self) -> Iterator[int | None]:
        """Use NVML if nobody releases it now; yields the generation, or None (not used: released, for as
        long as another claim's GPU takes to change drivers)."""
        with self._use(wait=False) as generation:
            yield generation

    @contextlib.contextmanager
    def _use(self, *, wait: bool) -> Iterator[int | None]:
        with self._cond:
            while wait and (self._releasers or self._wanting):
                self._cond.wait()
            if self._releasers or self._wanting:
                generation = None
            else:
                if self._shut and self._init():
                    self.generation += 1  # a session after a lost one, or after a failed initialization
                self._users += 1
                generation = self.generation
        if generation is None:
            yield None
            return
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            yield generation
        finally:
            self._inside.depth -= 1
            with self._cond:
                self._users -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def released(self, why: str) -> Iterator[None]:
        """NVML let go of entirely (every handle and event set this process held) while the caller moves
        a GPU between drivers, initialized again once the last caller inside has left, whatever they
        raised. Callers moving other GPUs meanwhile share the release; users wait for its end."""
        if getattr(self._inside, "depth", 0):
            raise RuntimeError("NVML cannot be released from inside a use of it")
        with self._cond:
            self._wanting += 1
            while self._users:
                self._cond.wait()
            self._wanting -= 1
            self._releasers += 1
            first = self._releasers == 1
            hooks = list(self._hooks) if first else []
            if first:
                self._letting_go = True
            while not first and self._letting_go:
                self._cond.wait()  # the first caller is still shutting NVML down
        try:
            if first:
                self._let_go(hooks, why)
            yield
        finally:
            with self._cond:
                self._releasers -= 1
                if not self._releasers:
                    self._init()
                    self.generation += 1
                self._cond.notify_all()

    def lost(self, why: str) -> bool:
        """NVML stopped answering as a whole (`why`): shut it down now, initialized again by a later use.
        Callable from inside a use; the caller has let go of its own handles and event sets. False when it
        was shut down already."""
        with self._cond:
            if self._shut or self._releasers:
                return False
            # Not under another user's call: their calls fail by now anyway, and end (LOST_WAIT bounds it).
            self._wanting += 1
            try:
                self._cond.wait_for(lambda: self._users <= 1, LOST_WAIT)
            finally:
                self._wanting -= 1
                self._cond.notify_all()  # (those waiting behind see NVML shut down once this lock is let go)
            if self._shut:
                return False
            try:
                self.nvml.nvmlShutdown()
            except pynvml.NVMLError as exc:  # the session is over already: nothing held to let go of
                log.debug("NVML lost: nvmlShutdown: %s", exc)
            self._shut = True
            self._init_failed = ""  # (its first failure to initialize, and its success, are logged)
            self._cond.notify_all()
        log.warning("NVML lost: %s; initialized again until it answers", why)
        return True

    def _let_go(self, hooks: list[Callable[[], None]], why: str) -> None:
        try:
            for hook in hooks:
                try:
                    hook()
                except Exception:  # a hook's failure must not keep NVML from being released
                    log.exception("releasing NVML: a release hook failed")
            if not self._shut:
                try:
                    self.nvml.nvmlShutdown()
                except pynvml.NVMLError as exc:
                    log.warning("releasing NVML (%s): nvmlShutdown failed: %s", why, exc)
                self._shut = True
            log.info("NVML released: %s", why)
        finally:
            with self._cond:
                self._letting_go = False
                self._cond.notify_all()

    def _init(self) -> bool:
        """Initialize NVML again (holding `_cond`); whether it succeeded."""
        try:
            self.nvml.nvmlInit()
        except pynvml.NVMLError as exc:
            if str(exc) != self._init_failed:
                log.warning("NVML did not initialize again: %s (tried again at its next use)", exc)
            self._init_failed = str(exc)
            self._shut = True
            return False
        if self._init_failed is not None:
            log.info("NVML initialized again")
        self._init_failed = None
        self._shut = False
        return True

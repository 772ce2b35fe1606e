"""Binding a PCI function (with its group's companions) to vfio-pci and back, as explicit steps.

A `BindPlan` is data: the functions it moves with the driver each had before (`FunctionBinding`),
and the ordered `BindStep`s. The prepare engine records the plan, then before each step records
"step k is next", then calls `apply_step`; after a crash, recovery re-applies from the recorded
step (or applies `plan.restore()` to roll back). That works because every step is idempotent and
judged against what sysfs shows now, not what the last run believed:

- `set-override` / `clear-override` write `driver_override` (always safe to repeat);
- `unbind F from D` writes `drivers/D/unbind` only while F is bound to D (otherwise nothing to do);
- `bind F to D` writes `drivers/D/bind` only while F is unbound (nothing to do when already on D;
  an error when bound to another driver), then waits, bounded, until the `driver` link shows D.

So from any state a prefix of the bind plan leaves, both the rest of the plan and the whole restore
plan converge: each function ends bound to exactly the one driver the record says. Binding goes
through `drivers/<driver>/bind` rather than `drivers_probe`: it names the driver the record wants
instead of whichever matches first.

On a real host the kernel acts inside the write (a refusal is an errno); the simulated machine's
kernel acts a moment later (a refusal leaves the state unchanged). Reading the `driver` link back
until it shows the target, within `timeout`, covers both. The write itself is bounded by the same
`timeout` (`agent.host.vfio.writes`): an NVIDIA unbind waits in the driver while the GPU is open, and
must not hold this process (or its other claims' steps) with it. The calls block: run them off the
event loop (asyncio.to_thread). While a step waits (for the driver, for another step's write), its
thread lets its claim slot go (`agent.workslots`): the claims of other devices go on.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from agent.host.vfio import writes
from agent.host.vfio.errors import StepFailed, VfioError
from agent.host.vfio.pci import VFIO_PCI, current_driver, current_override, function_dir, passthrough_set
from agent.workslots import take, wait_until

DEFAULT_TIMEOUT = 10.0  # seconds for a bind or unbind to show; a GPU's driver may take seconds to let go
_POLL = 0.01
# One binding write in flight at a time in this process: sysfs command files are shared by every function
# (drivers/vfio-pci/bind), and the simulated kernel reads a write back from the file. Held while a write
# is made and taken (bounded), not while its effect is waited for, nor by a write left to the kernel.
_WRITES = threading.Lock()


class StepKind(StrEnum):
    SET_OVERRIDE = "set-override"
    CLEAR_OVERRIDE = "clear-override"
    UNBIND = "unbind"
    BIND = "bind"


@dataclass(frozen=True, slots=True)
class BindStep:
    kind: StepKind
    bdf: str
    driver: str = ""  # the override to set, the driver to leave, or the driver to bind; "" to clear

    def __str__(self) -> str:
        if self.kind is StepKind.SET_OVERRIDE:
            return f"set driver_override of {self.bdf} to {self.driver}"
        if self.kind is StepKind.CLEAR_OVERRIDE:
            return f"clear driver_override of {self.bdf}"
        return f"{self.kind} {self.bdf} {'from' if self.kind is StepKind.UNBIND else 'to'} {self.driver}"

    def wire(self) -> dict[str, str]:
        return {"kind": str(self.kind), "bdf": self.bdf, "driver": self.driver}

    @classmethod
    def from_wire(cls, raw: Mapping[str, object]) -> BindStep:
        if set(raw) != {"kind", "bdf", "driver"} or not all(isinstance(v, str) for v in raw.values()):
            raise ValueError(f"not a binding step: {dict(raw)!r}")
        return cls(StepKind(str(raw["kind"])), str(raw["bdf"]), str(raw["driver"]))


@dataclass(frozen=True, slots=True)
class FunctionBinding:
    """A function the plan moves, and how the host had it before (restored at unprepare)."""

    bdf: str
    driver: str | None  # None: it was unbound
    override: str | None = None

    def wire(self) -> dict[str, str | None]:
        return {"bdf": self.bdf, "driver": self.driver, "override": self.override}

    @classmethod
    def from_wire(cls, raw: Mapping[str, object]) -> FunctionBinding:
        bdf, driver, override = raw.get("bdf"), raw.get("driver"), raw.get("override")
        if set(raw) != {"bdf", "driver", "override"} or not isinstance(bdf, str) or \
                not isinstance(driver, str | None) or not isinstance(override, str | None):
            raise ValueError(f"not a function binding: {dict(raw)!r}")
        return cls(bdf, driver, override)


@dataclass(frozen=True, slots=True)
class BindPlan:
    """Move `functions` (target first) to `driver`; `steps` in order."""

    driver: str
    group: int
    functions: tuple[FunctionBinding, ...]
    steps: tuple[BindStep, ...]

    @property
    def target(self) -> str:
        return self.functions[0].bdf

    def restore(self) -> BindPlan:
        """The plan that puts every function back as `functions` records (also a rollback from any
        step of this plan)."""
        return restore_plan(self.driver, self.group, self.functions)

    def wire(self) -> dict[str, object]:
        return {"driver": self.driver, "group": self.group, "functions": [f.wire() for f in self.functions],
                "steps": [s.wire() for s in self.steps]}

    @classmethod
    def from_wire(cls, raw: Mapping[str, object]) -> BindPlan:
        driver, group, functions, steps = (raw.get(k) for k in ("driver", "group", "functions", "steps"))
        if set(raw) != {"driver", "group", "functions", "steps"} or not isinstance(driver, str) or \
                not isinstance(group, int) or not isinstance(functions, list) or not isinstance(steps, list) \
                or not functions:
            raise ValueError("not a binding plan")
        return cls(driver, group, tuple(FunctionBinding.from_wire(f) for f in functions),
                   tuple(BindStep.from_wire(s) for s in steps))


def plan_bind(sysfs: Path, bdf: str, driver: str = VFIO_PCI) -> BindPlan:
    """The steps that move `bdf` and its group's companions to `driver`, from the state sysfs shows now.
    Raises GroupNotViable (a group member the host uses) or VfioError (no IOMMU group, driver not loaded)."""
    if not (sysfs / "bus" / "pci" / "drivers" / driver).is_dir():
        raise VfioError(f"driver {driver} is not loaded (no {sysfs / 'bus' / 'pci' / 'drivers' / driver}): "
                        f"modprobe {driver.replace('-', '_')}")
    group = passthrough_set(sysfs, bdf)
    functions = tuple(FunctionBinding(f.bdf, f.driver, f.override) for f in group.moving)
    steps = [BindStep(StepKind.SET_OVERRIDE, f.bdf, driver) for f in functions]
    # Every function leaves its host driver before any is bound: vfio-pci takes a group only when
    # nothing in it is held by the host.
    steps += [BindStep(StepKind.UNBIND, f.bdf, f.driver) for f in functions if f.driver not in (None, driver)]
    steps += [BindStep(StepKind.BIND, f.bdf, driver) for f in functions]
    return BindPlan(driver, group.group, functions, tuple(steps))


def restore_plan(driver: str, group: int, functions: Sequence[FunctionBinding]) -> BindPlan:
    """Steps that take `functions` from `driver` back to what each had: the override cleared first (so
    the original driver matches again), out of `driver`, onto the original driver, and the original
    override (if there was one) set again last."""
    steps = [BindStep(StepKind.CLEAR_OVERRIDE, f.bdf) for f in functions]
    steps += [BindStep(StepKind.UNBIND, f.bdf, driver) for f in functions if f.driver != driver]
    steps += [BindStep(StepKind.BIND, f.bdf, f.driver) for f in functions if f.driver not in (None, driver)]
    steps += [BindStep(StepKind.SET_OVERRIDE, f.bdf, f.override) for f in functions if f.override]
    return BindPlan(driver, group, tuple(functions), tuple(steps))


def apply_plan(sysfs: Path, plan: BindPlan, *, start: int = 0, timeout: float = DEFAULT_TIMEOUT,
               before_step: Callable[[int, BindStep], None] | None = None) -> None:
    """Apply `plan.steps[start:]` in order; `before_step(k, step)` runs before each (to record intent)."""
    for k in range(start, len(plan.steps)):
        if before_step is not None:
            before_step(k, plan.steps[k])
        apply_step(sysfs, plan.steps[k], timeout=timeout)


def apply_step(sysfs: Path, step: BindStep, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Make one step true; nothing is written when it already is. StepFailed when the kernel refuses or
    the effect does not show within `timeout` seconds (a write the kernel has not returned from by then is
    left outstanding, `agent.host.vfio.writes`); WritePending while an earlier write about the function is."""
    if not function_dir(sysfs, step.bdf).exists():
        raise StepFailed(f"{step}: PCI function {step.bdf} is not in {sysfs / 'bus' / 'pci' / 'devices'}")
    deadline = time.monotonic() + timeout
    writes.wait_outstanding(sysfs, step.bdf, deadline)
    if step.kind in (StepKind.SET_OVERRIDE, StepKind.CLEAR_OVERRIDE):
        path = function_dir(sysfs, step.bdf) / "driver_override"
        # Done when the file shows it as Linux does: "<driver>\n", or "(null)\n" for none (older
        # kernels' NULL string; empty where a kernel prints nothing). Waiting for that exact text,
        # not just a value that parses the same, also keeps a later write from crossing the
        # simulated kernel's rewrite of this one.
        shown = {f"{step.driver}\n"} if step.kind is StepKind.SET_OVERRIDE else {"(null)\n", ""}
        with _writing(step, deadline):
            if _read(path) not in shown:
                _write(sysfs, step, path, f"{step.driver if step.kind is StepKind.SET_OVERRIDE else ''}\n", deadline,
                       lambda: _read(path) in shown)
                _wait_until(step, timeout, deadline, lambda: _read(path) in shown,
                            lambda: f"driver_override reads {_read(path)!r}")
        return
    drivers = sysfs / "bus" / "pci" / "drivers"
    if step.kind is StepKind.UNBIND:
        def left() -> bool:
            return current_driver(sysfs, step.bdf) != step.driver
        with _writing(step, deadline):
            if left():
                return  # not (or no longer) on that driver: nothing to leave
            w = _write(sysfs, step, drivers / step.driver / "unbind", step.bdf, deadline, left)
            _wait_consumed(w.path, deadline)
        try:
            _wait(sysfs, step, timeout, deadline, lambda now: now != step.driver)
        except StepFailed:
            writes.mark_outstanding(sysfs, step.bdf, w)  # the kernel may still carry it out
            raise
        return
    with _writing(step, deadline):
        bound = current_driver(sysfs, step.bdf)
        if bound == step.driver:
            return
        if bound is not None:
            raise StepFailed(f"{step}: the function is bound to {bound}, not unbound; unbind it from {bound} first")
        if not (drivers / step.driver).is_dir():
            raise StepFailed(f"{step}: driver {step.driver} is not loaded (no {drivers / step.driver})")
        _write(sysfs, step, drivers / step.driver / "bind", step.bdf, deadline,
               lambda: current_driver(sysfs, step.bdf) == step.driver)
        _wait(sysfs, step, timeout, deadline, lambda now: now == step.driver)


@contextlib.contextmanager
def _writing(step: BindStep, deadline: float) -> Iterator[None]:
    """`_WRITES`, waited for until `deadline`: its holder holds it only while a write is in flight (bounded
    too), so a step behind a stuck one fails in time rather than waiting with it."""
    if not take(_WRITES, timeout=max(0.0, deadline - time.monotonic())):
        raise StepFailed(f"{step}: another binding write did not finish in time; retried later")
    try:
        yield
    finally:
        _WRITES.release()


def _write(sysfs: Path, step: BindStep, path: Path, text: str, deadline: float,
           shown: Callable[[], bool]) -> writes.Write:
    w = writes.write(str(step), path, text, shown, deadline)
    if not w.done.is_set():
        writes.mark_outstanding(sysfs, step.bdf, w)
        raise StepFailed(f"{step}: the write to {path} has not returned after {time.monotonic() - w.since:.1f}s: the "
                         "driver is still at it (the NVIDIA driver's unbind waits until every process has closed the "
                         f"GPU); it is left to finish, and nothing more is done to {step.bdf} until it has")
    if w.error is not None:
        exc = w.error
        why = {errno.ENODEV: "the driver does not match the function (is driver_override set to it?)",
               errno.EBUSY: "the function is busy"}.get(exc.errno or 0, "")
        raise StepFailed(f"{step}: the kernel refused the write to {path}: {exc.strerror}"
                         + (f" ({why})" if why else "")) from exc
    return w


def _wait_consumed(path: Path, deadline: float) -> None:
    """Until the command file reads empty again (or cannot be read, as on a real host's write-only file):
    the simulated kernel has taken the write, and the next writer's O_TRUNC cannot wipe it."""
    wait_until(lambda: _read(path) in (None, ""), deadline, _POLL)  # (not taken in time: the effect's wait says so)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _wait(sysfs: Path, step: BindStep, timeout: float, deadline: float, done: Callable[[str | None], bool]) -> None:
    def now() -> str:
        bound, override = current_driver(sysfs, step.bdf), current_override(sysfs, step.bdf)
        return (f"the function is {f'bound to {bound}' if bound else 'unbound'}, driver_override "
                f"{override or 'not set'} (the kernel log says why it refused)")
    _wait_until(step, timeout, deadline, lambda: done(current_driver(sysfs, step.bdf)), now)


def _wait_until(step: BindStep, timeout: float, deadline: float, done: Callable[[], bool],
                state: Callable[[], str]) -> None:
    if not wait_until(done, deadline, _POLL):
        raise StepFailed(f"{step}: not done after {timeout:g}s: {state()}")

"""Device discovery: one source per kind of device, all behind one small interface.

A source is opened once (it may hold a library handle, like NVML), scanned as
often as needed, and closed at exit. Scans are blocking (NVML, sysfs, netlink
dumps) and run in worker threads; the inventory gathers them concurrently.

What a scan reports besides devices comes in two typed channels:

- `DeviceFailure`: a device discovery can name (the name it is published
  under) but could not read this time. The health stream reports it UNHEALTHY.
- `SourceProblem`: anything that names no device: an interface that cannot be
  identified, a GPU that does not say its minor number. It is logged and shown
  by the CLI, never reported as a device of the pool.

A source whose scan fails as a whole (it raises: an interrupted netlink dump,
NVML not answering) keeps its last good result: its devices stay published and
preparable, because one bad scan says nothing about the hardware. The failure
is logged once per streak and the source retried with exponential backoff
(`RETRY_FIRST` doubling up to `RETRY_MAX` seconds; the daemon waits for it with
`Inventory.wait_retry`). Once a source has failed continuously for
`STALE_AFTER` seconds (180 s: three periodic rescans at the default interval),
its kept devices are reported UNKNOWN on the health stream until a scan of it
succeeds again. A `DiscoveryError` from a source that has never scanned
successfully still propagates: the source cannot work as configured.

Every scan of a kind takes a sequence number when it starts; a result that
finishes after a later-started scan's result was stored is dropped, so
concurrent scans finishing out of order never bring back older data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from agent.errors import ClaimFailure
from agent.model import Device

log = logging.getLogger(__name__)

# Seconds a source may fail continuously before its kept devices are reported UNKNOWN.
STALE_AFTER = 180.0
# Backoff between retries of a failing source: the first retry after RETRY_FIRST seconds,
# doubling up to RETRY_MAX (the periodic rescan retries it too, whatever the backoff says).
RETRY_FIRST = 2.0
RETRY_MAX = 60.0


class DiscoveryError(RuntimeError):
    """A source cannot work as configured (e.g. NVIDIA hardware present but NVML does not load)."""


class ScanError(Exception):
    """This scan of a source failed as a whole (a netlink dump interrupted again and again, NVML
    not answering); the inventory keeps the source's last good result and retries."""


@dataclass(frozen=True, slots=True)
class DeviceFailure:
    """A device known by the name it is published under that could not be read this time."""

    device: str
    reason: str

    def __str__(self) -> str:
        return f"{self.device}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Withheld:
    """A device discovery read but does not publish now, because it cannot be used as it is (a whole GPU in
    MIG mode); a prepare of a claim allocated it before raises `error` with the reason."""

    device: str
    reason: str
    error: type[ClaimFailure]

    def __str__(self) -> str:
        return f"{self.device}: {self.reason}"

    def failure(self) -> ClaimFailure:
        return self.error(f"device {self.device}: {self.reason}")


@dataclass(frozen=True, slots=True)
class SourceProblem:
    """A failure that names no device (`what` says what failed: "interface eth3", "GPU at NVML
    index 1"); logged and shown, never reported on the health stream."""

    what: str
    reason: str

    def __str__(self) -> str:
        return f"{self.what}: {self.reason}"


@dataclass
class ScanResult:
    devices: list[Device] = field(default_factory=list)
    failed_devices: list[DeviceFailure] = field(default_factory=list)
    problems: list[SourceProblem] = field(default_factory=list)
    withheld: list[Withheld] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SourceFailure:
    """A source whose scans have failed since `since` (the inventory's clock), `failures` in a row."""

    kind: str
    reason: str
    since: float
    failures: int
    retry_at: float  # when the next retry is due (the inventory's clock)
    stale: bool = False  # failing for STALE_AFTER or longer: its kept devices are of unknown health


class Source(Protocol):
    # The source's name (`gpu`, `nic`, `cpu`, `memory`, `simnic`), which rescans, logs and metrics use:
    # not a device `Kind` (GPU discovery finds devices of five kinds).
    kind: str

    def open(self) -> None: ...

    def scan(self) -> ScanResult: ...

    def close(self) -> None: ...


@dataclass
class Snapshot:
    devices: dict[str, Device]
    failed_devices: list[DeviceFailure]
    problems: list[SourceProblem]
    failing_sources: list[SourceFailure]
    # Published devices whose health is not known now (their source has failed for STALE_AFTER
    # or longer), and why.
    unknown: dict[str, str]
    taken_at: float
    withheld: list[Withheld] = field(default_factory=list)

    def not_published(self) -> list[str]:
        """One line per device, interface or source that discovery could not read, for people."""
        lines = [str(f) for f in self.failed_devices] + [str(p) for p in self.problems]
        lines += [str(w) for w in self.withheld]
        lines += [f"{s.kind} discovery: {s.reason} ({s.failures} failed scans in a row)"
                  for s in self.failing_sources]
        return sorted(lines)


@dataclass
class _KindState:
    """What the inventory holds for one kind of device."""

    started: int = 0  # sequence number of the latest scan started
    good: ScanResult | None = None  # the last good result
    good_seq: int = 0  # the sequence number of the scan that produced `good`
    failure: SourceFailure | None = None
    failure_seq: int = 0  # the sequence number of the latest failed scan of the streak


class Inventory:
    """The node's current devices, kept by kind so one source can be rescanned alone."""

    def __init__(self, sources: Iterable[Source],
                 refine: Callable[[Device], Device | None] | None = None, *,
                 stale_after: float = STALE_AFTER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sources = list(sources)
        # Applied to every scanned device (the daemon drops what the API server would reject, so
        # slices, metadata files and the CLI all show the same device).
        self.refine = refine
        self.stale_after = stale_after
        self.clock = clock
        self._kinds: dict[str, _KindState] = {s.kind: _KindState() for s in self.sources}
        self._index: dict[str, Device] = {}
        self._changed = asyncio.Event()
        self._failures_changed = asyncio.Event()
        self.version = 0
        # Told of every scan of a source: (kind, succeeded, seconds), from the scan's worker thread.
        self.on_scan: Callable[[str, bool, float], None] | None = None

    def open(self) -> None:
        opened: list[Source] = []
        try:
            for source in self.sources:
                source.open()
                opened.append(source)
        except BaseException:
            for source in opened:
                source.close()
            raise

    def close(self) -> None:
        for source in self.sources:
            try:
                source.close()
            except Exception:
                log.exception("closing %s discovery failed", source.kind)

    async def scan(self, kinds: Iterable[str] | None = None) -> bool:
        """Rescan the given kinds (all by default); True when the devices, their failures or
        whether their health is known changed."""
        wanted = set(kinds) if kinds is not None else None
        chosen = [s for s in self.sources if wanted is None or s.kind in wanted]
        # Taken on the event loop before any thread runs, so the numbers order the starts.
        seqs = [self._start(s.kind) for s in chosen]
        outcomes = await asyncio.gather(*(asyncio.to_thread(_scan_one, s, self.on_scan) for s in chosen))
        changed = False
        fatal: DiscoveryError | None = None
        for source, seq, outcome in zip(chosen, seqs, outcomes, strict=True):
            if isinstance(outcome, ScanResult):
                changed |= self._succeeded(source.kind, seq, outcome)
            elif isinstance(outcome, DiscoveryError) and self._kinds[source.kind].good is None:
                fatal = fatal or outcome
            else:
                self._failed(source.kind, seq, outcome)
        changed |= self._mark_stale()
        if changed:
            self._index = {d.name: d for st in self._kinds.values() if st.good for d in st.good.devices}
            self.version += 1
            self._changed.set()
        if fatal is not None:
            raise fatal
        return changed

    def _start(self, kind: str) -> int:
        state = self._kinds[kind]
        state.started += 1
        return state.started

    def _succeeded(self, kind: str, seq: int, result: ScanResult) -> bool:
        state = self._kinds[kind]
        if seq < state.good_seq:
            log.debug("%s scan %d finished after scan %d: its older result is dropped", kind, seq,
                      state.good_seq)
            return False
        if self.refine is not None:
            result.devices = [d for d in map(self.refine, result.devices) if d is not None]
        before, state.good, state.good_seq = state.good, result, seq
        _log_new_failures(kind, before, result)
        if state.failure is not None and seq > state.failure_seq:
            failure, state.failure = state.failure, None
            self._failures_changed.set()
            log.info("%s discovery works again after %d failed scans over %.0fs", kind, failure.failures,
                     self.clock() - failure.since)
            if failure.stale:
                return True  # its devices' health is known again
        return before is None or _key(before) != _key(result)

    def _failed(self, kind: str, seq: int, exc: BaseException) -> None:
        state = self._kinds[kind]
        if seq < state.good_seq:
            return  # a scan started later has already succeeded: this failure is old news
        now = self.clock()
        reason = _describe(exc)
        old = state.failure
        if old is None:
            failure = SourceFailure(kind=kind, reason=reason, since=now, failures=1,
                                    retry_at=now + RETRY_FIRST)
            kept = len(state.good.devices) if state.good else 0
            # Unexpected exceptions get their traceback, once per streak.
            log.warning("%s discovery failed: %s; keeping the %d devices of its last good scan, "
                        "retrying in %.0fs", kind, reason, kept, RETRY_FIRST,
                        exc_info=None if isinstance(exc, ScanError) else exc)
        else:
            failures = old.failures + 1
            delay = min(RETRY_FIRST * 2 ** (failures - 1), RETRY_MAX)
            failure = replace(old, reason=reason, failures=failures, retry_at=now + delay)
            log.debug("%s discovery failed again (%d in a row): %s; next retry in %.0fs", kind, failures,
                      reason, delay)
        state.failure = failure
        state.failure_seq = max(state.failure_seq, seq)
        self._failures_changed.set()

    def _mark_stale(self) -> bool:
        """Flag the sources failing for `stale_after` or longer; True when a kept device's health
        became unknown."""
        now = self.clock()
        changed = False
        for kind, state in self._kinds.items():
            failure = state.failure
            if failure is None or failure.stale or now - failure.since < self.stale_after:
                continue
            state.failure = replace(failure, stale=True)
            kept = len(state.good.devices) if state.good else 0
            log.warning("%s discovery has failed for %.0fs (%d scans in a row): %s", kind, now - failure.since,
                        failure.failures, f"the health of its {kept} kept devices is reported UNKNOWN until a "
                        "scan succeeds" if kept else "none of its devices is published")
            changed |= kept > 0
        return changed

    def snapshot(self) -> Snapshot:
        devices: dict[str, Device] = {}
        failed: list[DeviceFailure] = []
        problems: list[SourceProblem] = []
        withheld: list[Withheld] = []
        unknown: dict[str, str] = {}
        for state in self._kinds.values():
            failure = state.failure
            if state.good is not None:
                for dev in state.good.devices:
                    devices[dev.name] = dev
                    if failure is not None and failure.stale:
                        # No elapsed time or count in it: the health stream resends a changed message.
                        unknown[dev.name] = (f"{failure.kind} discovery has failed for more than "
                                             f"{_duration(self.stale_after)}; the device is kept from its "
                                             f"last good scan: {failure.reason}")
                failed += state.good.failed_devices
                problems += state.good.problems
                withheld += state.good.withheld
        failing = [st.failure for st in self._kinds.values() if st.failure is not None]
        return Snapshot(devices=devices, failed_devices=failed, problems=problems, failing_sources=failing,
                        unknown=unknown, taken_at=time.time(), withheld=withheld)

    def devices(self) -> list[Device]:
        return sorted(self.snapshot().devices.values(), key=lambda d: d.name)

    def get(self, name: str) -> Device | None:
        return self._index.get(name)

    def judges(self, name: str) -> bool:
        """Whether the absence of device `name` means it is not on the node: every source has scanned
        and its latest scan succeeded, and none named the device as one it could not read."""
        return all(st.good is not None and st.failure is None
                   and not any(f.device == name for f in st.good.failed_devices) for st in self._kinds.values())

    def withheld(self, name: str) -> Withheld | None:
        """Why device `name` is not published now, when discovery withholds it (None: it is not)."""
        return next((w for st in self._kinds.values() if st.good for w in st.good.withheld if w.device == name),
                    None)

    def source_failures(self) -> list[SourceFailure]:
        """The sources whose latest scans failed, by kind."""
        return sorted((st.failure for st in self._kinds.values() if st.failure is not None),
                      key=lambda f: f.kind)

    async def wait_retry(self, timeout: float) -> list[str]:
        """Wait up to `timeout` seconds for a failing source's retry to fall due; the kinds due
        then (empty when the time ran out first)."""
        deadline = self.clock() + timeout
        while True:
            self._failures_changed.clear()
            now = self.clock()
            due = sorted(f.kind for f in self.source_failures() if f.retry_at <= now)
            if due or now >= deadline:
                return due
            wake = min([deadline] + [f.retry_at for f in self.source_failures()])
            # A failure recorded meanwhile (a scan on a netlink event) may be due sooner.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._failures_changed.wait(), wake - now)

    async def wait_changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()


def _scan_one(source: Source, observe: Callable[[str, bool, float], None] | None = None) -> ScanResult | Exception:
    """The source's result, or what it raised (the inventory decides what a failure means)."""
    started = time.monotonic()
    try:
        result = source.scan()
    except Exception as exc:
        if observe is not None:
            observe(source.kind, False, time.monotonic() - started)
        return exc
    if observe is not None:
        observe(source.kind, True, time.monotonic() - started)
    log.debug("%s discovery: %d devices in %.1f ms", source.kind, len(result.devices),
              (time.monotonic() - started) * 1000)
    return result


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, ScanError) and text:
        return text  # written for people already
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _duration(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def _log_new_failures(kind: str, before: ScanResult | None, after: ScanResult) -> None:
    # Said when a failure appears or its reason changes, not on every rescan.
    old: set[object] = set(before.failed_devices) | set(before.problems) | set(before.withheld) if before else set()
    for item in sorted(map(str, (set(after.failed_devices) | set(after.problems) | set(after.withheld)) - old)):
        log.warning("%s not published: %s", kind, item)


def _key(result: ScanResult) -> tuple[object, ...]:
    return (tuple(sorted((d.name, repr(d)) for d in result.devices)),
            tuple(sorted((f.device, f.reason) for f in result.failed_devices)))

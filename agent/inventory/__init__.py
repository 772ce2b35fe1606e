"""Device discovery: one source per kind of device, all behind one small interface.

A source is opened once (it may hold a library handle, like NVML), scanned as
often as needed, and closed at exit. Scans are blocking (NVML, sysfs, netlink
dumps) and run in worker threads; the inventory gathers them concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from agent.model import Device

log = logging.getLogger(__name__)


class DiscoveryError(RuntimeError):
    """A source cannot work as configured (e.g. NVIDIA hardware present but NVML does not load)."""


@dataclass
class ScanResult:
    devices: list[Device] = field(default_factory=list)
    # Devices known by name that could not be published this time, and why
    # (an NVML call that failed, a NIC whose sysfs vanished mid-read).
    failed: dict[str, str] = field(default_factory=dict)


class Source(Protocol):
    kind: str

    def open(self) -> None: ...

    def scan(self) -> ScanResult: ...

    def close(self) -> None: ...


@dataclass
class Snapshot:
    devices: dict[str, Device]
    failed: dict[str, str]
    taken_at: float


class Inventory:
    """The node's current devices, kept by kind so one source can be rescanned alone."""

    def __init__(self, sources: Iterable[Source],
                 refine: Callable[[Device], Device | None] | None = None) -> None:
        self.sources = list(sources)
        # Applied to every scanned device (the daemon drops what the API server would reject, so
        # slices, metadata files and the CLI all show the same device).
        self.refine = refine
        self._by_kind: dict[str, ScanResult] = {}
        self._index: dict[str, Device] = {}
        self._changed = asyncio.Event()
        self.version = 0

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
        """Rescan the given kinds (all by default); True when the device set changed."""
        wanted = set(kinds) if kinds is not None else None
        chosen = [s for s in self.sources if wanted is None or s.kind in wanted]
        results = await asyncio.gather(*(asyncio.to_thread(_scan_one, s) for s in chosen))
        if self.refine is not None:
            for result in results:
                result.devices = [d for d in map(self.refine, result.devices) if d is not None]
        changed = False
        for source, result in zip(chosen, results, strict=True):
            before = self._by_kind.get(source.kind)
            if before is None or _key(before) != _key(result):
                changed = True
            self._by_kind[source.kind] = result
        if changed:
            self._index = {d.name: d for r in self._by_kind.values() for d in r.devices}
            self.version += 1
            self._changed.set()
        return changed

    def snapshot(self) -> Snapshot:
        devices: dict[str, Device] = {}
        failed: dict[str, str] = {}
        for result in self._by_kind.values():
            for dev in result.devices:
                devices[dev.name] = dev
            failed.update(result.failed)
        return Snapshot(devices=devices, failed=failed, taken_at=time.time())

    def devices(self) -> list[Device]:
        return sorted(self.snapshot().devices.values(), key=lambda d: d.name)

    def get(self, name: str) -> Device | None:
        return self._index.get(name)

    async def wait_changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()


def _scan_one(source: Source) -> ScanResult:
    started = time.monotonic()
    try:
        result = source.scan()
    except DiscoveryError:
        raise
    except Exception as exc:
        # One broken source must not stop the others from being published.
        log.exception("%s discovery failed", source.kind)
        return ScanResult(failed={f"<{source.kind}>": f"discovery failed: {exc}"})
    for name, why in sorted(result.failed.items()):
        log.warning("%s %s not published: %s", source.kind, name, why)
    log.debug("%s discovery: %d devices in %.1f ms", source.kind, len(result.devices),
              (time.monotonic() - started) * 1000)
    return result


def _key(result: ScanResult) -> tuple[object, ...]:
    return (tuple(sorted((d.name, repr(d)) for d in result.devices)), tuple(sorted(result.failed.items())))

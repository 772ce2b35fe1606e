"""Dynamic MIG: every valid placement of the MIG profiles chosen (`--mig-profiles`) that a GPU offers,
published as a device on the GPU's counter set, so the scheduler only picks placements that fit together.

NVML says what a GPU can be split into: `nvmlDeviceGetGpuInstanceProfileInfo` for each
NVML_GPU_INSTANCE_PROFILE_* (NOT_SUPPORTED: the GPU does not offer it, skipped) and
`nvmlDeviceGetGpuInstancePossiblePlacements` for each profile offered (a placement is a run of memory
slices: `start`, `size`). These are facts of the hardware, read once per GPU and kept (a GPU bound to
vfio-pci leaves NVML, and its counter set must not change meanwhile).

Devices: `gpu-<minor>-mig-<profile>-<start>`, the profile name with everything but letters and digits
dropped (`1g.10gb+me` at slice 3 -> `gpu-0-mig-1g10gbme-3`); kind `mig`, its facts the parent GPU and the
placement (`agent.facts.MigPlacement`), which prepare creates (`agent.hostprep.mig`). Attributes
(`agent.inventory.published`): `type=mig`, `profile`, `parentUUID`, `placementStart`, `placementSize`,
the parent's product, brand, architecture, compute capability, driver and CUDA versions and standard
PCI attributes. Capacities: `multiprocessors`, `copyEngines`, `decoders`, `encoders`, `jpegEngines`,
`ofaEngines`, `memory`.

Which profiles (`--mig-profiles`, `agent.facts.MigChoice`): every placement of every profile is 25 devices per H100,
and the scheduler converts and checks every device of a node for every pod it places there, whatever
the pod asks for (docs/benchmarks.md, "The scheduler"). So by default only the plainest profile of the
common compute sizes is published (`1g,2g,3g,7g`: on an H100 1g.10gb, 2g.20gb, 3g.40gb, 7g.80gb, 13
placements); `all` publishes every one, or an operator names the profiles.

The counter model (`agent.counters`): one `memory-slice-<i>` per memory slice, taken by each placement
covering it, is exactly NVML's rule (two GPU instances never share a memory slice); an
`instances-<profile>` counter carries a profile's instance limit where it binds; an engine counter is
set to the most any set of placements NVML accepts can use together, so it never refuses such a set,
and published only where it binds. An engine belongs to one GPU instance, and the GPU has no more of it
than its largest profile (the whole GPU's) holds: no set beyond that is accepted, which is what keeps
an A30's two media profiles (1g.6gb+me, 2g.12gb+me: one JPEG and one OFA engine each, the GPU has one
of each) apart; where no set the memory slices and instance limits allow goes beyond the GPU's engines
(an H100's), the counter would never refuse anything and is left out. `memory` is taken by every
placement; the whole GPU's forms take all of it (`counters.whole_gpu`), which keeps every placement off
a GPU one of them holds. tests/test_mig.py proves both directions against NVIDIA's published profiles
(tests/mig_facts.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import pynvml

from agent import apirules, counters, quantity
from agent.facts import GpuFacts, MigChoice, MigPlacement
from agent.inventory.nvmlapi import Nvml, NvmlHandle
from agent.inventory.published import form_attributes
from agent.kinds import Kind
from agent.model import Capacity, CounterConsumption, CounterSet, Device

log = logging.getLogger(__name__)

MIB = 1 << 20
# Capacity name of each engine counter (same order as counters.ENGINE_COUNTERS).
ENGINE_CAPACITIES = ("multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines", "ofaEngines")
# NVML's answers for a profile this GPU or driver does not offer.
_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT,
           pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
_NOT_LABEL = re.compile(r"[^a-z0-9]")


class MigReadError(Exception):
    """NVML failed while describing a GPU's MIG profiles (not a profile it lacks)."""


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU instance profile as NVML describes it on one GPU."""

    enum: int  # NVML_GPU_INSTANCE_PROFILE_*
    id: int  # the profile id NVML uses for placements and creation
    name: str  # "1g.10gb+me"
    compute_slices: int
    instances: int  # the most instances at once
    engines: tuple[int, ...]  # in counters.ENGINE_COUNTERS order
    memory: int  # bytes
    starts: tuple[int, ...]  # placements: first memory slice of each
    size: int  # memory slices a placement covers

    @property
    def label(self) -> str:
        """The profile in device names: `1g.10gb+me` -> `1g10gbme`."""
        return _NOT_LABEL.sub("", self.name.lower())


@dataclass(frozen=True, slots=True)
class MigLayout:
    """What one GPU can be split into."""

    profiles: tuple[MigProfile, ...]
    memory_slices: int

    @property
    def engine_limits(self) -> tuple[int, ...]:
        """The GPU's engines: its largest profile's (the whole GPU's), in counters.ENGINE_COUNTERS order."""
        return tuple(max(p.engines[k] for p in self.profiles) for k in range(len(counters.ENGINE_COUNTERS)))

    def counters(self, gpu_memory: int, chosen: Sequence[MigProfile] | None = None) -> dict[str, str]:
        """The MIG counters of the GPU's set (added to `gpu` and `memory`) for the placements of `chosen`
        (None: every profile): every slice, the engines any accepted set of them could take beyond the
        GPU's (at the most an accepted set uses), the binding instance limits, and memory."""
        profiles = self.profiles if chosen is None else tuple(chosen)
        most, binds = _most_used(self, profiles)
        out = {counters.memory_slice(i): "1" for i in range(self.memory_slices)}
        out |= {name: str(n) for name, n, bind in zip(counters.ENGINE_COUNTERS, most[1:], binds, strict=True)
                if bind and n > 0}
        out |= {_instances(p): str(p.instances) for p in profiles if p.instances < len(p.starts)}
        out[counters.MEMORY_COUNTER] = quantity.binary(max(gpu_memory, most[0]))
        return out


def device_name(minor: int, profile: MigProfile, start: int) -> str:
    return counters.fit_label(f"gpu-{minor}-mig-{profile.label}-{start}")


def _instances(profile: MigProfile) -> str:
    return counters.fit_label(f"{counters.INSTANCES_PREFIX}{profile.label}")


def read_layout(nvml: Nvml, handle: NvmlHandle) -> MigLayout | None:
    """The GPU's MIG profiles and placements from NVML; None when it offers none."""
    profiles: dict[int, MigProfile] = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum)
            if int(info.id) in profiles:
                continue
            count = ctypes.c_uint(0)
            nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, None, ctypes.byref(count))
            placements = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
            nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, placements, ctypes.byref(count))
        except pynvml.NVMLError as exc:
            if exc.value in _ABSENT:
                continue
            raise MigReadError(f"GPU instance profile {enum}: {exc}") from exc
        found = [(int(p.start), int(p.size)) for p in placements[: count.value]]
        sizes = {size for _, size in found}
        if len(sizes) != 1:
            continue  # no placement, or placements of several sizes: not a shape this model knows
        memory = int(info.memorySizeMB) * MIB
        raw = _text(getattr(info, "name", b""))  # v1 structs have no name
        name = raw.removeprefix("MIG ").strip() or f"{int(info.sliceCount)}g.{round(memory / 2**30)}gb"
        profiles[int(info.id)] = MigProfile(
            enum=enum, id=int(info.id), name=name, compute_slices=int(info.sliceCount),
            instances=int(info.instanceCount),
            engines=(int(info.multiprocessorCount), int(info.copyEngineCount), int(info.decoderCount),
                     int(info.encoderCount), int(info.jpegCount), int(info.ofaCount)),
            memory=memory, starts=tuple(sorted(start for start, _ in found)), size=sizes.pop())
    if not profiles:
        return None
    slices = max(start + p.size for p in profiles.values() for start in p.starts)
    return MigLayout(tuple(sorted(profiles.values(), key=lambda p: (p.size, p.compute_slices, p.name))), slices)


def _text(value: object) -> str:
    """A char array field as pynvml hands it over: bytes, or str where it decodes them."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value if isinstance(value, str) else ""


def find_profile(nvml: Nvml, handle: NvmlHandle, name: str) -> MigProfile | None:
    """The profile called `name` on the GPU `handle`, for prepare (None: the GPU does not offer it)."""
    layout = read_layout(nvml, handle)
    return next((p for p in layout.profiles if p.name == name), None) if layout else None


@functools.lru_cache(maxsize=32)
def _most_used(layout: MigLayout, profiles: tuple[MigProfile, ...]) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """(memory, *engines): the most of each that one set of `profiles`' placements NVML accepts uses
    together (no shared memory slice, no profile beyond its instance limit, no engine beyond the GPU's);
    and for each engine whether it binds: some set the memory slices and instance limits allow takes more
    of it than the GPU has (else its counter would never refuse a set, and is left out)."""
    options = [(p, s) for p in profiles for s in p.starts]
    best = [0] * (1 + len(counters.ENGINE_COUNTERS))
    limits = layout.engine_limits
    binds = [False] * len(limits)

    def walk(i: int, used: int, counts: dict[int, int], total: list[int]) -> None:
        over = [t > most for t, most in zip(total[1:], limits, strict=True)]
        binds[:] = [b or o for b, o in zip(binds, over, strict=True)]
        if not any(over):
            for k in range(len(best)):
                best[k] = max(best[k], total[k])
        for j in range(i, len(options)):
            p, start = options[j]
            mask = ((1 << p.size) - 1) << start
            if used & mask or counts.get(p.id, 0) >= p.instances:
                continue
            counts[p.id] = counts.get(p.id, 0) + 1
            walk(j + 1, used | mask, counts, [t + v for t, v in zip(total, (p.memory, *p.engines), strict=True)])
            counts[p.id] -= 1

    walk(0, 0, {}, [0] * len(best))
    return tuple(best), tuple(binds)




@dataclass(slots=True)
class MigDevices:
    """MIG devices and the MIG counters of each GPU's set, kept across scans by bus ID."""

    choice: MigChoice  # `--mig-profiles`
    layouts: dict[str, MigLayout] = field(default_factory=dict)  # every profile NVML offers
    _said: dict[str, str] = field(default_factory=dict)

    def learn(self, nvml: Nvml, handle: NvmlHandle, bus_id: str) -> None:
        """Read the GPU's profiles once (they do not change); a failure is logged once and retried
        at the next scan, without costing the GPU."""
        if bus_id in self.layouts:
            return
        try:
            layout = read_layout(nvml, handle)
        except MigReadError as exc:
            self._note(bus_id, f"GPU {bus_id}: MIG profiles not read, no MIG devices yet: {exc}")
            return
        if layout is None:
            self._note(bus_id, f"GPU {bus_id}: MIG capable but NVML lists no MIG profile (with MIG mode "
                       "off some drivers answer only once it is on): no MIG devices")
            return
        chosen = self.choice.pick(layout.profiles)
        extra = layout.counters(0, chosen)
        if len(extra) + 2 > apirules.MAX_COUNTERS_PER_SET:
            self._note(bus_id, f"GPU {bus_id}: its MIG counters ({len(extra)}) do not fit one counter set "
                       f"of {apirules.MAX_COUNTERS_PER_SET}: no MIG devices", logging.WARNING)
            return
        if chosen:
            self._said.pop(bus_id, None)
        else:
            self._note(bus_id, f"GPU {bus_id}: none of its MIG profiles ({', '.join(p.name for p in layout.profiles)})"
                       " is one --mig-profiles names: no MIG devices")
        self.layouts[bus_id] = layout

    def apply(self, devices: Sequence[Device]) -> list[Device]:
        """`devices` with each known GPU's set extended by the MIG counters of its chosen profiles (every
        device consuming the set takes the whole GPU: `counters.whole_gpu`), plus the MIG devices of each
        native GPU."""
        out: list[Device] = []
        for dev in devices:
            bus = dev.pci_bus_id
            layout = self.layouts.get(bus) if bus else None
            chosen = self.choice.pick(layout.profiles) if layout is not None else ()
            name = counters.gpu_counter_set_name(bus) if bus else ""
            if not chosen or not any(c.counter_set.name == name for c in dev.consumes_counters):
                out.append(dev)
                continue
            assert layout is not None  # chosen from it
            uses = tuple(counters.whole_gpu(_extended(c.counter_set, layout, chosen))
                         if c.counter_set.name == name else c for c in dev.consumes_counters)
            dev = dataclasses.replace(dev, consumes_counters=uses)
            out.append(dev)
            if dev.kind is Kind.GPU:
                out += _partitions(dev, chosen, next(c.counter_set for c in uses if c.counter_set.name == name))
        return out

    def _note(self, key: str, message: str, level: int = logging.INFO) -> None:
        if self._said.get(key) != message:
            self._said[key] = message
            log.log(level, "%s", message)


def _extended(cs: CounterSet, layout: MigLayout, chosen: Sequence[MigProfile]) -> CounterSet:
    memory = cs.counters.get(counters.MEMORY_COUNTER)
    return counters.with_counters(cs, layout.counters(quantity.parse_int(memory) if memory else 0, chosen))


def _partitions(parent: Device, profiles: Sequence[MigProfile], cs: CounterSet) -> list[Device]:
    gpu = parent.gpu
    if gpu is None:
        return []
    out = []
    for p in profiles:
        for start in p.starts:
            facts = GpuFacts(gpu, MigPlacement(p.name, start, p.size))
            caps = {c: Capacity(str(n)) for c, n in zip(ENGINE_CAPACITIES, p.engines, strict=True)}
            caps["memory"] = Capacity(quantity.binary(p.memory))
            use = {counters.memory_slice(i): "1" for i in range(start, start + p.size)}
            use |= {k: str(n) for k, n in zip(counters.ENGINE_COUNTERS, p.engines, strict=True)
                    if n > 0 and k in cs.counters}
            if _instances(p) in cs.counters:
                use[_instances(p)] = "1"
            use[counters.MEMORY_COUNTER] = quantity.binary(p.memory)
            out.append(Device(
                name=device_name(gpu.minor, p, start), kind=Kind.MIG,
                attributes=form_attributes(parent.attributes, facts), capacity=caps, node=facts,
                consumes_counters=(CounterConsumption(cs, use),)))
    return out

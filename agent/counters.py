"""Shared counter sets: one per physical function (a GPU, a NIC PF or VF), and how the pool carries them.

Every form in which one function can be handed out consumes the function's counter set, so the
scheduler (with `DRAPartitionableDevices`, on by default since 1.36) never allocates two forms that
do not fit together: the native device and its passthrough (VFIO) variant both consume all of it.

Counters, named so that later partitioning only adds counters and never renames one:

- GPU, set `gpu-<bus id>-counters`: `gpu` = 1 (the whole GPU: only the full device and its
  passthrough variant take it) and `memory` = its memory in bytes (when NVML has said it). A GPU that
  publishes MIG placements (`agent.inventory.mig`) also has one `memory-slice-<i>` = 1 per memory
  slice, its engines (`multiprocessors`, `copy-engines`, `decoders`, `encoders`, `jpeg-engines`,
  `ofa-engines`, those it has), and `instances-<profile>` for a profile NVML allows fewer instances of
  than it has placements (`1g.10gb+me`: one); the engines only where they bind. A MIG device takes its
  memory, engines, the slices its placement covers and one instance; the full GPU, its variant and its
  shared form take `gpu` and all of `memory` (`whole_gpu`), which every partial form takes some of.
- NIC function, set `nic-<bus id>-counters`: `ports` = the network ports of the function (1 for a
  VF). Each native port device takes 1, the passthrough variant all of them, so two ports of one
  function still go to two claims, and a function passed through takes both.

Names derive from the PCI bus ID, never from NVML's minor number: a function bound to vfio-pci is
gone from NVML and from the host driver's lists, and its devices must keep their names meanwhile
(the scheduler matches allocations and counter consumption by name).

Compatibility groups (`consumesCounters[].compatibilityGroups`, KEP-5963, alpha in 1.37 behind
`DRADeviceCompatibilityGroups`, off by default): devices consuming one counter set may be allocated
together only when all of them share a group, and a device without groups only with siblings without
groups. `with_compatibility_groups` marks, by kind, MIG placements `mig` and vGPU (mediated) devices
`vgpu-<type id>` (one group per type), so the scheduler never mixes the two on one GPU, nor two vGPU
types (the driver refuses both mixes; the counters alone would let a small vGPU sit beside a small MIG
instance, or a small vGPU of one type beside one of another). The full GPU,
its passthrough variant and its shared form (`gpushare`) get no group: each takes the whole GPU, so
the counters already keep everything else off the GPU while one of them is allocated, and "no group"
says the same a second time (never co-allocatable with a grouped device). The slice builder applies
it only when the cluster has the gate on: with the gate off the API server drops the field and the
scheduler then skips the pool's devices that had it as an incomplete pool.

`pack` turns validated devices into the pool's counter slices: each counter set any device consumes,
once, at most `apirules.MAX_COUNTER_SETS_PER_SLICE` per slice.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent import apirules, quantity
from agent.facts import GpuFacts, VgpuType
from agent.kinds import Kind
from agent.model import CounterConsumption, CounterSet, Device

GPU_COUNTER = "gpu"
MEMORY_COUNTER = "memory"
MEMORY_SLICE_PREFIX = "memory-slice-"
INSTANCES_PREFIX = "instances-"
# A GPU's engine counters (DNS labels), in the order MIG devices publish them as capacities.
ENGINE_COUNTERS = ("multiprocessors", "copy-engines", "decoders", "encoders", "jpeg-engines", "ofa-engines")
PORTS_COUNTER = "ports"
VFIO_SUFFIX = "-vfio"
COUNTERS_SUFFIX = "-counters"


def fit_label(name: str, limit: int = 63) -> str:
    """`name` when it is at most `limit` characters; else cut and given a digest of the whole, so two
    long names stay apart and the same long name always gives the same label."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[: limit - len(digest) - 1].rstrip('-')}-{digest}"


def pci_label(prefix: str, bus_id: str) -> str:
    """`gpu`, `0000:18:00.0` -> `gpu-0000-18-00-0`."""
    return f"{prefix}-{bus_id.replace(':', '-').replace('.', '-')}"


def passthrough_name(prefix: str, bus_id: str) -> str:
    """The passthrough variant's device name: `gpu-0000-18-00-0-vfio`, `nic-0000-4b-00-2-vfio`."""
    return fit_label(pci_label(prefix, bus_id) + VFIO_SUFFIX)


def counter_set_name(prefix: str, bus_id: str) -> str:
    """The function's counter set: `gpu-0000-18-00-0-counters`, `nic-0000-4b-00-2-counters`."""
    return fit_label(pci_label(prefix, bus_id) + COUNTERS_SUFFIX)


def gpu_counter_set_name(bus_id: str) -> str:
    """The counter set of the GPU at `bus_id`, which all of its forms consume."""
    return counter_set_name(Kind.GPU, bus_id)


def gpu_counter_set(bus_id: str, memory: int | None) -> CounterSet:
    counters = {GPU_COUNTER: "1"}
    if memory is not None and memory > 0:
        counters[MEMORY_COUNTER] = quantity.binary(memory)
    return CounterSet(gpu_counter_set_name(bus_id), counters)


def whole_gpu(counter_set: CounterSet) -> CounterConsumption:
    """What a form that takes the whole GPU (the GPU itself, its passthrough variant, its shared form)
    consumes from the GPU's set: `gpu` and all of `memory`, not the counters MIG adds. Every partial form
    (a MIG placement, a vGPU) takes some of `memory`, so that keeps them off a GPU a whole form holds, and
    `gpu` keeps the whole forms apart. Taking every counter of the set would say the same with 14 more on
    an H100, each converted and checked by the scheduler for every pod (docs/benchmarks.md, "The
    scheduler")."""
    return CounterConsumption(counter_set, {k: v for k, v in counter_set.counters.items()
                                            if k in (GPU_COUNTER, MEMORY_COUNTER)})


def memory_slice(index: int) -> str:
    """The counter of one memory slice of a GPU: `memory-slice-3`."""
    return f"{MEMORY_SLICE_PREFIX}{index}"


def with_counters(counter_set: CounterSet, extra: Mapping[str, str]) -> CounterSet:
    """`counter_set` with `extra` counters added (or replacing those of the same name)."""
    return CounterSet(counter_set.name, {**counter_set.counters, **extra})


def nic_counter_set(bus_id: str, ports: int) -> CounterSet:
    return CounterSet(counter_set_name(Kind.NIC, bus_id), {PORTS_COUNTER: str(max(ports, 1))})


def one_port(counter_set: CounterSet) -> CounterConsumption:
    """What one native port of a NIC function takes from its set."""
    return CounterConsumption(counter_set, {PORTS_COUNTER: "1"})


def vgpu_type_group(type_id: str) -> str:
    """The compatibility group of the devices of one vGPU type: `vgpu-nvidia-1021`."""
    return fit_label(f"vgpu-{type_id.lower()}")


def with_compatibility_groups(dev: Device) -> Device:
    """`dev` with the compatibility group of its kind (`Kind.compatibility_group`) on every counter set it
    consumes (unchanged when its kind has none)."""
    group = dev.kind.compatibility_group
    groups = (group,) if group else ()
    if isinstance(dev.node, GpuFacts) and isinstance(target := dev.node.target, VgpuType):
        groups = (vgpu_type_group(target.id),)  # one type per GPU at a time, as the driver allows
    if not groups or not dev.consumes_counters:
        return dev
    uses = tuple(dataclasses.replace(c, compatibility_groups=groups) for c in dev.consumes_counters)
    return dataclasses.replace(dev, consumes_counters=uses)


# -- the pool's counter slices ----------------------------------------------------------------------

@dataclass(slots=True)
class Packed:
    """Counter sets (API form) split into slices, the devices that may be published with them, and
    what was dropped on the way."""

    slices: list[list[dict[str, Any]]] = field(default_factory=list)
    devices: list[tuple[Device, dict[str, Any]]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def pack(devices: Iterable[tuple[Device, dict[str, Any]]]) -> Packed:
    """The counter slices for `devices` (each with its sanitized API form, in the pool's order).

    A device is kept only when every set it consumes can be published: a set that breaks a rule, or
    whose definition differs from the one an earlier device (in that order) brought, drops the devices
    that consume it, since publishing them without it would let the scheduler hand out the hardware
    twice (or not at all)."""
    out = Packed()
    sets: dict[str, CounterSet] = {}
    bad: dict[str, str] = {}
    for dev, wire in devices:
        problem = ""
        for c in dev.consumes_counters:
            problem = _check_set(c.counter_set, sets, bad) or _check_use(c)
            if problem:
                break
        if problem:
            out.dropped.append(f"device {dev.name!r} dropped: {problem}")
            continue
        for c in dev.consumes_counters:
            sets.setdefault(c.counter_set.name, c.counter_set)
        out.devices.append((dev, wire))
    ordered = [sets[name].wire() for name in sorted(sets)]
    step = apirules.MAX_COUNTER_SETS_PER_SLICE
    out.slices = [ordered[i: i + step] for i in range(0, len(ordered), step)]
    return out


def _check_set(cs: CounterSet, sets: Mapping[str, CounterSet], bad: dict[str, str]) -> str:
    if cs.name in bad:
        return bad[cs.name]
    known = sets.get(cs.name)
    if known is not None:
        if known != cs:
            return (f"counter set {cs.name!r} is defined as {dict(cs.counters)} here but as "
                    f"{dict(known.counters)} by an earlier device")
        return ""
    if errs := apirules.counter_set_errors(cs.wire()):
        bad[cs.name] = f"counter set {cs.name!r} is invalid: {'; '.join(errs)}"
        return bad[cs.name]
    return ""


def _check_use(c: CounterConsumption) -> str:
    missing = sorted(set(c.counters) - set(c.counter_set.counters))
    if missing:
        return f"it consumes counters {missing} that counter set {c.counter_set.name!r} does not have"
    return ""

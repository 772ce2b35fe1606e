"""Which CPUs a claim gets of a CPU device (`cpu-numa<N>`).

A claim that holds the device whole gets all of its CPUs. A claim that holds a share of it (the device
allows multiple allocations: node-allocatable CPUs, or `--kubevirt-cpu`) gets as many CPUs as its result's
`consumedCapacity` says, chosen here at prepare from those no other claim prepared on this node holds:
whole cores first (all the hardware threads of a core, as a VM's dedicated vCPUs want them), then single
threads, of cores already split before whole ones. The choice is the claim's `cpuset`: in its metadata
file (`cpuset` in the kernel's list form, beside `shareID` and `consumedCapacity`) and its environment
(`DRA_<DEVICE>_CPUS`), so the record holds it and a restart, a repair or a refresh keeps it.

What other claims hold is read from their records (`held_cpus`): the metadata files the record keeps.
Prepare chooses with the device's lock held, so two claims of this agent never take the same CPUs; an
agent overlapping it in a rolling update does not share that lock (its own prepares of the same device
could choose alike in the moment both run), and the kubelet sends a claim's calls to one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from agent import quantity
from agent.claims import metadata
from agent.claims.records import ClaimRecord
from agent.errors import ClaimFailure
from agent.facts import CpuFacts
from agent.inventory.numa import parse_cpulist


class NotEnoughCpus(ClaimFailure):
    """The share asks for more CPUs than the device has free on this node now (claims the scheduler
    has let go of are still prepared here): retryable, once they are unprepared."""


def share_size(alloc: metadata.AllocatedDevice) -> int | None:
    """How many CPUs a result holding a share of a CPU device asks for (its consumed amount of the
    device's one capacity); None for a result that holds the device whole, or has admin access (it takes no
    CPUs from the others: it sees the device's)."""
    if not isinstance(alloc.device.node, CpuFacts) or not alloc.share_id or alloc.admin_access:
        return None
    amounts = [alloc.consumed[name] for name in alloc.device.capacity if name in alloc.consumed]
    if len(amounts) != 1:
        return None
    try:
        return quantity.parse_int(amounts[0])
    except ValueError:
        return None


def choose(facts: CpuFacts, want: int, taken: set[int]) -> tuple[int, ...] | None:
    """`want` CPUs of the device not in `taken`: whole free cores first, then threads of cores already
    split, then threads of whole cores; None when fewer than `want` are free."""
    cores = facts.cores or tuple((c,) for c in facts.cpus)
    free_cores = [core for core in cores if not set(core) & taken]
    split = [c for core in cores if set(core) & taken for c in core if c not in taken]
    if sum(len(core) for core in free_cores) + len(split) < want:
        return None
    got: list[int] = []
    rest: list[tuple[int, ...]] = []
    for core in free_cores:
        if len(got) + len(core) <= want:
            got += core
        else:
            rest.append(core)
    for cpu in [*split, *(c for core in rest for c in core)]:
        if len(got) == want:
            break
        got.append(cpu)
    return tuple(sorted(got))


def assign(devices: Sequence[metadata.AllocatedDevice], held: Mapping[str, set[int]]) \
        -> list[metadata.AllocatedDevice]:
    """`devices` with the CPUs each share of a CPU device gets (`AllocatedDevice.cpus`), chosen around
    `held` (device name -> CPUs other claims hold) and each other. NotEnoughCpus when one does not fit."""
    taken = {name: set(cpus) for name, cpus in held.items()}
    out = []
    for alloc in devices:
        want = share_size(alloc)
        facts = alloc.device.node
        if want is None or not isinstance(facts, CpuFacts) or alloc.cpus:
            out.append(alloc)
            continue
        mine = taken.setdefault(alloc.device.name, set())
        cpus = choose(facts, want, mine)
        if cpus is None:
            free = len(set(facts.cpus) - mine)
            raise NotEnoughCpus(f"device {alloc.device.name}: the share of request {alloc.request} asks for {want} "
                                f"CPUs and {free} are free on this node (the others are prepared for other claims; "
                                "retry once they are unprepared)")
        mine.update(cpus)
        out.append(dataclasses.replace(alloc, cpus=cpus))
    return out


def recorded_cpus(record: ClaimRecord) -> dict[tuple[str, str, str], tuple[int, ...]]:
    """(request, device, share ID) -> the CPUs the claim's metadata files say it got."""
    out: dict[tuple[str, str, str], tuple[int, ...]] = {}
    for key, dev in metadata.recorded_entries(record):
        text = dev.get("cpuset")
        if isinstance(text, str) and text:
            try:
                out[key] = tuple(parse_cpulist(text))
            except ValueError:
                continue
    return out


def held_cpus(records: Iterable[ClaimRecord], devices: set[str]) -> dict[str, set[int]]:
    """Device name -> the CPUs these claims' records give their shares of it."""
    out: dict[str, set[int]] = {}
    for record in records:
        for (_, device, share), cpus in recorded_cpus(record).items():
            if device in devices and share:
                out.setdefault(device, set()).update(cpus)
    return out

"""vGPU (mediated device) types published as devices on each GPU's counter set.

A GPU whose host driver offers mediated device types (`mdev_supported_types`, `agent.host.mdev`: on the
GPU, or on each of its SR-IOV VFs where the vGPU manager enabled them, Ampere and later) gets,
for each type, one device per instance the type allows: `gpu-<minor>-vgpu-<type id>-<i>` for
i < the type's instance limit (`gpu-0-vgpu-nvidia-1021-0` .. `-19`), kind `vgpu`, its facts the parent
GPU and the type (`agent.facts.VgpuType`). Attributes (`agent.inventory.published`): `type=vgpu`,
`vgpuType` (the type's name, `GRID H100-4C`), `mdevType` (its id, `nvidia-1021`), `parentUUID`, and
the parent's product, brand, architecture, compute capability, driver and CUDA versions and standard
PCI attributes. Capacity: `memory` (the type's framebuffer). Prepare creates the mediated device
(`agent.hostprep.vgpu`) and gives its UUID as the `mdevUUID` attribute.

Why one device per instance: a device goes to at most one claim (without `allowMultipleAllocations`,
which needs DRAConsumableCapacity and would make each allocation's share a capacity request rather
than a device); several claims get vGPUs of one type by getting different devices of it, and each
device stands for exactly one mediated device on the host.

The counter model (the GPU's set, `agent.counters`; nothing is added to it): each vGPU device
consumes `memory` = the set's memory divided by the type's instance limit (rounded down to MiB), so

- at most the limit of one type fit together (and its devices are only that many anyway);
- the whole GPU, its passthrough variant and its shared form, which take all of `memory`
  (`counters.whole_gpu`), never go with a vGPU.

What counters cannot say: "one type per GPU at a time" (NVIDIA's time-sliced vGPU), nor "no MIG
with vGPU". Counters are sums, and any two kinds of device of which two or more fit alone also fit
one and one together (the counters' feasible region is convex). Those rules need compatibility
groups (`consumesCounters[].compatibilityGroups`, one group per vGPU type, `compatibility_group`),
published only where the cluster has the gate on. So what is published never offers the scheduler
a mix the driver refuses (`VgpuPolicy`, `--vgpu-types`): with compatibility groups, every type (or
the ones named); without, only the one type named, and only on GPUs that publish no MIG placements.
Prepare refuses a mix all the same (the type's `available_instances` is 0: NoInstanceAvailable).

On a GPU whose VFs list the types, a type's instance limit is the one its description gives (or the sum
of what its VFs have available while none hosts a vGPU), and its devices are the GPU's, on the GPU's
counter set, as on a GPU that lists its types itself: which VF a vGPU is made on is prepare's choice.

Types are read once per GPU and kept (by bus ID): a GPU passed through to a VM leaves its host
driver and lists no types meanwhile, and its devices must come back under the same names. A type
without an instance limit in its description gets it from `available_instances` when the GPU has
no mediated device yet; until then it is not published (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent import counters, quantity
from agent.facts import GpuFacts, VgpuType
from agent.host.mdev import sysfs as mdev
from agent.inventory.published import form_attributes
from agent.kinds import Kind
from agent.model import Capacity, CounterConsumption, CounterSet, Device
from agent.vgpupolicy import VgpuPolicy

log = logging.getLogger(__name__)

MIB = 1 << 20


def type_label(t: VgpuType) -> str:
    """The type in device names: `nvidia-1021`."""
    return counters.fit_label(t.id.lower().replace("_", "-").replace(".", "-"), 40)


def device_name(minor: int, t: VgpuType, i: int) -> str:
    return counters.fit_label(f"gpu-{minor}-vgpu-{type_label(t)}-{i}")


def compatibility_group(type_id: str) -> str:
    """The compatibility group of a type's devices (what the publisher of compatibility groups gives them)."""
    return counters.vgpu_type_group(type_id)


def share(cs: CounterSet, t: VgpuType) -> str | None:
    """The memory one device of `t` takes from the set (None: the set has no memory counter)."""
    total = cs.counters.get(counters.MEMORY_COUNTER)
    if total is None or t.instances < 1:
        return None
    each = quantity.parse_int(total) // t.instances
    return quantity.binary(each // MIB * MIB if each >= MIB else each)


@dataclass(slots=True)
class VgpuDevices:
    """The vGPU types of each GPU, kept across scans by bus ID, and the devices made from them."""

    policy: VgpuPolicy = field(default_factory=VgpuPolicy)
    types: dict[str, tuple[VgpuType, ...]] = field(default_factory=dict)
    _said: dict[str, str] = field(default_factory=dict)

    def learn(self, sysfs: Path, bus_id: str) -> None:
        """Read the GPU's types once it lists them all with their limits (they do not change)."""
        if bus_id in self.types:
            return
        offered = mdev.gpu_types(sysfs, bus_id)  # on the GPU, or on its SR-IOV VFs
        if not offered:
            return  # no vGPU host driver here (or not now): nothing to say
        empty = not mdev.gpu_mdevs(sysfs, bus_id)
        out, unknown = [], []
        for t in offered:
            limit = t.max_instances if t.max_instances is not None else (t.available if empty else None)
            if limit is None or limit < 1:
                unknown.append(t.id)
                continue
            out.append(VgpuType(t.id, t.name or t.id, t.framebuffer, limit))
        if unknown:
            self._note(bus_id, f"GPU {bus_id}: vGPU types {', '.join(unknown)} say no instance limit and the GPU has "
                       "mediated devices already: not published until their limit can be read", logging.WARNING)
            return
        self._said.pop(bus_id, None)
        self.types[bus_id] = tuple(out)
        log.info("GPU %s: %d vGPU types (%s)", bus_id, len(out), ", ".join(f"{t.name}: {t.instances}" for t in out))

    def apply(self, sysfs: Path, devices: Sequence[Device]) -> list[Device]:
        """`devices` plus the vGPU devices of each native GPU whose host driver offers types, on the
        counter set the GPU device consumes (apply after every step that extends that set)."""
        out = list(devices)
        if not self.policy.enabled:
            return out
        with_mig = {d.pci_bus_id for d in devices if d.kind is Kind.MIG}
        for dev in devices:
            bus = dev.pci_bus_id
            if dev.kind is not Kind.GPU or not bus:
                continue
            self.learn(sysfs, bus)
            name = counters.gpu_counter_set_name(bus)
            cs = next((c.counter_set for c in dev.consumes_counters if c.counter_set.name == name), None)
            types = [t for t in self.types.get(bus, ()) if self.policy.wants(t.id, t.name)]
            if not types or cs is None:
                continue
            if self.policy.exclusive and bus in with_mig:
                # Counters cannot keep a vGPU from a MIG instance; only compatibility groups can.
                self._note(f"{bus}/mig", f"GPU {bus}: publishes MIG placements, so no vGPU devices without "
                           "--compatibility-groups (the counters cannot keep the two apart)")
                continue
            out += self._devices(dev, cs, types)
        return out

    def _devices(self, parent: Device, cs: CounterSet, types: Sequence[VgpuType]) -> list[Device]:
        gpu = parent.gpu
        if gpu is None:
            return []
        out = []
        for t in types:
            memory = share(cs, t)
            if memory is None:
                self._note(f"{cs.name}/memory", f"counter set {cs.name} has no memory counter: no vGPU devices "
                           "(the scheduler could not keep them from the whole GPU)", logging.WARNING)
                return []
            facts = GpuFacts(gpu, t)
            attrs = form_attributes(parent.attributes, facts)
            caps = {"memory": Capacity(quantity.binary(t.framebuffer))} if t.framebuffer else {}
            use = (CounterConsumption(cs, {counters.MEMORY_COUNTER: memory}),)
            out += [Device(name=device_name(gpu.minor, t, i), kind=Kind.VGPU, attributes=dict(attrs),
                           capacity=dict(caps), node=facts, consumes_counters=use) for i in range(t.instances)]
        return out

    def forget(self, bus_id: str) -> None:
        """Read the GPU's types again at the next scan (the host driver changed)."""
        self.types.pop(bus_id, None)

    def _note(self, key: str, message: str, level: int = logging.INFO) -> None:
        if self._said.get(key) != message:
            self._said[key] = message
            log.log(level, "%s", message)

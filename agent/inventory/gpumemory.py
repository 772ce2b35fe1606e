"""What NVML said about each GPU in this boot, kept for the GPUs that leave it for a VM.

A GPU bound to vfio-pci is not NVML's any more (`agent.inventory.nvmlgate`): no NVML call describes it
while a VM has it. Yet its native form and its counter set must stay published as they were: the
counter set is what keeps the scheduler from handing out the GPU twice, and a set or device that
changes shape while a claim holds it is a different one to the API. So GPU discovery remembers each
GPU as NVML last described it (the native device: attributes, memory, device nodes, UUID; and its MIG
layout), by PCI bus ID, in `<state dir>/gpus.json`, and publishes a remembered GPU that NVML does not
list while sysfs shows it bound to vfio-pci. The file outlives the agent, so a restarted agent
publishes it the same; it names the boot it was written in, and a later boot's agent ignores it (a
GPU on vfio-pci then was never NVML's in this boot: recovery binds a claim's GPU again only after
the first scan has seen it on nvidia).

Written atomically when what is remembered changes (a new GPU, another driver version), not per scan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from agent.facts import GpuFacts, GpuIdentity
from agent.fsutil import atomic_write
from agent.host.vfio.pci import VFIO_PCI, current_driver
from agent.inventory.mig import MigLayout, MigProfile
from agent.kinds import Kind
from agent.model import Capacity, Device, DeviceNode, attribute_from_wire, attribute_wire

log = logging.getLogger(__name__)

FILE = "gpus.json"
VERSION = 1


@dataclass(frozen=True, slots=True)
class RememberedGpu:
    device: Device  # the native GPU as NVML described it (no counters: discovery adds them)
    layout: MigLayout | None


class GpuMemory:
    def __init__(self, state_dir: Path, boot_id: Callable[[], str]) -> None:
        self.path = state_dir / FILE
        self._boot_id = boot_id
        self.gpus: dict[str, RememberedGpu] = {}
        self._written = b""

    def load(self) -> None:
        """What an earlier agent of this boot remembered (nothing from another boot, or a bad file)."""
        try:
            raw = orjson.loads(self.path.read_bytes())
            if not isinstance(raw, dict) or raw.get("version") != VERSION:
                raise ValueError("not a version-1 GPU memory")
            if raw.get("bootId") != self._boot_id():
                return
            self.gpus = {str(bus): _gpu_from_wire(g) for bus, g in raw["gpus"].items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("%s is not readable (%s): GPUs on vfio-pci are published once NVML has described them "
                        "again", self.path, exc)

    def learn(self, natives: Iterable[Device], layouts: Mapping[str, MigLayout]) -> None:
        """Remember the GPUs NVML described in this scan; written when that changes what is remembered."""
        for dev in natives:
            if dev.kind is Kind.GPU and dev.gpu is not None:
                self.gpus[dev.gpu.pci_bus_id] = RememberedGpu(dev, layouts.get(dev.gpu.pci_bus_id))
        body = orjson.dumps({"version": VERSION, "bootId": self._boot_id(),
                             "gpus": {bus: _gpu_wire(g) for bus, g in sorted(self.gpus.items())}},
                            option=orjson.OPT_INDENT_2)
        if body == self._written:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, body, mode=0o600)
            self._written = body
        except OSError as exc:
            log.warning("cannot write %s: %s (a GPU passed through to a VM is published from memory until the "
                        "agent restarts)", self.path, exc)

    def away(self, sysfs: Path, listed: Iterable[str]) -> list[RememberedGpu]:
        """Remembered GPUs that NVML did not list, bound to vfio-pci now."""
        present = set(listed)
        return [g for bus, g in sorted(self.gpus.items())
                if bus not in present and current_driver(sysfs, bus) == VFIO_PCI]


def _gpu_wire(g: RememberedGpu) -> dict[str, Any]:
    dev = g.device
    gpu = dev.gpu
    assert gpu is not None  # learn keeps whole GPUs only
    return {
        "name": dev.name,
        "attributes": {k: attribute_wire(v) for k, v in sorted(dev.attributes.items())},
        "capacity": {k: c.value for k, c in sorted(dev.capacity.items())},
        "nodes": [[n.path, n.host_path] for n in dev.device_nodes],
        "uuid": gpu.uuid,
        "index": gpu.index,
        "minor": gpu.minor,
        "pciBusID": gpu.pci_bus_id,
        "mig": None if g.layout is None else {
            "memorySlices": g.layout.memory_slices,
            "profiles": [{"enum": p.enum, "id": p.id, "name": p.name, "computeSlices": p.compute_slices,
                          "instances": p.instances, "engines": list(p.engines), "memory": p.memory,
                          "starts": list(p.starts), "size": p.size} for p in g.layout.profiles]},
    }


def _gpu_from_wire(raw: Mapping[str, Any]) -> RememberedGpu:
    mig = raw["mig"]
    layout = None if mig is None else MigLayout(
        tuple(MigProfile(enum=int(p["enum"]), id=int(p["id"]), name=str(p["name"]),
                         compute_slices=int(p["computeSlices"]), instances=int(p["instances"]),
                         engines=tuple(int(e) for e in p["engines"]), memory=int(p["memory"]),
                         starts=tuple(int(s) for s in p["starts"]), size=int(p["size"])) for p in mig["profiles"]),
        int(mig["memorySlices"]))
    identity = GpuIdentity(uuid=str(raw["uuid"]), index=int(raw["index"]), minor=int(raw["minor"]),
                           pci_bus_id=str(raw["pciBusID"]))
    device = Device(
        name=str(raw["name"]), kind=Kind.GPU,
        attributes={str(k): attribute_from_wire(v) for k, v in raw["attributes"].items()},
        capacity={str(k): Capacity(str(v)) for k, v in raw["capacity"].items()},
        node=GpuFacts(identity),
        device_nodes=tuple(DeviceNode(str(p), str(h)) for p, h in raw["nodes"]))
    return RememberedGpu(device, layout)

"""What GPU discovery adds after the GPUs, their variants and MIG placements are known: the shared form
of each GPU (`--gpu-sharing`) and the host memory a GPU claim costs the node (when the Node declares
`DRANodeAllocatableResources`).

**Shared GPUs** (consumable capacity, KEP-5075, `DRAConsumableCapacity`). `gpu-<minor>-shared`, kind
`gpushare` (its facts: the GPU and `agent.facts.GpuShare`): the GPU's attributes with `type=shared`,
`allowMultipleAllocations: true` and two capacities. `memory` (the GPU's memory), with a request policy:
default 1Gi, range 1Gi to the GPU's memory rounded down to whole GiB, step 1Gi. `compute` (1: the whole
GPU), with the fractional policy of `--gpu-compute-shares` (default 0.1, 0.05 to 1 in steps of 0.05;
`computePercent` on an API server without fractional ranges: `agent.computeshare`). Each claim that gets
it receives a `shareID` and a `consumedCapacity` of both from the scheduler, which keeps the sum of all
shares within each capacity. Whole GiB because every workload sizes GPU memory in GiB and a finer grain
only fragments the GPU; a 1Gi default so a request that names no amount takes the smallest share and
leaves the GPU shareable (say how much you need); the maximum rounded down because the API wants max to
be a multiple of step (81559Mi on an H100 -> 79Gi).
A GPU with less than 2Gi gets no shared form (the API wants min + step within the capacity).

The shared form takes the whole GPU from its counter set (`counters.whole_gpu`), like the full GPU and its
passthrough variant.
With allowMultipleAllocations the scheduler charges a device's counters once, when its first allocation
is made, and skips the counter check for further allocations of the same device (kubernetes/kubernetes
#134100, fixed by #134103): so the first share takes the GPU away from the full device,
the passthrough variant, MIG placements and vGPU devices, later shares fit as long as memory is left,
and the GPU is whole again once the last share is gone. The limits are not enforced by the hardware:
the container is told its share (`DRA_<DEVICE>_MEMORY_LIMIT`, bytes, `DRA_<DEVICE>_COMPUTE_PERCENT`, and
for MPS clients `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<ordinal>=<MiB>M` and
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, see `agent.claims.plan`), which CUDA's MPS enforces per client and a
plain CUDA workload must honour itself (cap its allocator, e.g. PyTorch's
`set_per_process_memory_fraction`; its compute share is not enforced at all without MPS).

**Host memory overhead** (node-allocatable resources, `DRANodeAllocatableResources`, alpha): every GPU
device (full, passthrough variant, MIG placement, vGPU, shared form) carries
`nodeAllocatableResources.memory.overhead.perContainer`, the host memory a container using the GPU
costs the node beyond what the pod asks for: the CUDA driver library and context state, pinned staging
buffers, the kernel driver's per-client state. The kubelet
adds it to the pod's memory and to each referencing container's limit, and the scheduler subtracts it
from the node's allocatable memory. Per container, because the cost comes with each process that opens
the GPU, and a process lives in a container. The default, 256Mi, is a floor for one CUDA context's host
footprint (a few hundred MiB is typical, more without CUDA's lazy module loading); set
`--gpu-host-memory-overhead` to what your workloads measure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent import counters, quantity
from agent.computeshare import COMPUTE, COMPUTE_PERCENT, ComputeShares
from agent.facts import GpuFacts, GpuShare
from agent.inventory.published import form_attributes
from agent.kinds import Kind
from agent.model import Capacity, Device

SHARE_SUFFIX = "-shared"
SHARE_GRAIN = 1 << 30  # 1Gi: the request policy's min, step and default
MIB = 1 << 20
DEFAULT_HOST_MEMORY_OVERHEAD = 256 * MIB


def share_name(gpu_name: str) -> str:
    """`gpu-3` -> `gpu-3-shared`."""
    return counters.fit_label(gpu_name + SHARE_SUFFIX)


def memory_request_policy(memory: int) -> dict[str, Any] | None:
    """The shared form's `memory` request policy; None when the GPU is too small to share."""
    most = memory // SHARE_GRAIN * SHARE_GRAIN
    if memory < SHARE_GRAIN * 2:
        return None
    grain = quantity.binary(SHARE_GRAIN)
    return {"default": grain, "validRange": {"min": grain, "max": quantity.binary(most), "step": grain}}


def host_memory_overhead(amount: int) -> dict[str, Any]:
    """`nodeAllocatableResources` of a GPU device: its host memory cost, per container."""
    return {"memory": {"overhead": {"perContainer": quantity.binary(amount)}}}


def is_gpu_device(dev: Device) -> bool:
    """A device that puts a GPU (or part of one) in a container or VM: what the overhead applies to."""
    return dev.gpu_function is not None


def shared_form(gpu: Device, compute: ComputeShares | None = None) -> Device | None:
    """The shared form of a full GPU device (None: it has no memory or counter set, or too little memory)."""
    cap = gpu.capacity.get("memory")
    if cap is None or not gpu.consumes_counters or (identity := gpu.gpu) is None:
        return None
    try:
        memory = quantity.parse_int(cap.value)
    except ValueError:
        return None
    policy = memory_request_policy(memory)
    if policy is None:
        return None
    facts = GpuFacts(identity, GpuShare())
    return Device(
        name=share_name(gpu.name), kind=Kind.GPUSHARE,
        attributes=form_attributes(gpu.attributes, facts),
        capacity={"memory": Capacity(cap.value, request_policy=policy), **compute_capacity(compute)},
        allow_multiple_allocations=True,
        node=facts,
        device_nodes=gpu.device_nodes,
        # The whole GPU, of its set as it is now: nothing may extend the set after this (see GpuExtras).
        consumes_counters=tuple(counters.whole_gpu(c.counter_set) for c in gpu.consumes_counters))


def compute_capacity(compute: ComputeShares | None) -> dict[str, Capacity]:
    """A shared form's `compute` (`agent.computeshare`; none when `--gpu-compute-shares off`)."""
    if compute is None:
        return {}
    value, policy = compute.fraction_capacity()
    return {COMPUTE: Capacity(value, request_policy=policy)}


def percent_compute(devices: Sequence[Device]) -> list[Device]:
    """`devices` with each shared form's `compute` given as `computePercent` (for an API server that counts
    request policies in whole units: `agent.computeshare`)."""
    out = []
    for dev in devices:
        cap = dev.capacity.get(COMPUTE) if dev.kind is Kind.GPUSHARE else None
        if cap is None:
            out.append(dev)
            continue
        policy = cap.request_policy or {}
        rng = policy.get("validRange") or {}
        percent = ComputeShares(*(_percent(v) for v in (policy.get("default"), rng.get("min"), rng.get("max"),
                                                          rng.get("step"))))
        value, percent_policy = percent.percent_capacity()
        capacity = {k: v for k, v in dev.capacity.items() if k != COMPUTE}
        capacity[COMPUTE_PERCENT] = Capacity(value, request_policy=percent_policy)
        out.append(dataclasses.replace(dev, capacity=capacity))
    return out


def _percent(value: object) -> int:
    return int(quantity.exact(str(value)) * 100)


@dataclass(slots=True)
class GpuExtras:
    """The last step of a GPU scan (after every device that extends a GPU's counter set)."""

    sharing: bool = False
    host_memory_overhead: int = DEFAULT_HOST_MEMORY_OVERHEAD
    compute: ComputeShares | None = None  # a shared form's compute (`--gpu-compute-shares`)

    def apply(self, devices: Sequence[Device], *, node_allocatable: bool) -> list[Device]:
        out = list(devices)
        if self.sharing:
            out += [s for d in devices if d.kind is Kind.GPU and (s := shared_form(d, self.compute)) is not None]
        if node_allocatable and self.host_memory_overhead > 0:
            out = [self._with_overhead(d) if is_gpu_device(d) else d for d in out]
        return out

    def _with_overhead(self, dev: Device) -> Device:
        return dataclasses.replace(dev, node_allocatable={**(dev.node_allocatable or {}),
                                                          **host_memory_overhead(self.host_memory_overhead)})

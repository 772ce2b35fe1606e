"""What a prepared claim consists of, derived without side effects: its record (every file with its
content, the kubelet response) from an allocation, and the record a metadata refresh makes of it.
The engine (`agent.engine.prepare`) applies them in crash-safe order.

Every GPU form a container's CUDA uses (whole, MIG, shared) gets the NVIDIA Container Toolkit's CDI
device where a toolkit spec names its GPU (`toolkit_device`: the driver's libraries and hooks; a MIG
device its parent GPU's), and `CUDA_VISIBLE_DEVICES` naming exactly the claim's GPU forms
(`visible_env`). A shared GPU (`agent.inventory.gpushare`) is prepared like its GPU (device nodes, the
toolkit's CDI device) and its CDI device also sets `DRA_<DEVICE>_UUID`, `DRA_<DEVICE>_MEMORY_LIMIT` (bytes: the sum
of the claim's shares of that device; one per result in practice), `DRA_<DEVICE>_COMPUTE_PERCENT` (where
the share names compute: `agent.computeshare`) and, for CUDA MPS clients,
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<ordinal>=<MiB>M[,...]` over every shared GPU of the claim (the
ordinal: the GPU's place in the claim's `CUDA_VISIBLE_DEVICES`) and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
(one value for all of a client's GPUs: the smallest of the claim's compute shares), which the MPS server
enforces per client. Those two are the claim's, one value each, set on every GPU form of the claim
(`claim_env`); a class's or the claim's own opaque configuration may lower them, never raise them
(`client_limits`). One container with GPUs from two claims gets one claim's `CUDA_VISIBLE_DEVICES` and
limits (CDI does not merge variables). Each claim has its own CDI spec and metadata files (named by its
UID), so claims sharing one GPU are prepared and unprepared independently.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from agent import quantity
from agent.claims import cdispecs, cpuset, filenames, metadata
from agent.claims.allocation import Allocation
from agent.claims.claimenv import MpsLimits, is_share
from agent.claims.records import ClaimRecord, DeviceBinding, FileRecord, FileRole, PreparedDevice
from agent.claims.toolkit import ToolkitSpecs
from agent.computeshare import thread_percentage
from agent.config import Settings
from agent.errors import ClaimError
from agent.inventory.gpushare import MIB
from agent.model import Device
from agent.names import base_request
from cdi.store import encode_spec


def plan_record(s: Settings, toolkit: ToolkitSpecs, alloc: Allocation, generation: int,
                bindings: list[DeviceBinding]) -> ClaimRecord:
    """Every file of the prepared claim with its content, and the kubelet response. No I/O except
    the toolkit lookup."""
    ref = alloc.ref
    vendor = s.cdi_vendor
    files: list[FileRecord] = []
    env = claim_env(alloc)
    spec = cdispecs.claim_spec(vendor, ref.uid, alloc.devices, env)
    files.append(FileRecord(str(s.cdi_dir / filenames.claim_spec_name(vendor, ref.uid)), encode_spec(spec),
                            role=FileRole.CLAIM_SPEC))
    devices: list[PreparedDevice] = []
    first_of_request: set[str] = set()
    for a in alloc.devices:
        ids = [cdispecs.claim_device_id(vendor, ref.uid, a.device.name)]
        if tk := toolkit_device(toolkit, a.device):
            ids.append(tk)
        base = base_request(a.request)
        if base not in first_of_request:
            first_of_request.add(base)
            ids.append(cdispecs.metadata_device_id(vendor, ref.uid, base))
        devices.append(PreparedDevice(request=a.request, pool=a.pool, device=a.device.name,
                                      cdi_device_ids=tuple(ids), share_id=a.share_id, admin_access=a.admin_access,
                                      pod_interface=a.pod_interface))
    for base, allocs in metadata.group_by_base_request(alloc.devices).items():
        host = metadata.host_file(s.metadata_dir, ref.uid, base)
        content = metadata.render(driver=s.driver_name, namespace=ref.namespace, name=ref.name,
                                  uid=ref.uid, pod_claim_name=alloc.pod_claim_name,
                                  generation=generation, devices=allocs)
        files.append(FileRecord(str(host), content, role=FileRole.METADATA_FILE, request=base))
        container = metadata.container_file(s.driver_name, ref.name, base, alloc.pod_claim_name)
        mspec = cdispecs.metadata_spec(vendor, ref.uid, base, str(host), container)
        files.append(FileRecord(str(s.cdi_dir / filenames.metadata_spec_name(vendor, ref.uid, base)),
                                encode_spec(mspec), role=FileRole.METADATA_SPEC, request=base))
    dirs = [str(metadata.host_dir(s.metadata_dir, ref.uid))] if alloc.devices else []
    return ClaimRecord(uid=ref.uid, namespace=ref.namespace, name=ref.name,
                       pod_claim_name=alloc.pod_claim_name, devices=devices, files=files, dirs=dirs,
                       prepared_at=time.time(), generation=generation, bindings=list(bindings))


CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def claim_env(alloc: Allocation) -> dict[str, dict[str, str]]:
    """Device name -> the variables of its CDI device beyond those that describe it: the agent's
    (`visible_env`, `share_env`, the claim's MPS limits) and the configurations' (`Allocation.config_env`,
    which holds no reserved name). Every GPU form of the claim (every device that sets
    `CUDA_VISIBLE_DEVICES`) gets the claim's MPS limits, the same values (`client_limits`), and no other
    device does: CDI applies a container's devices one after another and the last one that sets a variable
    wins, in an order the tenant chooses (a claim's results follow its requests; the kubelet takes a pod's
    claims in no fixed order), so a container's MPS limits always come from the claim its
    `CUDA_VISIBLE_DEVICES` comes from, or limit GPUs that are no share (docs/security.md)."""
    visible, shares = visible_env(alloc.devices), share_env(alloc.devices)
    limits = client_limits(alloc).env()
    return {name: {**alloc.config_env.get(name, {}), **visible.get(name, {}), **shares.get(name, {}),
                   **(limits if name in visible else {})}
            for name in set(visible) | set(shares) | set(alloc.config_env)}


def client_limits(alloc: Allocation) -> MpsLimits:
    """The MPS limits of the claim's clients: the agent's (`share_limits`), lowered by each configuration's
    (which apply to shares only: `agent.claims.allocation`). A configuration above the agent's is refused
    (ClaimError naming it): it may lower a limit, never raise it."""
    given = share_limits(alloc.devices)
    out = given
    for configured in alloc.mps_limits:
        if above := configured.limits.above(given):
            raise ClaimError(f"{configured.where}.env: {'; '.join(above)}: a configuration may only lower the "
                             "MPS limits")
        out = out.lowered(configured.limits)
    return out


def toolkit_device(toolkit: ToolkitSpecs, dev: Device) -> str | None:
    """The NVIDIA Container Toolkit's CDI device that brings the driver's libraries (and its hooks) for a
    GPU form: the GPU's own for a whole or shared GPU, the parent GPU's for a MIG device (the toolkit's
    spec predates MIG devices the agent makes; its MIG nodes come from the claim's own spec). None for
    other devices, or where no toolkit spec names the GPU. Blocking (reads the spec directories)."""
    gpu = dev.gpu  # a MIG device's facts name its parent GPU
    if not dev.kind.toolkit or gpu is None:
        return None
    return toolkit.device_id(gpu.uuid, gpu.index)


def _visible_uuids(allocated: list[metadata.AllocatedDevice]) -> tuple[list[str], list[str]]:
    """The CUDA UUIDs of the claim's GPU forms in the claim's order (each once), and those forms' names."""
    uuids: list[str] = []
    names: list[str] = []
    for a in allocated:
        if a.device.kind.toolkit and (uuid := a.cuda_uuid):
            names.append(a.device.name)
            if uuid not in uuids:
                uuids.append(uuid)
    return uuids, names


def visible_env(allocated: list[metadata.AllocatedDevice]) -> dict[str, dict[str, str]]:
    """Device name -> `CUDA_VISIBLE_DEVICES`, for each GPU form of the claim: the UUIDs of the claim's
    GPU forms (`GPU-...` of a whole or shared GPU, `MIG-...` of a MIG device), so CUDA uses exactly them,
    in the claim's order. (A container given GPUs by two claims gets one claim's value: CDI does not
    merge variables.)"""
    uuids, names = _visible_uuids(allocated)
    return {name: {CUDA_VISIBLE_DEVICES: ",".join(uuids)} for name in names}


def _shares(allocated: list[metadata.AllocatedDevice]) -> tuple[dict[str, int], dict[str, int]]:
    """Share device name -> the bytes of memory the claim's shares of it consumed, and -> the percentage of
    its compute they consumed (those that name compute)."""
    memory: dict[str, int] = {}
    compute: dict[str, int] = {}
    for a in allocated:
        if is_share(a):
            # allocation.parse_claim has checked that the amount is there and an integer quantity, and that
            # a compute share is a whole percentage.
            memory[a.device.name] = memory.get(a.device.name, 0) + quantity.parse_int(a.consumed["memory"])
            if (percent := thread_percentage(a.consumed)) is not None:
                compute[a.device.name] = min(100, compute.get(a.device.name, 0) + percent)
    return memory, compute


def share_env(allocated: list[metadata.AllocatedDevice]) -> dict[str, dict[str, str]]:
    """Device name -> the variables that describe a shared GPU's share (see the module docstring): its
    GPU's UUID, the memory and compute the claim's shares of it consumed."""
    memory, compute = _shares(allocated)
    uuids = {a.device.name: a.device.gpu.uuid if a.device.gpu is not None else "" for a in allocated if is_share(a)}
    return {n: {f"{cdispecs.env_prefix(n)}_UUID": uuids[n], f"{cdispecs.env_prefix(n)}_MEMORY_LIMIT": str(memory[n]),
                **({f"{cdispecs.env_prefix(n)}_COMPUTE_PERCENT": str(compute[n])} if n in compute else {})}
            for n in memory}


def share_limits(allocated: list[metadata.AllocatedDevice]) -> MpsLimits:
    """The MPS limits the claim's shares give its clients: each shared GPU's memory, keyed by the device's
    ordinal as the container's CUDA numbers it (its place in the claim's `CUDA_VISIBLE_DEVICES`:
    `visible_env`; MPS does not apply a limit keyed by UUID, docs/partitions.md), and the smallest of the
    compute shares: MPS takes one thread percentage per client, for every GPU it uses, so that no share is
    exceeded."""
    memory, compute = _shares(allocated)
    uuids = {a.device.name: a.cuda_uuid for a in allocated if is_share(a)}
    visible, _ = _visible_uuids(allocated)
    ordinal = {uuid: i for i, uuid in enumerate(visible)}
    return MpsLimits({ordinal[uuids[n]]: mib // MIB for n, mib in memory.items() if uuids[n] in ordinal},
                     min(compute.values()) if compute else None)


def _recorded_consumption(record: ClaimRecord) -> dict[tuple[str, str, str], dict[str, str]]:
    """(request, device, share ID) -> consumedCapacity, as the claim's metadata files in the record say:
    the record keeps no other copy of what each share got, and a refresh must not lose it."""
    return {key: {str(k): str(v) for k, v in consumed.items()}
            for key, dev in metadata.recorded_entries(record) if (consumed := dev.get("consumedCapacity"))}


def recorded_allocation(record: ClaimRecord,
                        lookup: Callable[[str], Device | None]) -> list[metadata.AllocatedDevice] | None:
    """The claim's allocated devices as its record holds them, each the device as discovery has it now:
    the requests, shares and what each share consumed, a passthrough VF's MAC, the partitions made;
    None when a device is not in the inventory."""
    allocated = []
    macs = {b.device: b.mac for b in record.bindings}
    made = {p.device: p for p in record.partitions}  # their MIG or mdev UUIDs are in the metadata
    consumed = _recorded_consumption(record)
    cpus = cpuset.recorded_cpus(record)  # a share's CPUs, chosen at prepare; a whole device's follow it
    for d in record.devices:
        device = lookup(d.device)
        if device is None:
            return None
        key = (d.request, d.device, d.share_id)
        allocated.append(metadata.AllocatedDevice(d.request, d.pool, device, d.share_id, macs.get(d.device, ""),
                                                  consumed.get(key, {}), made.get(d.device),
                                                  cpus.get(key, ()) if d.share_id else (),
                                                  pod_interface=d.pod_interface))
    return allocated


def refreshed(s: Settings, lookup: Callable[[str], Device | None],
              record: ClaimRecord) -> tuple[ClaimRecord, set[str]] | None:
    """The record with its metadata files rendered from the devices as they are now (generation + 1),
    and the paths of those files; None when nothing changed, or a device is gone (health reports
    it; the file keeps the last known truth). The files are the ones the record holds in the role of
    metadata file, at the paths it names: the claim's metadata CDI specs mount them from there, whatever
    the metadata directory is today (`agent.claims.records.FileRole`)."""
    allocated = recorded_allocation(record, lookup)
    if allocated is None:
        return None
    common: dict[str, Any] = {"driver": s.driver_name, "namespace": record.namespace, "name": record.name,
                              "uid": record.uid, "pod_claim_name": record.pod_claim_name}
    recorded = {f.request: f.path for f in record.files if f.role is FileRole.METADATA_FILE}
    contents = {recorded[base]: allocs for base, allocs in metadata.group_by_base_request(allocated).items()
                if base in recorded}
    current = {f.path: f.content for f in record.files}
    if all(current.get(path) == metadata.render(generation=record.generation, devices=allocs, **common)
           for path, allocs in contents.items()):
        return None
    generation = record.generation + 1
    files = [FileRecord(f.path, metadata.render(generation=generation, devices=contents[f.path], **common),
                        f.mode) if f.path in contents else f for f in record.files]
    return dataclasses.replace(record, files=files, generation=generation), set(contents)

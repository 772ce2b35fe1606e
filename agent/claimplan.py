"""What a prepared claim consists of, derived without side effects: its record (every file with its
content, the kubelet response) from an allocation, and the record a metadata refresh makes of it.
The engine (`agent.prepare`) applies them in crash-safe order."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from agent import cdispecs, metadata
from agent.allocation import Allocation
from agent.config import Settings
from agent.model import Device
from agent.names import base_request
from agent.state import ClaimRecord, DeviceBinding, FileRecord, PreparedDevice
from agent.toolkit import ToolkitSpecs
from cdi.store import encode_spec


def plan_record(s: Settings, toolkit: ToolkitSpecs, alloc: Allocation, generation: int,
                bindings: list[DeviceBinding]) -> ClaimRecord:
    """Every file of the prepared claim with its content, and the kubelet response. No I/O except
    the toolkit lookup."""
    ref = alloc.ref
    vendor = s.cdi_vendor
    files: list[FileRecord] = []
    spec = cdispecs.claim_spec(vendor, ref.uid, alloc.devices, alloc.config_env)
    files.append(FileRecord(str(s.cdi_dir / cdispecs.claim_spec_name(vendor, ref.uid)), encode_spec(spec)))
    devices: list[PreparedDevice] = []
    first_of_request: set[str] = set()
    for a in alloc.devices:
        ids = [cdispecs.claim_device_id(vendor, ref.uid, a.device.name)]
        if a.device.kind == "gpu" and (tk := toolkit.device_id(a.device.node.gpu_uuid, a.device.node.gpu_index)):
            ids.append(tk)
        base = base_request(a.request)
        if base not in first_of_request:
            first_of_request.add(base)
            ids.append(cdispecs.metadata_device_id(vendor, ref.uid, base))
        devices.append(PreparedDevice(request=a.request, pool=a.pool, device=a.device.name,
                                      cdi_device_ids=tuple(ids), share_id=a.share_id))
    for base, allocs in metadata.group_by_base_request(alloc.devices).items():
        host = metadata.host_file(s.metadata_dir, ref.uid, base)
        content = metadata.render(driver=s.driver_name, namespace=ref.namespace, name=ref.name,
                                  uid=ref.uid, pod_claim_name=alloc.pod_claim_name,
                                  generation=generation, devices=allocs)
        files.append(FileRecord(str(host), content))
        container = metadata.container_file(s.driver_name, ref.name, base, alloc.pod_claim_name)
        mspec = cdispecs.metadata_spec(vendor, ref.uid, base, str(host), container)
        files.append(FileRecord(str(s.cdi_dir / cdispecs.metadata_spec_name(vendor, ref.uid, base)),
                                encode_spec(mspec)))
    dirs = [str(metadata.host_dir(s.metadata_dir, ref.uid))] if alloc.devices else []
    return ClaimRecord(uid=ref.uid, namespace=ref.namespace, name=ref.name,
                       pod_claim_name=alloc.pod_claim_name, devices=devices, files=files, dirs=dirs,
                       prepared_at=time.time(), generation=generation, bindings=list(bindings))


def refreshed(s: Settings, lookup: Callable[[str], Device | None],
              record: ClaimRecord) -> tuple[ClaimRecord, set[str]] | None:
    """The record with its metadata files rendered from the devices as they are now (generation + 1),
    and the paths of those files; None when nothing changed, or a device is gone (health reports
    it; the file keeps the last known truth)."""
    allocated = []
    macs = {b.device: b.mac for b in record.bindings}
    for d in record.devices:
        device = lookup(d.device)
        if device is None:
            return None
        allocated.append(metadata.AllocatedDevice(d.request, d.pool, device, d.share_id, macs.get(d.device, "")))
    common: dict[str, Any] = {"driver": s.driver_name, "namespace": record.namespace, "name": record.name,
                              "uid": record.uid, "pod_claim_name": record.pod_claim_name}
    contents = {str(metadata.host_file(s.metadata_dir, record.uid, base)): allocs
                for base, allocs in metadata.group_by_base_request(allocated).items()}
    current = {f.path: f.content for f in record.files}
    if all(current.get(path) == metadata.render(generation=record.generation, devices=allocs, **common)
           for path, allocs in contents.items()):
        return None
    generation = record.generation + 1
    files = [FileRecord(f.path, metadata.render(generation=generation, devices=contents[f.path], **common),
                        f.mode) if f.path in contents else f for f in record.files]
    return dataclasses.replace(record, files=files, generation=generation), set(contents)

"""The device metadata file (the Downward API for devices) and where it lives.

One file per claim request with devices, a JSON stream of the same content in
each API version, newest first, so a reader takes the first object whose
apiVersion it knows (KubeVirt 1.9 reads v1alpha1).

A device held as a share (a result with a `shareID`, consumable capacity) also
carries `shareID` and `consumedCapacity` ({"memory": "4Gi"}), named as in the
allocation result, and a CPU device `cpuset`, the CPUs the claim got in the
kernel's list form (`agent.claims.cpuset`). These fields are the agent's
addition: no source here confirms that the upstream DeviceMetadata type has them
(readers that ignore unknown fields, as Go's encoding/json does by default, are
unaffected).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agent import apirules
from agent.claims.filenames import METADATA_FILE_NAME
from agent.claims.records import ClaimRecord, DevicePartition, FileRole, partition_attributes
from agent.facts import CpuFacts, NicFacts, PassthroughFacts
from agent.inventory.numa import format_cpulist
from agent.kinds import Kind, PartitionKind
from agent.model import AttrValue, Device, attribute_wire

API_VERSIONS = ("metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1")
CONTAINER_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One allocation result of a claim, matched to the device it names."""

    request: str  # as in the result: `req` or `req/sub`
    pool: str
    device: Device
    share_id: str = ""
    mac: str = ""  # a passthrough VF's MAC set by the claim's VfioConfig (its networkData says so)
    # The result's consumedCapacity (capacity name -> quantity): what a shared device's claim got.
    consumed: Mapping[str, str] = field(default_factory=dict, hash=False)
    # The partition prepare made for the device (a MIG instance, a mediated device), once made.
    made: DevicePartition | None = None
    # The CPUs a share of a CPU device got at prepare (`agent.claims.cpuset`); () for anything else.
    cpus: tuple[int, ...] = ()
    # The result's `adminAccess`: the device as it is, shared with whoever holds it (monitoring), never
    # reconfigured and never checked for exclusivity (`agent.engine.claimops`).
    admin_access: bool = False
    # A NIC that moves into the pod (CDI `netDevices`): its name there; "" for one that stays on the host.
    pod_interface: str = ""

    @property
    def cpuset(self) -> tuple[int, ...]:
        """The CPUs the result gives the claim: its share's, or a whole CPU device's; () for other devices."""
        if self.cpus:
            return self.cpus
        return self.device.node.cpus if isinstance(self.device.node, CpuFacts) else ()

    @property
    def attributes(self) -> dict[str, AttrValue]:
        """The device's attributes with those of the partition made for it (`partition_attributes`)."""
        if self.made is None:
            return self.device.attributes
        return {**self.device.attributes, **partition_attributes(self.made)}

    @property
    def cuda_uuid(self) -> str:
        """The UUID CUDA knows the device by: the MIG device's that prepare made (`agent.hostprep.mig`),
        else its GPU's ("" for a device of no GPU)."""
        if self.made is not None and self.made.kind is PartitionKind.MIG:
            return self.made.uuid
        return self.device.gpu.uuid if self.device.gpu is not None else ""


def host_dir(metadata_root: Path, uid: str) -> Path:
    """Keyed by the claim's UID: a claim deleted and re-created under the same name while the old
    one is still prepared gets files of its own, and any valid name fits (a UID is 36 bytes)."""
    return metadata_root / uid


def host_file(metadata_root: Path, uid: str, base_request: str) -> Path:
    return host_dir(metadata_root, uid) / base_request / METADATA_FILE_NAME


def container_file(driver: str, claim_name: str, base_request: str, pod_claim_name: str = "") -> str:
    if pod_claim_name:
        parent = f"{CONTAINER_ROOT}/resourceclaimtemplates/{pod_claim_name}"
    else:
        parent = f"{CONTAINER_ROOT}/resourceclaims/{claim_name}"
    return f"{parent}/{base_request}/{driver}-metadata.json"


def device_network_data(device: Device, mac: str = "", pod_interface: str = "") -> dict[str, Any] | None:
    """A NIC's interface, IPs and MAC; a passthrough NIC function only its MAC (`mac` when the claim
    set one), which is what a VM's SR-IOV network matches (it has no interface on the host). What the
    metadata file says and the claim's status reports; None for a device with no network data.

    Not cut to the API's limits: `network_data` cuts it for the file, the status writer logs what
    `apirules.clip_device_status` cuts from it."""
    facts = device.node
    if isinstance(facts, PassthroughFacts):
        if facts.native is not Kind.NIC:
            return None
        out: dict[str, Any] = {"hardwareAddress": mac or facts.mac} if mac or facts.mac else {}
    elif not isinstance(facts, NicFacts) or not facts.interface:
        return None
    else:
        # A NIC moved into the pod keeps its MAC and addresses there (the runtime moves them with it).
        out = {"interfaceName": pod_interface or facts.interface, "ips": list(facts.ips),
               "hardwareAddress": facts.mac}
    return {k: v for k, v in out.items() if v} or None


def network_data(device: Device, mac: str = "", pod_interface: str = "") -> dict[str, Any] | None:
    """`device_network_data` cut to what the API type allows (at most 16 IPs, each valid and once; a
    bounded interface name and address), as the claim's status is, so a reader that validates the
    file accepts it."""
    raw = device_network_data(device, mac, pod_interface)
    out = {k: v for k, v in apirules.clip_network_data(raw)[0].items() if v} if raw is not None else {}
    return out or None


def render(*, driver: str, namespace: str, name: str, uid: str, pod_claim_name: str, generation: int,
           devices: Sequence[AllocatedDevice]) -> bytes:
    """The file content for the devices of one base request (all results sharing it)."""
    requests: dict[str, list[dict[str, Any]]] = {}
    for alloc in devices:
        entry: dict[str, Any] = {
            "driver": driver,
            "pool": alloc.pool,
            "name": alloc.device.name,
            "attributes": {k: attribute_wire(v) for k, v in sorted(alloc.attributes.items())},
        }
        if (net := network_data(alloc.device, alloc.mac, alloc.pod_interface)) is not None:
            entry["networkData"] = net
        # A share of a device (consumable capacity): which one, and how much of the device it holds,
        # under the names the allocation result gives them.
        if alloc.share_id:
            entry["shareID"] = alloc.share_id
        if alloc.consumed:
            entry["consumedCapacity"] = dict(sorted(alloc.consumed.items()))
        if alloc.cpuset:
            entry["cpuset"] = format_cpulist(alloc.cpuset)
        requests.setdefault(alloc.request, []).append(entry)
    body: dict[str, Any] = {
        "kind": "DeviceMetadata",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": generation},
    }
    if pod_claim_name:
        body["podClaimName"] = pod_claim_name
    body["requests"] = [{"name": req, "devices": devs} for req, devs in requests.items()]
    return b"".join(orjson.dumps({"apiVersion": api, **body}) + b"\n" for api in API_VERSIONS)


def parse_stream(data: bytes) -> list[dict[str, Any]]:
    """The objects of a metadata file, in order (for readers and checks)."""
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def recorded_entries(record: ClaimRecord) -> Iterator[tuple[tuple[str, str, str], dict[str, Any]]]:
    """((request, device, share ID), the device's entry) of each device the claim's recorded metadata
    files describe: what a refresh keeps of what prepare chose (a share's capacity, a CPU set)."""
    for f in record.files:
        if f.role is not FileRole.METADATA_FILE:
            continue
        objs = parse_stream(f.content)
        for req in (objs[0].get("requests") or []) if objs else []:
            for dev in req.get("devices") or []:
                yield (str(req.get("name")), str(dev.get("name")), str(dev.get("shareID", ""))), dev


def group_by_base_request(devices: Iterable[AllocatedDevice]) -> dict[str, list[AllocatedDevice]]:
    out: dict[str, list[AllocatedDevice]] = {}
    for alloc in devices:
        out.setdefault(alloc.request.split("/", 1)[0], []).append(alloc)
    return out

"""Durable per-claim records: the truth about what this node has prepared.

One file per claim (`<state dir>/claims/<uid>.rec`), so a prepare costs O(1)
whatever else is prepared. A record holds everything needed to re-derive the
claim's files after a crash (their exact content), and the kubelet response.

On-disk format: one header line, then the body.

    DRAREC <version> <sha256 of body, hex> <body length>\\n
    <body: a JSON object>

Version 1: a prepared claim that changed nothing outside the agent's files. Version 2: a claim
with side effects on the host (PCI functions bound to vfio-pci): its `bindings`, and a state that
may also be an intent (`binding`: bind steps under way; `restoring`: unprepare putting the host
drivers back). A record without bindings is still written as version 1, so an agent that predates
bindings reads it; one that predates them refuses a version-2 record by name instead of taking a
half-bound device for a prepared one. Version 3: a claim with GPU partitions created on the host for
it (MIG GPU/compute instances, mediated devices): its `partitions`, beside any `bindings`, with the
same intent states. Only a record with partitions is written as version 3, so versions 1 and 2 are
written as before and an older agent refuses a version-3 record by its version, never taking a
claim whose MIG instance it cannot see for one it can clean up.

Each file of the claim is held with its role (`FileRole`: the claim's CDI spec, a request's metadata
file or the metadata file's CDI spec) and, for the metadata ones, the base request it is for; code that
reads a record finds a claim's files by role, never by working out paths from today's settings, which
may have changed since the prepare (another --kubelet-dir). Older agents ignore the two fields; a
record written before them gets them from its files' names (`role_of`).

The checksum catches torn or corrupted files; the version lets a later agent
read (or refuse, clearly) what an earlier one wrote. Records are written
atomically, the file fsync'd, and then their directory fsync'd: a write returns
only once both are done. A record's removal is fsync'd too: once an unprepare
has answered success, the claim must not come back after a power loss.

Group commit: concurrent writes and removals share directory fsyncs
(`DirectorySync`). Each waits for an fsync of the directory that *started after*
its own rename or unlink, so the guarantee is the one of an fsync per write, at a
fraction of the cost when claims are prepared in parallel.

The record is the truth, also for a second agent sharing the directory during a
rolling update: an agent reads a record again whenever the file's identity
(`RecordStamp`) differs from the copy it holds.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any

import orjson

from agent.claims.filenames import METADATA_FILE_NAME, metadata_spec_request
from agent.host.vfio.bind import BindPlan
from agent.host.vfio.sriov import VfLink
from agent.kinds import PartitionKind
from agent.model import AttrValue

log = logging.getLogger(__name__)

MAGIC = b"DRAREC"
FORMAT_VERSION = 1  # records without host side effects
BINDINGS_VERSION = 2  # records with `bindings` (and intent states)
PARTITIONS_VERSION = 3  # records with `partitions` (and maybe bindings)
READABLE_VERSIONS = (FORMAT_VERSION, BINDINGS_VERSION, PARTITIONS_VERSION)
SUFFIX = ".rec"


class RecordState(StrEnum):
    PREPARED = "prepared"  # the claim's files and bindings are in place
    BINDING = "binding"  # prepare is binding functions (intent): recovery rolls it back
    RESTORING = "restoring"  # unprepare is restoring host drivers (intent): recovery finishes it


PREPARED = RecordState.PREPARED
# The mode of every file of a claim (CDI specs, metadata files: read by the runtime and, mounted, by the
# claim's containers, written by the agent alone). Written from here, never from a record: a record names
# it only so that an older agent reads the record (`agent.claims.recordcheck` refuses any other).
FILE_MODE = 0o644


class RecordError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as the kubelet is told about it."""

    request: str  # the allocation result's request: `req` or `req/sub`
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str = ""
    # Allocated with admin access: held beside other claims, excluding none (an older agent, which does not
    # read the field, takes it for an ordinary holder: stricter, never looser).
    admin_access: bool = False
    # A NIC moved into the pod: its name there. Its absence from the host's namespace is then expected
    # (recheck, metadata refresh), and its networkData names it so.
    pod_interface: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"request": self.request, "pool": self.pool, "device": self.device,
                               "cdiDeviceIds": list(self.cdi_device_ids)}
        if self.share_id:
            out["shareId"] = self.share_id
        if self.admin_access:
            out["adminAccess"] = True
        if self.pod_interface:
            out["podInterface"] = self.pod_interface
        return out

    @classmethod
    def from_json(cls, d: Any) -> PreparedDevice:
        ids = d["cdiDeviceIds"]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise TypeError("cdiDeviceIds must be a list of strings")
        return cls(request=str(d["request"]), pool=str(d["pool"]), device=str(d["device"]),
                   cdi_device_ids=tuple(ids), share_id=str(d.get("shareId", "")),
                   admin_access=d.get("adminAccess") is True, pod_interface=str(d.get("podInterface", "")))


@dataclass(frozen=True, slots=True)
class DeviceBinding:
    """A passthrough device's PCI functions moved to vfio-pci for the claim.

    `plan` holds every step and each function's original driver, written before the first step
    takes effect; `step` is the next step to apply, written before it is applied: of `plan` while
    the record is `binding`, of `plan.restore()` while it is `restoring`. `previous`, for a VF whose
    MAC or VLAN the claim sets, is what its PF held for it before, read before the intent record is
    written (so before anything changes) and put back when the binding is undone."""

    device: str  # the claim's passthrough device (`gpu-0000-18-00-0-vfio`)
    plan: BindPlan
    step: int = 0
    boot_id: str = ""  # the kernel boot the functions were bound in (a reboot forgets bindings)
    iommu: str = "legacy"  # the VFIO interface the CDI spec gives: legacy | iommufd
    mac: str = ""  # the MAC VfioConfig set on a VF (also its metadata's hardwareAddress; "": left)
    vlan: int | None = None  # the VLAN VfioConfig set on a VF (0: cleared; None: left)
    previous: VfLink | None = None  # the VF's MAC and VLAN before the claim (None: nothing set)

    @property
    def sets_vf(self) -> bool:
        return bool(self.mac) or self.vlan is not None

    def wire(self) -> dict[str, Any]:
        # Without `previous`, `vlan` is written as records before it wrote it (0 for none), so an agent that
        # predates it reads the record; with it, 0 is a VLAN cleared and null one left.
        out = {"device": self.device, "plan": self.plan.wire(), "step": self.step, "bootId": self.boot_id,
               "iommu": self.iommu, "mac": self.mac, "vlan": self.vlan or 0}
        if self.previous is not None:
            out |= {"vlan": self.vlan, "previous": self.previous.wire()}
        return out

    @classmethod
    def from_wire(cls, raw: object) -> DeviceBinding:
        keys = {"device", "plan", "step", "bootId", "iommu", "mac", "vlan"}
        if not isinstance(raw, Mapping) or set(raw) - {"previous"} != keys:
            raise ValueError(f"not a device binding: {raw!r}"[:200])
        device, plan, step, boot, iommu, mac, vlan = (raw[k] for k in (
            "device", "plan", "step", "bootId", "iommu", "mac", "vlan"))
        if not (isinstance(device, str) and isinstance(plan, Mapping) and type(step) is int and step >= 0
                and isinstance(boot, str) and iommu in ("legacy", "iommufd") and isinstance(mac, str)
                and (type(vlan) is int or (vlan is None and "previous" in raw))):
            raise ValueError(f"device binding of {device!r} has a field of the wrong type"[:200])
        previous = VfLink.from_wire(raw["previous"]) if "previous" in raw else None
        if previous is None and vlan == 0:
            vlan = None  # a record from before `previous`: a VLAN of 0 was never applied
        return cls(device, BindPlan.from_wire(plan), step, boot, iommu, mac, vlan, previous)


_PARTITION_KEYS = ("device", "kind", "parent", "profile", "start", "step", "uuid", "gpuInstance",
                   "computeInstance", "modeChanged", "bootId")


@dataclass(frozen=True, slots=True)
class DevicePartition:
    """A partition of a GPU created on the host for the claim (a MIG GPU + compute instance, or a
    mediated device). Written in the record before each step takes effect; the steps themselves
    are the business of the kind's module (agent/hostprep/mig.py, agent/hostprep/vgpu.py)."""

    device: str  # the claim's device as published (gpu-3-mig-1g10gb-4, gpu-3-vgpu-<type>)
    kind: PartitionKind
    parent: str  # MIG: the parent GPU's UUID; mdev: its parent's PCI bus ID (the GPU, or its SR-IOV VF)
    profile: str  # MIG profile name (1g.10gb) | mdev type id (nvidia-1021)
    start: int = 0  # MIG placement start (memory slice); 0 for mdev
    step: int = 0  # next step to apply
    uuid: str = ""  # mdev: chosen BEFORE creation (so recovery can remove it); MIG: MIG-... once created
    gpu_instance: int = -1  # MIG GI id once created
    compute_instance: int = -1  # MIG CI id once created
    mode_changed: bool = False  # MIG: this claim turned MIG mode on (turn it off at unprepare when unused)
    boot_id: str = ""  # kernel boot the partition was made in (a reboot forgets mdevs; MIG GIs too)

    def wire(self) -> dict[str, Any]:
        return {"device": self.device, "kind": str(self.kind), "parent": self.parent, "profile": self.profile,
                "start": self.start, "step": self.step, "uuid": self.uuid, "gpuInstance": self.gpu_instance,
                "computeInstance": self.compute_instance, "modeChanged": self.mode_changed,
                "bootId": self.boot_id}

    @classmethod
    def from_wire(cls, raw: object) -> DevicePartition:
        if not isinstance(raw, Mapping) or set(raw) != set(_PARTITION_KEYS):
            raise ValueError(f"not a device partition: {raw!r}"[:200])
        device, kind, parent, profile, start, step, uuid, gi, ci, changed, boot = (raw[k] for k in _PARTITION_KEYS)
        strings = (device, parent, profile, uuid, boot)
        ints = (start, step, gi, ci)
        if not (all(isinstance(v, str) for v in strings) and all(type(v) is int for v in ints)
                and start >= 0 and step >= 0 and gi >= -1 and ci >= -1 and type(changed) is bool
                and kind in PartitionKind.__members__.values()):
            raise ValueError(f"device partition of {device!r} has a field of the wrong type"[:200])
        return cls(device, PartitionKind(kind), parent, profile, start, step, uuid, gi, ci, changed, boot)


class FileRole(StrEnum):
    CLAIM_SPEC = "claimSpec"  # the CDI spec of the claim's devices
    METADATA_FILE = "metadataFile"  # a base request's device metadata file
    METADATA_SPEC = "metadataSpec"  # the CDI spec that mounts a base request's metadata file


def role_of(path: str) -> tuple[FileRole, str]:
    """The role and base request of a claim's file from its name alone, for a record written before files
    carried them: by the rules that name the files (`agent.claims.filenames`:
    `<uid>/<request>/metadata.json` below the metadata directory; `metadata_spec_name`:
    `<vendor>_metadata_<uid>_<request>.json`); any other file of a record is the claim's CDI spec."""
    p = PurePosixPath(path)
    if p.name == METADATA_FILE_NAME:
        return FileRole.METADATA_FILE, p.parent.name
    if (request := metadata_spec_request(p.name)) is not None:
        return FileRole.METADATA_SPEC, request
    return FileRole.CLAIM_SPEC, ""


@dataclass(slots=True, init=False)
class FileRecord:
    path: str
    content: bytes
    mode: int
    role: FileRole  # what the file is
    request: str  # the base request of a metadata file or spec; "" for the claim spec

    def __init__(self, path: str, content: bytes, mode: int = FILE_MODE, role: FileRole | None = None,
                 request: str = "") -> None:
        """Without a role (a record written before files carried one), role and request come from the
        path's name (`role_of`)."""
        if role is None:
            role, request = role_of(path)
        self.path, self.content, self.mode, self.role, self.request = path, content, mode, role, request

    def wire(self) -> dict[str, Any]:
        return {"path": self.path, "mode": self.mode, "content": self.content.decode(), "role": str(self.role),
                "request": self.request}

    @classmethod
    def from_wire(cls, raw: Any) -> FileRecord:
        role, request = raw.get("role"), raw.get("request", "")
        if (role is not None and not isinstance(role, str)) or not isinstance(request, str):
            raise TypeError(f"file {raw.get('path')!r}: role and request must be strings"[:200])
        return cls(raw["path"], raw["content"].encode(), int(raw["mode"]), None if role is None else FileRole(role),
                   request)


@dataclass(slots=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    pod_claim_name: str = ""
    devices: list[PreparedDevice] = field(default_factory=list)  # the kubelet response
    files: list[FileRecord] = field(default_factory=list)
    # Directories created for this claim (named by its UID), removed whole at unprepare.
    dirs: list[str] = field(default_factory=list)
    prepared_at: float = 0.0
    generation: int = 1
    state: RecordState = PREPARED
    bindings: list[DeviceBinding] = field(default_factory=list)  # version 2 or 3
    partitions: list[DevicePartition] = field(default_factory=list)  # version 3 only
    # Prepared as soon as the claim was allocated here, before the kubelet asked, for its devices' binding
    # conditions (`agent.engine.prebind`): undone when the claim loses that allocation before its pod runs.
    # An older agent ignores the field and takes the record for a kubelet's prepare, which it also is then.
    ahead: bool = False

    @property
    def version(self) -> int:
        """The format version the record is written in: the oldest one that holds it."""
        if self.partitions:
            return PARTITIONS_VERSION
        return BINDINGS_VERSION if self.bindings or self.state is not PREPARED else FORMAT_VERSION

    @property
    def prepared(self) -> bool:
        return self.state is PREPARED

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "state": str(self.state),
            "podClaimName": self.pod_claim_name,
            "devices": [d.to_json() for d in self.devices],
            "files": [f.wire() for f in self.files],
            "dirs": self.dirs,
            "preparedAt": self.prepared_at,
            "generation": self.generation,
        }
        if self.ahead:
            body["preparedAhead"] = True
        if self.version >= BINDINGS_VERSION:
            body["bindings"] = [b.wire() for b in self.bindings]
        if self.version >= PARTITIONS_VERSION:
            body["partitions"] = [p.wire() for p in self.partitions]
        return orjson.dumps(body)

    @classmethod
    def from_json(cls, body: bytes, version: int = FORMAT_VERSION) -> ClaimRecord:
        d = orjson.loads(body)
        try:
            bindings: list[DeviceBinding] = []
            partitions: list[DevicePartition] = []
            if version == FORMAT_VERSION:
                if d["state"] != PREPARED or "bindings" in d or "partitions" in d:
                    raise ValueError(f"a version-1 record is prepared and has no bindings (state {d['state']!r})")
                state = PREPARED
            else:
                state = RecordState(d["state"])
                raw = d["bindings"]
                if not isinstance(raw, list):
                    raise TypeError("bindings must be a list")
                bindings = [DeviceBinding.from_wire(b) for b in raw]
                if version == BINDINGS_VERSION and "partitions" in d:
                    raise ValueError("a version-2 record has no partitions")
                if version == PARTITIONS_VERSION:
                    parts = d["partitions"]
                    if not isinstance(parts, list) or not parts:
                        raise TypeError("partitions must be a non-empty list")
                    partitions = [DevicePartition.from_wire(p) for p in parts]
            names = (d["uid"], d["namespace"], d["name"], d.get("podClaimName", ""), *d.get("dirs", []))
            if not all(isinstance(v, str) for v in names):
                raise TypeError("uid, namespace, name, podClaimName and dirs must be strings")
            return cls(
                uid=d["uid"],
                namespace=d["namespace"],
                name=d["name"],
                pod_claim_name=d.get("podClaimName", ""),
                devices=[PreparedDevice.from_json(x) for x in d["devices"]],
                files=[FileRecord.from_wire(f) for f in d["files"]],
                dirs=list(d.get("dirs", [])),
                prepared_at=float(d.get("preparedAt", 0.0)),
                generation=int(d.get("generation", 1)),
                state=state,
                bindings=bindings,
                partitions=partitions,
                ahead=d.get("preparedAhead") is True,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordError(f"record body is incomplete: {exc!r}") from exc


def encode(record: ClaimRecord) -> bytes:
    body = record.to_json()
    header = b"%s %d %s %d\n" % (MAGIC, record.version, hashlib.sha256(body).hexdigest().encode(), len(body))
    return header + body


def decode(data: bytes) -> ClaimRecord:
    header, sep, body = data.partition(b"\n")
    if not sep:
        raise RecordError("no header line")
    parts = header.split(b" ")
    if len(parts) != 4 or parts[0] != MAGIC:
        raise RecordError("not a claim record")
    try:
        version, length = int(parts[1]), int(parts[3])
    except ValueError as exc:
        raise RecordError("malformed header") from exc
    if version not in READABLE_VERSIONS:
        raise RecordError(f"record format version {version} is not supported (this agent reads "
                          f"{', '.join(map(str, READABLE_VERSIONS))})")
    if len(body) != length:
        raise RecordError(f"body is {len(body)} bytes, header says {length} (truncated?)")
    if hashlib.sha256(body).hexdigest().encode() != parts[2]:
        raise RecordError("checksum mismatch (corrupted)")
    try:
        return ClaimRecord.from_json(body, version)
    except orjson.JSONDecodeError as exc:
        raise RecordError(f"body is not JSON: {exc}") from exc


def partition_attributes(part: DevicePartition) -> dict[str, AttrValue]:
    """What a made partition adds to its device's attributes (so to the metadata file): its UUID, under
    its kind's `uuid_attribute`. The one place for both the prepare (`Partitioner.device`) and a later
    metadata refresh, which renders the devices from the inventory again and must keep them."""
    if not part.uuid:
        return {}
    return {part.kind.uuid_attribute: part.uuid}

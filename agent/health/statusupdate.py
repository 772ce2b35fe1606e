"""A claim's `status.devices` written by an update of the status subresource that keeps the claim's raw
fields exactly as the API server holds them: for claims whose status no server-side apply can change.

Why (docs/deployment.md, "When something is stuck"): the API server keeps a claim's opaque configuration
(`parameters`, copied by the scheduler into `status.allocation.devices.config`) as the bytes it was sent,
and checks after decoding any status write that the allocation did not change, comparing those bytes. A
server-side apply decodes the claim into fields and encodes them again (keys sorted, no spaces), a merge or
JSON patch re-encodes the whole object as compact JSON: parameters sent with their keys out of order
defeat the first, parameters sent with spaces (or escapes, or numbers written otherwise than Go writes
them) defeat both, and the write is refused (`status.allocation: ... field cannot be modified once set`)
whoever makes it. An update whose body carries those bytes unchanged is taken: they are read from the
claim's protobuf encoding (`proto/k8s_claim.proto`), which holds them as stored, and spliced into the JSON
body in place of what the JSON answer re-encoded. The same is done for the `data` of every entry kept
(another driver's entry sent back other than as stored would count as a change of that driver's entries,
which the API server authorizes per driver).

Each attempt reads the claim twice (protobuf, then JSON: the same resourceVersion, else read again) and
sends one update with that resourceVersion; a conflict (someone wrote the claim meanwhile) starts over.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightkube
import orjson
from lightkube.resources.resource_v1 import ResourceClaim, ResourceClaimStatus

from agent import kube
from agent.names import ClaimRef

log = logging.getLogger(__name__)

ATTEMPTS = 5  # reads and updates in a row that may meet a newer version of the claim
ENVELOPE = b"k8s\x00"  # the API server's protobuf answers start so, then a runtime.Unknown


class UpdateConflict(Exception):
    """The claim kept changing under the update (every attempt met a newer version)."""


class WrongIncarnation(Exception):
    """The claim of that name has another UID."""


@dataclass(frozen=True, slots=True)
class StoredRaw:
    """What the protobuf encoding says of one version of the claim: its identity, and its raw fields'
    bytes by position (`None`: the field is not set)."""

    uid: str
    resource_version: str
    parameters: tuple[bytes | None, ...]  # status.allocation.devices.config[i].opaque.parameters
    data: tuple[bytes | None, ...]  # status.devices[i].data


def decode_stored(answer: bytes) -> StoredRaw:
    """The raw fields of a protobuf answer for a ResourceClaim (ValueError when it is not one)."""
    from google.protobuf.message import DecodeError

    from agent.pb import k8s_claim_pb2 as pb

    if not answer.startswith(ENVELOPE):
        raise ValueError("not a Kubernetes protobuf answer (no k8s envelope)")
    try:
        envelope = pb.Unknown.FromString(answer[len(ENVELOPE):])
        claim = pb.ResourceClaim.FromString(envelope.raw)
    except DecodeError as exc:
        raise ValueError(f"not a ResourceClaim in protobuf: {exc}") from exc
    config = claim.status.allocation.devices.config
    params = tuple(c.deviceConfiguration.opaque.parameters.raw
                   if c.deviceConfiguration.opaque.HasField("parameters") else None for c in config)
    data = tuple(d.data.raw if d.HasField("data") else None for d in claim.status.devices)
    return StoredRaw(claim.metadata.uid, claim.metadata.resourceVersion, params, data)


def update_body(obj: Mapping[str, Any], stored: StoredRaw, driver: str,
                entries: Sequence[Mapping[str, Any]]) -> bytes:
    """The update of `obj` (the claim's JSON answer, of the version `stored` describes) whose status.devices
    are the other drivers' entries as they are, then `entries`; every raw field as stored."""
    body = dict(obj)
    meta = dict(body.get("metadata") or {})
    meta.pop("managedFields", None)  # absent: the API server keeps them as they are
    body["metadata"] = meta
    status = dict(body.get("status") or {})
    allocation = status.get("allocation")
    if isinstance(allocation, Mapping):
        status["allocation"] = _with_parameters(allocation, stored.parameters)
    kept = [_with_raw(e, "data", stored.data[i] if i < len(stored.data) else None)
            for i, e in enumerate(status.get("devices") or []) if e.get("driver") != driver]
    devices = [*kept, *(dict(e) for e in entries)]
    if devices:
        status["devices"] = devices
    else:
        status.pop("devices", None)
    body["status"] = status
    return orjson.dumps(body)


def _with_raw(obj: Mapping[str, Any], key: str, raw: bytes | None) -> dict[str, Any]:
    out = dict(obj)
    if raw is not None and key in out:
        out[key] = orjson.Fragment(raw)
    return out


def _with_parameters(allocation: Mapping[str, Any], params: tuple[bytes | None, ...]) -> dict[str, Any]:
    out = dict(allocation)
    devices = dict(out.get("devices") or {})
    config = list(devices.get("config") or [])
    if len(config) != len(params):
        raise ValueError(f"the claim's JSON has {len(config)} allocation config entries, its protobuf {len(params)}")
    for i, entry in enumerate(config):
        opaque = entry.get("opaque")
        if isinstance(opaque, Mapping):
            config[i] = {**entry, "opaque": _with_raw(opaque, "parameters", params[i])}
    devices["config"] = config
    out["devices"] = devices
    return out


async def update_status(client: lightkube.AsyncClient, claim: ClaimRef, driver: str,
                        entries: Sequence[Mapping[str, Any]]) -> None:
    """Make this driver's entries of the claim's status.devices exactly `entries`, by update. Raises
    WrongIncarnation, UpdateConflict, or what the client raises (a 404 for a claim that is gone)."""
    for _ in range(ATTEMPTS):
        stored = decode_stored(await kube.raw_call(client, "get", ResourceClaim, claim.name, claim.namespace,
                                                   accept=kube.PROTOBUF))
        obj = orjson.loads(await kube.raw_call(client, "get", ResourceClaim, claim.name, claim.namespace))
        meta = obj.get("metadata") or {}
        if (meta.get("uid"), meta.get("resourceVersion")) != (stored.uid, stored.resource_version):
            continue  # written (or re-created) between the two reads
        if stored.uid != claim.uid:
            raise WrongIncarnation(f"ResourceClaim {claim.namespace}/{claim.name} now has UID {stored.uid!r}, "
                                   f"not {claim.uid}")
        body = update_body(obj, stored, driver, entries)
        try:
            await kube.raw_call(client, "replace", ResourceClaimStatus, claim.name, claim.namespace, body=body)
        except Exception as exc:
            if kube.is_conflict(exc):
                continue
            raise
        return
    raise UpdateConflict(f"ResourceClaim {claim.namespace}/{claim.name} changed under each of {ATTEMPTS} updates")

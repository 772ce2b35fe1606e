"""What a prepared claim's CDI spec says of each of its devices, and the spec derived again from what the
devices are now (`agent.engine.recheck`: after a reboot the host renumbers VFIO device files and IOMMU
groups, and a MIG instance made again has a new UUID).

A device's entry in the claim spec (`agent.claims.cdispecs.claim_spec`) is its device nodes and its
variables: first those that describe the device (`device_env`: `DRA_<DEVICE>_NAME`, `_UUID`, `_PCI_BUS_ID`,
...), then the claim's own (its opaque configuration, a share's limits), sorted. The spec is derived again
whole, as prepare derives it, from the devices as they are now and the claim's own variables as prepare
wrote them (the record holds no other copy of the claim's configuration, and none is needed), but for
`CUDA_VISIBLE_DEVICES`, which names the devices and is derived again with them: nothing else of the
recorded spec (an edit prepare never writes) reaches the host (docs/security.md, "Claim records").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from agent.claims.cdispecs import DEVICE_VARIABLES, claim_spec, env_prefix
from agent.claims.metadata import AllocatedDevice
from agent.claims.plan import CUDA_VISIBLE_DEVICES, visible_env
from agent.claims.records import ClaimRecord, FileRole
from agent.errors import ClaimFailure
from cdi.store import encode_spec


class SpecUnknown(ClaimFailure):
    """The record's claim spec is not one this agent can read its devices from (no such file, not JSON,
    a device without an entry): what the claim's containers get cannot be judged or rewritten."""


@dataclass(frozen=True, slots=True)
class SpecEntry:
    """A device's entry in the claim spec: its describing variables (name -> value), the claim's own
    variables after them (as written), and its device nodes (container path, host path)."""

    described: dict[str, str]
    own: tuple[str, ...]
    nodes: tuple[tuple[str, str], ...]


def claim_spec_of(record: ClaimRecord) -> tuple[int, dict[str, Any]]:
    """The index of the claim spec among the record's files, and the spec."""
    for i, f in enumerate(record.files):
        if f.role is FileRole.CLAIM_SPEC:
            try:
                spec = orjson.loads(f.content)
            except orjson.JSONDecodeError as exc:
                raise SpecUnknown(f"the claim's CDI spec {f.path} in its record is not JSON: {exc}") from exc
            if not isinstance(spec, dict) or not isinstance(spec.get("devices"), list):
                raise SpecUnknown(f"the claim's CDI spec {f.path} in its record has no list of devices")
            return i, spec
    raise SpecUnknown("the claim's record holds no CDI spec of its devices")


def entries(record: ClaimRecord) -> dict[str, SpecEntry]:
    """Device name -> its entry, for every device of the record."""
    _, spec = claim_spec_of(record)
    by_name = {d.get("name"): d for d in spec["devices"] if isinstance(d, dict)}
    out = {}
    for d in record.devices:
        raw = by_name.get(f"{record.uid}-{d.device}")
        if raw is None:
            raise SpecUnknown(f"the claim's CDI spec has no entry for device {d.device}")
        out[d.device] = _entry(d.device, raw)
    return out


def _entry(name: str, raw: dict[str, Any]) -> SpecEntry:
    edits = raw.get("containerEdits") or {}
    env = [e for e in edits.get("env") or [] if isinstance(e, str)]
    nodes = tuple((str(n.get("path")), str(n.get("hostPath"))) for n in edits.get("deviceNodes") or []
                  if isinstance(n, dict))
    described, own = split_env(name, env)
    return SpecEntry(described, own, nodes)


def split_env(name: str, env: Sequence[str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """A device's variables as its entry lists them: those that describe it (first, each once:
    `device_env`), name -> value, and the claim's own after them, as written."""
    keys = {f"{env_prefix(name)}_{v}" for v in DEVICE_VARIABLES}
    described: dict[str, str] = {}
    n = 0
    for item in env:
        key, _, value = item.partition("=")
        if key not in keys or key in described:
            break
        described[key] = value
        n += 1
    return described, tuple(env[n:])


def respecified(vendor: str, record: ClaimRecord, now: Sequence[AllocatedDevice]) -> bytes | None:
    """The claim spec's content derived again (`derived`); None when the record's spec says it already.
    SpecUnknown when the record's spec cannot be read so."""
    i, _ = claim_spec_of(record)
    content = derived(vendor, record, now)
    return None if content == record.files[i].content else content


def derived(vendor: str, record: ClaimRecord, now: Sequence[AllocatedDevice]) -> bytes:
    """The claim spec as prepare writes it for the devices as they are now (`now`: the record's allocation,
    with what its host effects give them): each device's nodes and describing variables from the device,
    `CUDA_VISIBLE_DEVICES` from the claim's GPU forms, the claim's other variables from the record's spec.
    SpecUnknown when the record's spec cannot be read so."""
    have = entries(record)
    visible = visible_env(list(now))
    own: dict[str, dict[str, str]] = {}
    for name, entry in have.items():
        pairs = (item.partition("=") for item in entry.own)
        kept = {key: value for key, _, value in pairs if key != CUDA_VISIBLE_DEVICES}
        own[name] = {**kept, **visible.get(name, {})}
    return encode_spec(claim_spec(vendor, record.uid, now, own))

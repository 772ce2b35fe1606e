"""A device condition's cause, and the file the running agent keeps them in.

`<state dir>/health/causes.json`, written atomically on every change (`agent.health.conditions`):

    {"version": 1, "driver": "dra.example.com", "savedAt": 1800000000.0,
     "causes": [{"device": "gpu-3", "kind": "xid", "effect": "NoSchedule", "value": "48",
                 "detail": "XID 48 (double-bit ECC error), recovery action gpu-reset",
                 "since": 1800000000.0, "expires": null,
                 "bootId": "3f0c...", "gpuUuid": "GPU-5d1e..."}]}

`bootId` (the kernel's boot ID when the cause was recorded) and `gpuUuid` (the GPU's UUID as NVML
said it) tell a later start whether the GPU the cause is about may have been reset since: a
reboot resets it, and another GPU at the same name is not the one that failed. Files written
before these fields existed are read all the same (the fields read as "", unknown).
`dra-agent taints` reads the file too (`read_saved`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

XID = "xid"
GPU_LOST = "gpu-lost"
LINK_DOWN = "link-down"
UNDO_FAILED = "undo-failed"  # a claim's unprepare could not undo its host changes (`agent.claims.leftovers`)
NVML_LOST = "nvml-lost"  # NVML does not answer as a whole (the NVIDIA driver unloaded): on every GPU NVML had
KINDS = (XID, GPU_LOST, LINK_DOWN, UNDO_FAILED, NVML_LOST)

CAUSES_FILE = "causes.json"
FORMAT_VERSION = 1


def rfc3339(unix: float) -> str:
    return datetime.datetime.fromtimestamp(int(unix), datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Cause:
    """One reason a device is tainted (or reported) now."""

    device: str
    kind: str  # XID | GPU_LOST | LINK_DOWN | UNDO_FAILED
    effect: str  # a taint effect
    value: str  # the taint's value: the XID number, or ""
    detail: str  # for people: "XID 48 (double-bit ECC error), recovery action gpu-reset"
    since: float  # unix seconds
    expires: float | None = None  # unix seconds: an informational cause goes by itself then
    boot_id: str = ""  # the kernel boot it was recorded in ("": unknown)
    gpu_uuid: str = ""  # the GPU it was recorded for ("": unknown, or not a GPU's)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "kind": self.kind, "effect": self.effect, "value": self.value,
                "detail": self.detail, "since": self.since, "expires": self.expires,
                "bootId": self.boot_id, "gpuUuid": self.gpu_uuid}

    @classmethod
    def from_json(cls, d: Any) -> Cause:
        kind = str(d["kind"])
        if kind not in KINDS:
            raise ValueError(f"unknown cause kind {kind!r}")
        expires = d.get("expires")
        return cls(device=str(d["device"]), kind=kind, effect=str(d["effect"]), value=str(d.get("value", "")),
                   detail=str(d.get("detail", "")), since=float(d["since"]),
                   expires=float(expires) if expires is not None else None,
                   boot_id=str(d.get("bootId") or ""), gpu_uuid=str(d.get("gpuUuid") or ""))


def encode(driver: str, saved_at: float, causes: list[Cause]) -> bytes:
    doc = {"version": FORMAT_VERSION, "driver": driver, "savedAt": saved_at,
           "causes": [c.to_json() for c in causes]}
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2)


def read_saved(directory: Path) -> tuple[list[Cause], float | None]:
    """The causes a running agent saved last, and when. Raises OSError (FileNotFoundError when
    there is none) or ValueError (not the format)."""
    doc = orjson.loads((directory / CAUSES_FILE).read_bytes())
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise ValueError(f"format version {version!r} is not {FORMAT_VERSION}")
    try:
        causes = [Cause.from_json(c) for c in doc["causes"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"a cause lacks a field or has one of the wrong type: {exc}") from exc
    saved_at = doc.get("savedAt")
    return causes, float(saved_at) if saved_at is not None else None

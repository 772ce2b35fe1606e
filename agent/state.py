"""Durable per-claim records: the truth about what this node has prepared.

One file per claim (`<state dir>/claims/<uid>.rec`), so a prepare costs O(1)
whatever else is prepared. A record holds everything needed to re-derive the
claim's files after a crash (their exact content), and the kubelet response.

On-disk format (version 1): one header line, then the body.

    DRAREC 1 <sha256 of body, hex> <body length>\\n
    <body: a JSON object>

The checksum catches torn or corrupted files; the version lets a later agent
read (or refuse, clearly) what an earlier one wrote. Records are written
atomically and fsync'd together with their directory: the one fsync of a prepare.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agent.fsutil import atomic_write, is_temp_name, makedirs, unlink_quiet
from agent.names import InvalidName, check_uid

log = logging.getLogger(__name__)

MAGIC = b"DRAREC"
FORMAT_VERSION = 1
SUFFIX = ".rec"

PREPARED = "prepared"


class RecordError(ValueError):
    pass


@dataclass(slots=True)
class FileRecord:
    path: str
    content: bytes
    mode: int = 0o644


@dataclass(slots=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    state: str = PREPARED
    pod_claim_name: str = ""
    # The kubelet response: [{requestNames, pool, device, cdiDeviceIds, shareId?}]
    devices: list[dict[str, Any]] = field(default_factory=list)
    files: list[FileRecord] = field(default_factory=list)
    # Directories created for this claim, removed (when empty of other claims' files) at unprepare.
    dirs: list[str] = field(default_factory=list)
    prepared_at: float = 0.0
    generation: int = 1

    def to_json(self) -> bytes:
        return orjson.dumps({
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "state": self.state,
            "podClaimName": self.pod_claim_name,
            "devices": self.devices,
            "files": [{"path": f.path, "mode": f.mode, "content": f.content.decode()} for f in self.files],
            "dirs": self.dirs,
            "preparedAt": self.prepared_at,
            "generation": self.generation,
        })

    @classmethod
    def from_json(cls, body: bytes) -> ClaimRecord:
        d = orjson.loads(body)
        try:
            return cls(
                uid=d["uid"],
                namespace=d["namespace"],
                name=d["name"],
                state=d["state"],
                pod_claim_name=d.get("podClaimName", ""),
                devices=list(d["devices"]),
                files=[FileRecord(f["path"], f["content"].encode(), int(f["mode"])) for f in d["files"]],
                dirs=list(d.get("dirs", [])),
                prepared_at=float(d.get("preparedAt", 0.0)),
                generation=int(d.get("generation", 1)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordError(f"record body is incomplete: {exc!r}") from exc


def encode(record: ClaimRecord) -> bytes:
    body = record.to_json()
    header = b"%s %d %s %d\n" % (MAGIC, FORMAT_VERSION, hashlib.sha256(body).hexdigest().encode(), len(body))
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
    if version != FORMAT_VERSION:
        raise RecordError(f"record format version {version} is not supported (this agent reads "
                          f"{FORMAT_VERSION})")
    if len(body) != length:
        raise RecordError(f"body is {len(body)} bytes, header says {length} (truncated?)")
    if hashlib.sha256(body).hexdigest().encode() != parts[2]:
        raise RecordError("checksum mismatch (corrupted)")
    try:
        return ClaimRecord.from_json(body)
    except orjson.JSONDecodeError as exc:
        raise RecordError(f"body is not JSON: {exc}") from exc


class ClaimStore:
    """The records directory. Blocking: call from a worker thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def ensure(self) -> None:
        makedirs(self.directory, 0o700)

    def path(self, uid: str) -> Path:
        check_uid(uid)
        return self.directory / f"{uid}{SUFFIX}"

    def write(self, record: ClaimRecord) -> None:
        atomic_write(self.path(record.uid), encode(record), mode=0o600, durable=True)

    def delete(self, uid: str) -> bool:
        # No fsync: if the unlink is lost in a crash, the record comes back, its
        # files are repaired and the kubelet's repeated unprepare removes them.
        return unlink_quiet(self.path(uid))

    def load_all(self, clean: bool = False) -> tuple[dict[str, ClaimRecord], list[tuple[str, str]]]:
        """All readable records, and (file name, problem) for those that are not.

        `clean` (start-up only, before any prepare can run) also removes temp files of record
        writes that never reached their rename; a reader beside a running agent must not."""
        records: dict[str, ClaimRecord] = {}
        problems: list[tuple[str, str]] = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return records, problems
        for name in names:
            path = self.directory / name
            if is_temp_name(name):
                if clean:
                    unlink_quiet(path)
                continue
            if not name.endswith(SUFFIX):
                continue
            uid = name[: -len(SUFFIX)]
            try:
                check_uid(uid)
                record = decode(path.read_bytes())
                if record.uid != uid:
                    raise RecordError(f"record names UID {record.uid}")
            except (OSError, RecordError, InvalidName) as exc:
                problems.append((name, str(exc)))
                continue
            records[uid] = record
        return records, problems

    def quarantine(self, name: str) -> Path:
        """Move an unreadable record aside (kept for a person to look at, never read again)."""
        src = self.directory / name
        dst = self.directory / f"{name}.corrupt"
        os.replace(src, dst)
        return dst

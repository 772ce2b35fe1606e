"""Which GPUs the agent put into MIG mode: one marker file per GPU, `<state>/mig-mode/<GPU UUID>`.

MIG mode is a fact of the GPU, not of one claim: the claim whose prepare turned it on may be
unprepared while another claim still has an instance on the GPU, and the last claim to go must then
turn the mode off (so the whole GPU is usable again). So the fact lives beside the records, written
durably before the mode is changed and removed once it is off again. A GPU the operator put into MIG
mode has no marker and keeps its mode.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import TYPE_CHECKING

from agent.fsutil import Root
from agent.kinds import PartitionKind

if TYPE_CHECKING:
    from agent.claims.records import ClaimRecord

_UUID = re.compile(r"[A-Za-z0-9-]{1,128}")  # NVML's `GPU-<hex groups>`


class MigModeMarks:
    def __init__(self, directory: Path) -> None:
        self.root = Root(directory, dir_mode=0o700)

    def _path(self, gpu_uuid: str) -> Path:
        if not _UUID.fullmatch(gpu_uuid):  # a file name, never a path
            raise ValueError(f"not a GPU UUID: {gpu_uuid!r}"[:200])
        return self.root.path / gpu_uuid

    def mark(self, gpu_uuid: str) -> None:
        """Before turning MIG mode on: durable, so a crash right after still knows who turned it on."""
        path = self._path(gpu_uuid)
        self.root.ensure()
        self.root.write(path, b"", mode=0o600, durable=True)

    def marked(self, gpu_uuid: str) -> bool:
        return self._path(gpu_uuid).is_file()

    def clear(self, gpu_uuid: str) -> None:
        """After MIG mode is off again."""
        self.root.unlink(self._path(gpu_uuid), durable=True)


class MigModeRescans:
    """A claim listener (`agent.engine.prepare.ClaimListener`) that asks for a rescan of the GPUs after a claim
    with a MIG device was prepared or unprepared: the GPU's MIG mode may have changed with it, and with the mode
    whether the whole GPU is published (`agent.inventory.gpus.withhold_in_mig_mode`). Without it the inventory
    kept the mode it last scanned: an agent started while another agent's MIG device held a GPU in MIG mode (a
    rolling update) withheld that whole GPU after the mode went off, until its next periodic rescan. `wanted`
    coalesces the requests; the daemon rescans when it is set."""

    def __init__(self, wanted: asyncio.Event) -> None:
        self.wanted = wanted

    def _told(self, record: ClaimRecord) -> None:
        if any(p.kind is PartitionKind.MIG for p in record.partitions):
            self.wanted.set()

    def claim_prepared(self, record: ClaimRecord) -> None:
        self._told(record)

    def claim_unprepared(self, record: ClaimRecord) -> None:
        self._told(record)

    def claim_refreshed(self, record: ClaimRecord) -> None:
        pass

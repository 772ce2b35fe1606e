"""Which GPUs the agent put into MIG mode: one marker file per GPU, `<state>/mig-mode/<GPU UUID>`.

MIG mode is a fact of the GPU, not of one claim: the claim whose prepare turned it on may be
unprepared while another claim still has an instance on the GPU, and the last claim to go must then
turn the mode off (so the whole GPU is usable again). So the fact lives beside the records, written
durably before the mode is changed and removed once it is off again. A GPU the operator put into MIG
mode has no marker and keeps its mode.
"""

from __future__ import annotations

import re
from pathlib import Path

from agent.fsutil import Root

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

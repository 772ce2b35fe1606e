"""Where a node's PCI functions live for the prepare engine: sysfs, /proc and /dev of the real host,
or of the simulated machine under the state directory (`--nvml sim`), whose kernel emulator applies
the same writes. Also the kernel's boot ID, which tells recovery whether the kernel still has the
bindings a record says it made (a reboot forgets them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.config import Settings


@dataclass(frozen=True, slots=True)
class VfioHost:
    sysfs: Path
    proc: Path
    dev: Path

    @classmethod
    def of(cls, settings: Settings) -> VfioHost:
        if settings.nvml.kind == "sim":
            root = settings.sim_root
            return cls(root / "sys", root / "proc", root / "dev")
        # `proc` beside the sysfs root, as GPU discovery reads the driver's GPU list.
        return cls(settings.sysfs_root, settings.sysfs_root.parent / "proc", settings.dev_root)

    def boot_id(self) -> str:
        """The running kernel's boot ID ("" when it cannot be read: every start then counts as a reboot
        for bindings, which re-applies them, a no-op when they are in place)."""
        try:
            return (self.proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
        except OSError:
            return ""

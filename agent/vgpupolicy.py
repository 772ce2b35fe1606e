"""Which vGPU types the agent publishes (`--vgpu-types`); read by Settings, so it imports nothing heavy.

Counters cannot keep two vGPU types of one GPU apart, nor a vGPU from a MIG instance (both are sums:
`agent.inventory.vgpu`); compatibility groups can. Without them, the published set must be exact
under the counters alone: one type, and no vGPU on a GPU that publishes MIG placements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VgpuPolicy:
    """Which types are published (`--vgpu-types`), and whether the published set must be exact under
    the counters alone (no compatibility groups: one type per GPU, and none beside MIG placements)."""

    types: frozenset[str] | None = None  # type ids or names; None: every type offered
    exclusive: bool = True  # without compatibility groups
    enabled: bool = True

    @classmethod
    def of(cls, setting: str, compatibility_groups: bool) -> VgpuPolicy:
        """`auto` (every type with compatibility groups, none without), `none`, or a comma list."""
        words = [w.strip() for w in setting.split(",") if w.strip()]
        if words in ([], ["none"]):
            return cls(frozenset(), not compatibility_groups, False)
        if words == ["auto"]:
            return cls(None, not compatibility_groups, compatibility_groups)
        if "auto" in words or "none" in words:
            raise ValueError(f"--vgpu-types {setting!r}: auto and none stand alone")
        if len(words) > 1 and not compatibility_groups:
            raise ValueError(f"--vgpu-types {setting!r}: without --compatibility-groups a GPU can offer one vGPU "
                             "type only (the counters cannot keep two types apart, the host driver can)")
        return cls(frozenset(words), not compatibility_groups, True)

    def wants(self, type_id: str, name: str) -> bool:
        return self.types is None or type_id in self.types or name in self.types

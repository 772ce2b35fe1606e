"""The environment a claim's configuration may give its devices: which names are the agent's alone
(`reserved_env`), and the MPS limits a configuration may only lower (their format and the lower of two).
`agent.claims.allocation` applies these rules as it decodes a configuration, `agent.claims.plan` as it
puts the agent's variables beside the configurations'."""

from __future__ import annotations

import re

from agent.errors import ClaimError

# The variables that are the agent's: those it sets for a claim's devices, and those that select the
# devices, their limits or the dynamic loader. No configuration sets them, with one exception below:
# CDI applies a claim's variables in the claim's CDI device, beside the agent's, and a tenant who may
# create claims must not widen what the NVIDIA runtime exposes, leave its share or load a library of
# its choice (docs/security.md).
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES"})
RESERVED_ENV_PREFIXES = ("NVIDIA_", "CUDA_MPS_", "LD_", "DRA_")
RESERVED_ENV_TEXT = ", ".join([*sorted(RESERVED_ENV), *(f"{prefix}*" for prefix in RESERVED_ENV_PREFIXES)])
# The exception: the MPS limits, which a DeviceClass's configuration (the administrator's) or the claim's
# own may set, only ever lower. Prepare keeps the lowest of the agent's value (from the consumed
# capacity) and every configuration's, per CUDA ordinal (`agent.claims.plan`).
MPS_MEMORY_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
MPS_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_LIMITS = (MPS_MEMORY_LIMIT, MPS_THREAD_PERCENTAGE)
_MPS_MEMORY_ENTRY = re.compile(r"^(\d{1,3})=(\d{1,9})([MG])\Z")


def reserved_env(name: str) -> bool:
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


def mps_memory_limits(value: str, where: str = "") -> dict[int, int]:
    """`0=2048M,1=1G` -> {CUDA ordinal: MiB}; ClaimError naming `where` for anything else."""
    out: dict[int, int] = {}
    for entry in value.split(","):
        m = _MPS_MEMORY_ENTRY.match(entry.strip())
        if m is None or int(m[1]) in out:
            raise ClaimError(f"{where}: {MPS_MEMORY_LIMIT} must be '<ordinal>=<size>M|G,...' (each ordinal once), "
                             f"not {value[:80]!r}")
        out[int(m[1])] = int(m[2]) * (1024 if m[3] == "G" else 1)
    return out


def format_mps_memory_limits(limits: dict[int, int]) -> str:
    return ",".join(f"{i}={mib}M" for i, mib in sorted(limits.items()))


def lower_limit(key: str, old: str | None, new: str) -> str:
    """The lower of two values of an MPS limit (per ordinal for the memory limit; an ordinal only one of
    them names keeps its value)."""
    if old is None:
        return new
    if key == MPS_THREAD_PERCENTAGE:
        return str(min(int(old), int(new)))
    merged = mps_memory_limits(old)
    for ordinal, mib in mps_memory_limits(new).items():
        merged[ordinal] = min(mib, merged.get(ordinal, mib))
    return format_mps_memory_limits(merged)

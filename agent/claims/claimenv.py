"""The environment a claim's configuration may give its devices: which names are the agent's alone or
load code into every process (`reserved`), and the MPS limits a configuration may only lower (`MpsLimits`).
`agent.claims.allocation` applies these rules as it decodes a configuration, `agent.claims.plan` as it
puts the agent's variables beside the configurations'."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.claims.metadata import AllocatedDevice
from agent.errors import ClaimError


@dataclass(frozen=True, slots=True)
class Reserved:
    """A family of variables no configuration sets, and why: said in the refusal."""

    names: frozenset[str]
    prefixes: tuple[str, ...]
    why: str

    def holds(self, name: str) -> bool:
        return name in self.names or name.startswith(self.prefixes)

    def text(self) -> str:
        return ", ".join([*sorted(self.names), *(f"{prefix}*" for prefix in self.prefixes)])


# CDI applies a claim's variables in the claim's CDI device, beside the agent's, and later over the pod's
# own: a tenant who may create claims must not widen what the NVIDIA runtime exposes, leave its share, or
# have a library of its choice loaded into the processes of the pods that use the claim (docs/security.md).
RESERVED = (
    Reserved(frozenset({"CUDA_VISIBLE_DEVICES"}), ("NVIDIA_", "DRA_"),
             "the agent sets it: it says which devices the container's CUDA and the NVIDIA runtime use, and what "
             "they are"),
    Reserved(frozenset(), ("CUDA_MPS_",), "the agent sets it: a share's MPS limits and the MPS daemon's pipes"),
    # What loads code into every process: the dynamic loader's variables and its tunables (glibc drops
    # both for setuid programs), glibc's iconv modules, and the libraries the CUDA driver (at cuInit) and
    # NVTX (in every CUDA library built with it) load from the path they name. The list is the one
    # docs/security.md gives, with why others are not on it.
    Reserved(frozenset({"GCONV_PATH", "GLIBC_TUNABLES"}), ("LD_", "CUDA_INJECTION", "NVTX_INJECTION"),
             "it loads code into every process (the dynamic loader, glibc, the CUDA driver, NVTX)"),
)
RESERVED_ENV_TEXT = ", ".join(family.text() for family in RESERVED)

# The exception: the MPS limits, which a DeviceClass's configuration (the administrator's) or the claim's
# own may set, only ever lower and only for the claim's shares. They are one client's limits, so prepare
# gives them once for the claim: the lowest of the agent's value (from the consumed capacity) and every
# configuration's, per CUDA ordinal (`agent.claims.plan`).
MPS_MEMORY_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
MPS_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_LIMITS = (MPS_MEMORY_LIMIT, MPS_THREAD_PERCENTAGE)
_MPS_MEMORY_ENTRY = re.compile(r"^(\d{1,3})=(\d{1,9})([MG])\Z")


def reserved(name: str) -> Reserved | None:
    """The reserved family `name` is in, or None."""
    return next((family for family in RESERVED if family.holds(name)), None)


def is_share(alloc: AllocatedDevice) -> bool:
    """Whether an allocation result is a share of a shared GPU: an MPS client's limits come from it. One
    with admin access gets the device as it is, not a share of it, and consumes nothing."""
    return alloc.device.kind.shared and not alloc.admin_access


@dataclass(frozen=True, slots=True)
class MpsLimits:
    """The MPS limits of one client (a container's CUDA processes): pinned device memory per CUDA ordinal
    (MiB; the ordinal is the device's place in the claim's `CUDA_VISIBLE_DEVICES`) and the active thread
    percentage, one for all of its GPUs (None: not limited)."""

    memory: Mapping[int, int] = field(default_factory=dict, hash=False)
    threads: int | None = None

    @classmethod
    def decode(cls, env: Mapping[str, str], where: str) -> MpsLimits:
        """The limits a configuration's variables set; ClaimError naming `where` for a malformed one."""
        memory: dict[int, int] = {}
        if (value := env.get(MPS_MEMORY_LIMIT)) is not None:
            for entry in value.split(","):
                m = _MPS_MEMORY_ENTRY.match(entry.strip())
                if m is None or int(m[1]) in memory:
                    raise ClaimError(f"{where}: {MPS_MEMORY_LIMIT} must be '<ordinal>=<size>M|G,...' (each ordinal "
                                     f"once), not {value[:80]!r}")
                memory[int(m[1])] = int(m[2]) * (1024 if m[3] == "G" else 1)
        threads = env.get(MPS_THREAD_PERCENTAGE)
        if threads is not None and not (threads.isdigit() and 1 <= int(threads) <= 100):
            raise ClaimError(f"{where}: {MPS_THREAD_PERCENTAGE} must be a whole number from 1 to 100, "
                             f"not {threads[:80]!r}")
        return cls(memory, None if threads is None else int(threads))

    def lowered(self, other: MpsLimits) -> MpsLimits:
        """The lower of two limits, per ordinal (an ordinal only one of them names keeps its value)."""
        memory = dict(self.memory)
        for ordinal, mib in other.memory.items():
            memory[ordinal] = min(mib, memory.get(ordinal, mib))
        threads = min(t for t in (self.threads, other.threads) if t is not None) \
            if self.threads is not None or other.threads is not None else None
        return MpsLimits(memory, threads)

    def above(self, given: MpsLimits) -> list[str]:
        """What these limits allow beyond `given` (the agent's), each in words; [] when nothing."""
        out = []
        if ordinals := sorted(i for i, mib in self.memory.items() if i in given.memory and mib > given.memory[i]):
            out.append(f"{MPS_MEMORY_LIMIT}={self.memory_text()} is above what the claim's shares give "
                       f"({given.memory_text()}; ordinal {', '.join(map(str, ordinals))})")
        if self.threads is not None and given.threads is not None and self.threads > given.threads:
            out.append(f"{MPS_THREAD_PERCENTAGE}={self.threads} is above what the claim's compute shares give "
                       f"({given.threads})")
        return out

    def memory_text(self) -> str:
        return ",".join(f"{i}={mib}M" for i, mib in sorted(self.memory.items()))

    def env(self) -> dict[str, str]:
        return {**({MPS_MEMORY_LIMIT: self.memory_text()} if self.memory else {}),
                **({MPS_THREAD_PERCENTAGE: str(self.threads)} if self.threads is not None else {})}


@dataclass(frozen=True, slots=True)
class ConfiguredLimits:
    """The MPS limits one configuration entry sets, and where the entry is in the claim (for messages)."""

    where: str
    limits: MpsLimits

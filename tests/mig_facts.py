"""NVIDIA's published MIG profiles, as facts to check the agent (and the simulated NVML) against.

Source: NVIDIA Multi-Instance GPU User Guide, r580 (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/):
- "Supported MIG Profiles", the tables "GPU Instance Profiles on A30 / A100 / H100 / H200" and the
  products' profile names for A100-SXM4-80GB, H100 94GB and H100 96GB (H100 on GH200): per profile the
  fraction of memory and of SMs, the hardware units (NVDEC / JPEG / OFA), the copy engines and the
  number of instances available;
- "Getting Started with MIG", the placements `nvidia-smi mig -lgipp` lists on an A100 (`{starts}:size`
  per profile), the same geometry the placement figures show for the 8-memory-slice GPUs (A100, H100,
  H200); the A30 figure's placements for its 4 memory slices;
- the examples of GPU instances made side by side ("3-2-1-1", "2-1-1-1-1-1", two 3g) and the note that a
  (4 memory, 4 compute) and a (4 memory, 3 compute) profile fit together since R510.

Transcribed here by hand, apart from `agent/sim/migprofiles.py`, so a mistake in the simulator's tables
shows as a disagreement instead of being checked against itself. Two things the tables leave open are
settled as noted: the A100 table gives 1g.10gb (1g.20gb on 80GB) a memory fraction of 1/8 while its
placements are 2 memory slices long (and its name is twice 1g.5gb's): 2 slices it is, as on H100 and
H200 (1/4). A media engine belongs to one GPU instance: the whole-GPU profile has all of the GPU's
engines, so GPU instances side by side never hold more of an engine than it does (on an A30 only one of
1g.6gb+me and 2g.12gb+me, which each take the GPU's one JPEG and one OFA).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str  # without the "MIG " prefix
    memory_slices: int  # fraction of memory x the GPU's memory slices (the placement's size)
    compute_slices: int  # fraction of SMs x the GPU's compute slices
    decoders: int  # NVDEC
    jpegs: int
    ofas: int
    copy_engines: int
    instances: int  # number of instances available
    starts: tuple[int, ...]  # placements: first memory slice of each


@dataclass(frozen=True)
class Gpu:
    model: str
    memory_slices: int
    compute_slices: int
    profiles: tuple[Profile, ...]

    def profile(self, name: str) -> Profile:
        return next(p for p in self.profiles if p.name == name)

    @property
    def whole(self) -> Profile:
        """The profile of the whole GPU: every memory slice, and all of the GPU's engines."""
        return next(p for p in self.profiles if p.memory_slices == self.memory_slices)


_EIGHT = (0, 1, 2, 3, 4, 5, 6)  # 1-slice placements of an 8-memory-slice GPU (slice 7 has no SM slice)


def _ga100(five: str, ten: str, twenty: str, forty: str) -> tuple[Profile, ...]:
    """A100: 1g.5gb, 1g.5gb+me, 1g.10gb, 2g.10gb, 3g.20gb, 4g.20gb, 7g.40gb on 40GB, the names
    doubling on 80GB (the guide's note under the A100 table)."""
    return (
        Profile(f"1g.{five}", 1, 1, 0, 0, 0, 1, 7, _EIGHT),
        Profile(f"1g.{five}+me", 1, 1, 1, 1, 1, 1, 1, _EIGHT),
        Profile(f"1g.{ten}", 2, 1, 1, 0, 0, 1, 4, (0, 2, 4, 6)),
        Profile(f"2g.{ten}", 2, 2, 1, 0, 0, 2, 3, (0, 2, 4)),
        Profile(f"3g.{twenty}", 4, 3, 2, 0, 0, 3, 2, (0, 4)),
        Profile(f"4g.{twenty}", 4, 4, 2, 0, 0, 4, 1, (0,)),
        Profile(f"7g.{forty}", 8, 7, 5, 1, 1, 7, 1, (0,)),
    )


def _gh100(one: str, two: str, four: str, full: str) -> tuple[Profile, ...]:
    """H100 and H200: the H100 table's profiles and engines, named by each product's memory."""
    return (
        Profile(f"1g.{one}", 1, 1, 1, 1, 0, 1, 7, _EIGHT),
        Profile(f"1g.{one}+me", 1, 1, 1, 1, 1, 1, 1, _EIGHT),
        Profile(f"1g.{two}", 2, 1, 1, 1, 0, 1, 4, (0, 2, 4, 6)),
        Profile(f"2g.{two}", 2, 2, 2, 2, 0, 2, 3, (0, 2, 4)),
        Profile(f"3g.{four}", 4, 3, 3, 3, 0, 3, 2, (0, 4)),
        Profile(f"4g.{four}", 4, 4, 4, 4, 0, 4, 1, (0,)),
        Profile(f"7g.{full}", 8, 7, 7, 7, 1, 8, 1, (0,)),
    )


GPUS: dict[str, Gpu] = {
    "a30-24gb": Gpu("A30 24GB", 4, 4, (
        Profile("1g.6gb", 1, 1, 0, 0, 0, 1, 4, (0, 1, 2, 3)),
        Profile("1g.6gb+me", 1, 1, 1, 1, 1, 1, 1, (0, 1, 2, 3)),
        Profile("2g.12gb", 2, 2, 2, 0, 0, 2, 2, (0, 2)),
        Profile("2g.12gb+me", 2, 2, 2, 1, 1, 2, 1, (0, 2)),
        Profile("4g.24gb", 4, 4, 4, 1, 1, 4, 1, (0,)),
    )),
    "a100-40gb": Gpu("A100-SXM4-40GB", 8, 7, _ga100("5gb", "10gb", "20gb", "40gb")),
    "a100-80gb": Gpu("A100-SXM4-80GB", 8, 7, _ga100("10gb", "20gb", "40gb", "80gb")),
    "h100-80gb": Gpu("H100 80GB", 8, 7, _gh100("10gb", "20gb", "40gb", "80gb")),
    "h100-94gb": Gpu("H100 94GB", 8, 7, _gh100("12gb", "24gb", "47gb", "94gb")),
    "h100-96gb": Gpu("H100 96GB (GH200)", 8, 7, _gh100("12gb", "24gb", "48gb", "96gb")),
    "h200-141gb": Gpu("H200 141GB", 8, 7, _gh100("18gb", "35gb", "71gb", "141gb")),
}

# Memory per profile as a real GPU's NVML gives it (memorySizeMB), where one was read (tests/hw on a lent
# machine): an H200 (driver 580.159.04) answered 16 GiB for 1g.18gb, an eighth of its memory slices but
# 11.4% of the whole instance's 140 GiB, so the guide's fractions hold only roughly there.
MEASURED_MIB: dict[str, dict[str, int]] = {
    "h200-141gb": {"1g.18gb": 16384, "1g.18gb+me": 16384, "1g.35gb": 33280, "2g.35gb": 33280, "3g.71gb": 71424,
                   "4g.71gb": 71424, "7g.141gb": 143360},
}

# GPU instances the guide shows made side by side on an A100-SXM4-40GB: (profile, start) each.
A100_SIDE_BY_SIDE: tuple[tuple[tuple[str, int], ...], ...] = (
    (("3g.20gb", 0), ("3g.20gb", 4)),
    (("1g.5gb", 0), ("1g.5gb", 1), ("2g.10gb", 2), ("3g.20gb", 4)),
    (("1g.5gb", 0), ("1g.5gb", 1), ("1g.5gb", 2), ("1g.5gb", 3), ("2g.10gb", 4), ("1g.5gb", 6)),
    (("4g.20gb", 0), ("3g.20gb", 4)),
)


def fits(gpu: Gpu, placed: list[tuple[str, int]]) -> bool:
    """Whether these GPU instances (profile name, start) can exist together on one GPU, by the facts:
    each at one of its profile's placements, no memory slice shared, no profile beyond its instances,
    no more compute slices than the GPU has, no engine beyond the whole GPU's."""
    used: set[int] = set()
    count: dict[str, int] = {}
    whole = gpu.whole
    totals = [0, 0, 0, 0, 0]
    for name, start in placed:
        p = gpu.profile(name)
        if start not in p.starts:
            return False
        covers = set(range(start, start + p.memory_slices))
        if used & covers:
            return False
        used |= covers
        count[name] = count.get(name, 0) + 1
        if count[name] > p.instances:
            return False
        for i, n in enumerate((p.compute_slices, p.decoders, p.jpegs, p.ofas, p.copy_engines)):
            totals[i] += n
    limits = (gpu.compute_slices, whole.decoders, whole.jpegs, whole.ofas, whole.copy_engines)
    return all(t <= limit for t, limit in zip(totals, limits, strict=True))

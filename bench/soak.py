"""Memory and descriptors that stay flat (issue 29 §2): the agent's RSS and open file descriptors after
many prepare/unprepare cycles, against the same after the first 1,000.

The agent runs as the rest of the bench runs it (`drivers.OurAgent`: `dra-agent run --offline DIR`,
simulated GPUs), alone, in a directory of its own (on a tmpfs where there is one: what is measured is
the agent's memory, not the disk), and is called through the kubelet stand-in. A cycle is one claim
prepared and unprepared. Every claim is new (its own name and UID, its file written before the prepare
and removed after the unprepare, as a pod's claim comes and goes), so whatever the agent keeps per
claim and never drops shows as growth. Each round prepares and unprepares ten claims in three calls at
once: 4 whole GPUs, 4 shares of three shared GPUs, 2 MIG placements (each creating and destroying a GPU
and compute instance in the simulated NVML). RSS (VmRSS) and the descriptors (/proc/<pid>/fd) are read
between rounds, with nothing in flight and the claim status writes drained.

`python bench/soak.py --cycles N [--trace FRAMES]` runs it alone and prints the figures; `--trace` runs
the agent under tracemalloc and prints what grew between the two points: the allocations by line (or by
traceback), and the live objects by type.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from drivers import Claims, OurAgent, share_id_of, uid_of  # noqa: E402

from agent.kubelet import client as kc  # noqa: E402
from agent.names import ClaimRef  # noqa: E402

CYCLES = 100_000
BASELINE = 1_000  # growth is counted from here: what the first claims build once (caches, pools) is not growth
SHARE_MEMORY = "4Gi"
# (devices of each claim, a share) for each call of a round: whole GPUs, shares, MIG placements. Kinds
# that do not overlap (a GPU prepared whole is neither shared nor partitioned), 10 claims a round.
ROUND: list[list[tuple[str, bool]]] = [
    [(f"gpu-{g}", False) for g in range(4)],
    [(f"gpu-{4 + g % 3}-shared", True) for g in range(4)],
    [(f"gpu-7-mig-1g10gb-{p}", False) for p in range(2)],
]
PER_ROUND = sum(len(call) for call in ROUND)


CYCLES_HELP = (f"prepare/unprepare cycles of the memory soak: 0 (none) or a multiple of {PER_ROUND} above "
               f"{BASELINE} (default: {CYCLES})")


def cycles(text: str) -> int:
    """An argparse type: a count of cycles the soak can run, or 0."""
    count = int(text)
    if count and (count % PER_ROUND or count <= BASELINE):
        raise argparse.ArgumentTypeError(f"{count}: not 0 or a multiple of {PER_ROUND} above {BASELINE}")
    return count


def label(count: int) -> str:
    """A count as the keys name it: 100000 -> 100k, 2500 -> 2500."""
    return f"{count // 1000}k" if count % 1000 == 0 else str(count)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# The agent under tracemalloc (`--trace`), keeping argv[1] frames of each allocation: SIGUSR2 writes a
# snapshot and the live objects by type to argv[2]-<n>; the agent runs as `python -m agent` would.
TRACED = r"""
import collections, gc, json, signal, sys, tracemalloc
tracemalloc.start(int(sys.argv.pop(1)))
out, taken = sys.argv.pop(1), [0]

def dump(signum, frame):
    gc.collect()
    taken[0] += 1
    tracemalloc.take_snapshot().dump(f"{out}-{taken[0]}.trace")
    types = collections.Counter(type.__repr__(type(o))[8:-2] for o in gc.get_objects())  # <class 'm.T'>
    with open(f"{out}-{taken[0]}.types.json", "w") as f:
        json.dump(types, f)

signal.signal(signal.SIGUSR2, dump)
from agent.app.cli import main
sys.argv[0] = "dra-agent"
sys.exit(main())
"""


class Soak:
    def __init__(self, work: Path, trace: int) -> None:
        self.claims = Claims(work / "offline")
        self.status = self.claims.offline / "resourceclaimstatus"
        self.agent = OurAgent(work / "agent", self.claims.offline)
        self.trace = work / "trace" if trace else None
        if self.trace is not None:
            argv, snapshots = self.agent.argv(), str(self.trace)
            # [python, -m, agent, run, ...] -> [python, -c, TRACED, <frames>, <snapshots>, run, ...]
            self.agent.argv = lambda: [argv[0], "-c", TRACED, str(trace), snapshots, *argv[3:]]  # type: ignore[method-assign]
        self.made = 0

    def new_claims(self, call: Sequence[tuple[str, bool]]) -> list[ClaimRef]:
        refs = []
        for device, shared in call:
            self.made += 1
            i = self.made
            share = (share_id_of(i), SHARE_MEMORY) if shared else None
            refs.append(self.claims.write(f"soak-{i}", uid_of(10_000_000 + i), [device], share))
        return refs

    async def cycle(self, client: kc.DRAClient, refs: list[ClaimRef]) -> None:
        for what, call in (("prepare", client.prepare), ("unprepare", client.unprepare)):
            answer = await call(refs)
            bad = [f"{uid}: {c.error}" for uid, c in answer.claims.items() if c.error]
            if bad or len(answer.claims) != len(refs):
                raise SystemExit(f"soak: {what} failed: {bad[:1] or 'answers missing'}")
        for ref in refs:
            (self.claims.directory / f"{ref.name}.yaml").unlink()

    async def rounds(self, client: kc.DRAClient, count: int) -> None:
        for _ in range(count):
            await asyncio.gather(*(self.cycle(client, self.new_claims(call)) for call in ROUND))

    async def settled(self, pid: int) -> tuple[int, int]:
        """RSS (KiB) and open descriptors with nothing in flight: once every claim status file is gone
        (each claim's status is cleared after its unprepare, in the background), the fewest descriptors
        of a few looks (a status write or a worker's read may still hold one for a moment)."""
        for _ in range(1200):  # 60 s at most
            if not any(self.status.rglob("*.yaml")):
                break
            await asyncio.sleep(0.05)
        fds = []
        for _ in range(5):
            await asyncio.sleep(0.1)
            fds.append(open_fds(pid))
        return rss_kib(pid), min(fds)

    async def snapshot(self, pid: int, n: int) -> None:
        assert self.trace is not None
        os.kill(pid, signal.SIGUSR2)
        done = Path(f"{self.trace}-{n}.types.json")
        for _ in range(1200):
            if done.exists():
                return
            await asyncio.sleep(0.05)
        raise SystemExit(f"soak: the agent wrote no snapshot ({done})")


async def soak(work: Path, cycles: int = CYCLES, trace: int = 0) -> dict[str, Any]:
    """The figures of `cycles` (a multiple of 10, more than 1,000) cycles, counted from the first 1,000;
    `trace`: run the agent under tracemalloc keeping that many frames, and print what grew."""
    if cycles % PER_ROUND or cycles <= BASELINE:
        raise ValueError(f"cycles must be a multiple of {PER_ROUND} above {BASELINE}")
    s = Soak(work, trace)
    await s.agent.start()
    assert s.agent.proc is not None
    pid = s.agent.proc.pid
    try:
        async with kc.DRAClient(s.agent.dra_socket) as client:
            await s.rounds(client, BASELINE // PER_ROUND)
            rss_1k, fds_1k = await s.settled(pid)
            if trace:
                await s.snapshot(pid, 1)
            started = time.perf_counter()
            await s.rounds(client, (cycles - BASELINE) // PER_ROUND)
            seconds = time.perf_counter() - started
            rss_n, fds_n = await s.settled(pid)
            if trace:
                await s.snapshot(pid, 2)
                print(traced(s.trace))  # type: ignore[arg-type]
    finally:
        s.agent.kill()
    n, base = label(cycles), label(BASELINE)
    return {
        "soak_cycles": cycles,
        "soak_cycles_per_s": (cycles - BASELINE) / seconds,
        "soak_s": seconds,
        f"rss_after_{base}_cycles_mib": rss_1k / 1024,
        f"rss_after_{n}_cycles_mib": rss_n / 1024,
        f"rss_growth_{n}_cycles_mib": (rss_n - rss_1k) / 1024,
        f"fds_after_{base}_cycles": fds_1k,
        f"fds_after_{n}_cycles": fds_n,
        f"fd_growth_{n}_cycles": fds_n - fds_1k,
    }


async def run(cycles: int, trace: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`soak` in a directory of its own, removed after; `progress` is told what it does."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    work = Path(tempfile.mkdtemp(prefix="drasoak-", dir=shm or "/tmp"))
    if progress is not None:
        progress(f"soak: {cycles} prepare/unprepare cycles, the agent alone, in {work}")
    try:
        return await soak(work, cycles, trace)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def traced(prefix: Path, top: int = 12) -> str:
    """What grew between the two snapshots: allocations by line (by traceback, the innermost frame last,
    when more than one frame was kept), and live objects by type."""
    import tracemalloc

    first, last = (tracemalloc.Snapshot.load(f"{prefix}-{n}.trace") for n in (1, 2))
    by = "traceback" if last.traceback_limit > 1 else "lineno"
    lines = [f"allocations that grew (by {by}):"]
    for stat in last.compare_to(first, by)[:top]:
        lines.append(f"  {stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks "
                     f"(now {stat.size / 1024:.1f} KiB)")
        lines += [f"    {line}" for line in stat.traceback.format(most_recent_first=False)]
    before, after = (collections.Counter(json.loads(Path(f"{prefix}-{n}.types.json").read_text()))
                     for n in (1, 2))
    grew = sorted(((after[k] - before[k], k) for k in after if after[k] > before[k]), reverse=True)[:top]
    lines.append("live objects that grew (by type):")
    lines += [f"  +{d} {k} (now {after[k]})" for d, k in grew]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=cycles, default=CYCLES, help=CYCLES_HELP)
    p.add_argument("--trace", type=int, default=0, metavar="FRAMES",
                   help="run the agent under tracemalloc, keeping FRAMES frames an allocation, and print what grew "
                   "(by line, or by traceback with more than one frame)")
    args = p.parse_args()
    if not args.cycles:
        return 0
    results = asyncio.run(run(args.cycles, args.trace))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

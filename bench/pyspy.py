"""Where the agent spends its time with 16 calls in flight, by py-spy (install it into the venv:
`.venv/bin/pip install py-spy`).

Starts the agent as `make bench` does, with its directories on the disk under /tmp, and keeps 16
one-claim NodePrepareResources calls in flight (then their 16 unprepares, and again) while py-spy
samples it twice: with --gil (only the thread holding the GIL: what the calls fight over), then
with --idle (every thread, waiting or not). First, unsampled, each thread's CPU time per claim
(from /proc), one call at a time and then with the calls in flight. Both profiles are written as
collapsed stacks, one per thread (`--threads`), under .bench/profile/, and summed up: each group of
threads' share of the samples, and the functions most often at the top of the stack.

    .venv/bin/python bench/pyspy.py [--seconds 20] [--in-flight 16] [--native] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from drivers import Claims, OurAgent, uid_of  # noqa: E402
from measure import Side, prepare, unprepare  # noqa: E402

from agent.kubelet import client as kc  # noqa: E402

_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-f]+\)(?:: ([^;]*))?")


async def drive(side: Side, claims: Claims, in_flight: int, seconds: float) -> float:
    """Claims prepared per second while `in_flight` calls are kept going for `seconds`."""
    refs = [claims.write(f"conc-{i}", uid_of(200 + i), [f"gpu-{i % 8}"]) for i in range(in_flight)]
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        await asyncio.gather(*(prepare(side, [r]) for r in refs))
        await asyncio.gather(*(unprepare(side, [r]) for r in refs))
        done += len(refs)
    return done / (time.perf_counter() - started)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far, in user space and in the kernel (system calls, and the futex waits of threads
    handing the GIL to each other): the main thread (the event loop), the other Python threads (the
    workers among them; the kernel knows them all as `python`) and gRPC's own threads."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended
        group = ("main thread (event loop)" if task.name == str(pid)
                 else "other Python threads" if name == "python" else f"{name} threads")
        out[f"{group}, user"] += int(fields[11]) / tick
        out[f"{group}, kernel"] += int(fields[12]) / tick
    return dict(out)


async def cpu_per_claim(side: Side, claims: Claims, pid: int, in_flight: int, seconds: float) -> str:
    """Each group of threads' CPU time per claim (prepare + unprepare), from /proc: what py-spy's
    sampling does not disturb."""
    before, started = thread_cpu(pid), time.perf_counter()
    rate = await drive(side, claims, in_flight, seconds)
    after, wall = thread_cpu(pid), time.perf_counter() - started
    count = rate * wall
    lines = [f"CPU per claim (prepare + unprepare) by thread, {rate:.0f} claims/s, {in_flight} in flight, "
             f"{wall:.0f} s; the process used {sum(after.values()) - sum(before.values()):.1f} CPU s:"]
    for group in sorted(after, key=lambda g: before.get(g, 0.0) - after[g]):
        used = after[group] - before.get(group, 0.0)
        if used > 0:
            lines.append(f"    {used / count * 1000:7.3f} ms  {group}")
    return "\n".join(lines)


def summary(collapsed: Path, title: str, top: int = 20) -> str:
    """Each group of threads' share of the samples (threads named alike, e.g. the dra-io workers, as
    one) with its leaf functions, then the leaf functions (file:function) and the functions anywhere
    on the stack, by share of all samples."""
    groups: collections.Counter[str] = collections.Counter()
    members: dict[str, set[str]] = collections.defaultdict(set)
    group_leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        m = _THREAD.match(stack)
        name = (m.group(1) or "?") if m else "?"
        group = re.sub(r"[_-]\d+$", "", name)
        members[group].add(name)
        frames = [f for f in stack.split(";")[1 if m else 0:] if not f.startswith("process ")]
        leaf = _short(frames[-1]) if frames else "(no Python frame)"
        groups[group] += count
        group_leaves[group][leaf] += count
        leaves[leaf] += count
        for f in {_short(f) for f in frames}:
            inclusive[f] += count
    if not total:
        return f"{title}: no samples"
    out = [f"{title}: {total} samples", "  threads (share of all samples; within it, its leaf functions):"]
    for group, n in groups.most_common():
        if n / total < 0.005:
            continue
        out.append(f"    {n / total:6.1%}  {group} ({len(members[group])} threads)")
        out += [f"             {c / n:6.1%}  {leaf}" for leaf, c in group_leaves[group].most_common(8) if c / n >= 0.01]
    out.append("  leaf functions (self):")
    out += [f"    {n / total:6.1%}  {name}" for name, n in leaves.most_common(top)]
    out.append("  functions on the stack (inclusive):")
    out += [f"    {n / total:6.1%}  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(out)


def _short(frame: str) -> str:
    """`function (path/to/file.py:12)` -> `file.py:function`, the line dropped so lines sum up."""
    m = re.match(r"^(.*) \((.*?):\d+\)$", frame)
    if not m:
        return frame
    function, path = m.groups()
    parts = Path(path).parts
    where = "/".join(parts[parts.index("agent"):]) if "agent" in parts else Path(path).name
    return f"{where}:{function}"


async def main_async(args: argparse.Namespace) -> int:
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="drap-", dir=args.dir))
    claims = Claims(work / "offline")
    agent = OurAgent(work / "agent", claims.offline)
    try:
        await agent.start()
        assert agent.proc is not None
        async with kc.DRAClient(agent.dra_socket) as client:
            side = Side("ours", agent, client)
            await drive(side, claims, args.in_flight, 2.0)  # warm
            reports = [await cpu_per_claim(side, claims, agent.proc.pid, n, args.seconds // 2)
                       for n in (1, args.in_flight)]
            for name, flags in (("gil", ["--gil"]), ("idle", ["--idle"])):
                target = args.out / f"{name}.txt"
                # C frames are unwound only while the process is paused: --native samples in blocking
                # mode, which slows the agent down; without it the agent runs on while sampled.
                mode = ["--native"] if args.native else ["--nonblocking"]
                errors = args.out / f"{name}.err"
                with errors.open("wb") as err:
                    spy = subprocess.Popen([py_spy, "record", "--pid", str(agent.proc.pid), "--threads", *flags,
                                            *mode, "--rate", str(args.rate), "--format", "raw",
                                            "--duration", str(args.seconds), "--output", str(target)],
                                           stdout=subprocess.DEVNULL, stderr=err)
                    rate = await drive(side, claims, args.in_flight, args.seconds)
                    if await asyncio.to_thread(spy.wait) != 0:
                        raise SystemExit(f"py-spy failed:\n{errors.read_text()}")
                reports.append(summary(target, f"py-spy {' '.join(flags)} ({rate:.0f} claims/s, "
                                               f"{args.in_flight} in flight)"))
        agent.stop()
    finally:
        agent.kill()
        shutil.rmtree(work, ignore_errors=True)
    print("\n\n".join(reports))
    print(f"\ncollapsed stacks in {args.out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=int, default=20, help="seconds per profile (default: 20)")
    p.add_argument("--in-flight", type=int, default=16, help="calls in flight (default: 16)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples a second (default: 250)")
    p.add_argument("--native", action="store_true",
                   help="also sample C frames (gRPC's core, the interpreter): where the event loop's callbacks go")
    p.add_argument("--out", type=Path, default=ROOT / ".bench" / "profile")
    p.add_argument("--dir", default="/tmp", help="where the agent's directories are (default: /tmp, the disk; "
                   "/dev/shm: a tmpfs, no fsync cost)")
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())

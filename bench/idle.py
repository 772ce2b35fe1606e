"""Idle cost: what the agent costs a node while it has nothing to do, with the simulated dgx-h100's
devices published (the bench's flags) and 1,000 claims prepared.

The agent runs as the other figures' (bench/drivers.py), but with its own default rescan interval (the
other figures pass --rescan-interval 3600 so that no rescan lands in a timing): what runs while it idles
is what runs on a node. Once the claims are prepared and their status written, nothing is asked of it
for `seconds` (300 by default, `--idle-seconds`); the kubelet stand-in keeps its connection open
meanwhile, as a kubelet does. Read from /proc, never by waking the agent:

- `idle_cpu_percent`: the process's CPU seconds (user + system, every thread's, /proc/<pid>/stat) over
  the interval, as a percent of one core;
- `idle_wakeups_per_s`: context switches (voluntary and not) of all its threads
  (/proc/<pid>/task/*/status), a second; each thread read every second, so one that ends meanwhile
  loses at most a second of its count;
- `idle_devices`: the devices of the slices it published; `idle_seconds`: the interval.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from drivers import NAMESPACE, Claims, OurAgent, uid_of
from measure import Side, fill

from agent.kubelet import client as kc

CLAIMS = 1_000
SETTLE = 5.0  # seconds after the claims' status is written, before the interval begins


class IdleAgent(OurAgent):
    def argv(self) -> list[str]:
        argv = super().argv()
        at = argv.index("--rescan-interval")
        return argv[:at] + argv[at + 2:]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def switches(pid: int) -> dict[str, int]:
    """Each thread's context switches so far."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            lines = (task / "status").read_text().splitlines()
        except OSError:
            continue  # ended meanwhile
        out[task.name] = sum(int(line.split()[1]) for line in lines
                             if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
    return out


def published_devices(offline: Path) -> int:
    return sum(len(yaml.safe_load(path.read_text())["spec"].get("devices") or [])
               for path in (offline / "resourceslices").glob("*.yaml"))


async def status_written(offline: Path, count: int, limit: float = 600.0) -> None:
    directory = offline / "resourceclaimstatus" / NAMESPACE
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if directory.is_dir() and len(os.listdir(directory)) >= count:
            return
        await asyncio.sleep(0.2)


async def measure(r: dict[str, Any], seconds: float) -> None:
    work = Path(tempfile.mkdtemp(prefix="drab-idle-", dir="/tmp"))  # short: unix socket paths
    claims = Claims(work / "offline")
    agent = IdleAgent(work / "agent", claims.offline)
    try:
        await agent.start()
        assert agent.proc is not None
        pid = agent.proc.pid
        refs = [claims.write(f"idle-{i}", uid_of(700_000 + i), [f"gpu-{i % 8}"]) for i in range(CLAIMS)]
        async with kc.DRAClient(agent.dra_socket) as client:
            await fill(Side("ours", agent, client), refs)
            await status_written(claims.offline, CLAIMS)
            await asyncio.sleep(SETTLE)
            seen, counted = switches(pid), 0
            cpu, started = cpu_seconds(pid), time.monotonic()
            while (left := started + seconds - time.monotonic()) > 0:
                await asyncio.sleep(min(1.0, left))
                now = switches(pid)
                counted += sum(n - seen.get(tid, 0) for tid, n in now.items())
                seen = now
            elapsed = time.monotonic() - started
            r["idle_cpu_percent"] = 100 * (cpu_seconds(pid) - cpu) / elapsed
        r["idle_wakeups_per_s"] = counted / elapsed
        r["idle_seconds"] = elapsed
        r["idle_devices"] = published_devices(claims.offline)
        agent.stop()
    finally:
        agent.kill()
        shutil.rmtree(work, ignore_errors=True)

"""A slow device never delays the rest: 110 one-claim NodePrepareResources calls at once (the node
fill's burst, bench.py), 8 of them passthrough GPU claims whose unbind from the GPU's driver the
simulated kernel holds 2 s (`DRA_SIM_UNBIND_DELAY`, agent/sim/kernel/emulator.py), the other 102
shares of other GPUs. The figure: the p99 latency of those 102 prepares over their p99 in the same
burst with no unbind held, rounds of each taken in turn, the agent restarted between them.

The simulated hgx-16 (16 GPUs): the 8 passthrough claims take GPUs 0 to 7, the 102 shares are of
GPUs 8 to 15. A share of a GPU that is being passed through rightly waits for it (the GPU's lock), and
the dgx-h100 of the other figures has 8 GPUs only.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from drivers import Claims, OurAgent, share_id_of, uid_of
from measure import Side, prepare, unprepare
from probes import pct

from agent.kubelet import client as kc
from agent.names import ClaimRef
from agent.sim.kernel.emulator import UNBIND_DELAY_ENV

ROOT = Path(__file__).resolve().parents[1]
IN_FLIGHT = 110  # the kubelet's default pod limit, as the node fill
SLOW = 8  # passthrough GPU claims among them
UNBIND_SECONDS = 2.0
SHARE_MEMORY = "4Gi"  # 13 shares a GPU of 80 GiB at most


class SixteenGpuAgent(OurAgent):
    """The bench's agent on the simulated hgx-16, its kernel's unbinds held `unbind_delay` seconds."""

    unbind_delay = 0.0

    def flags(self) -> list[str]:
        return ["sim:hgx-16" if flag == "sim" else flag for flag in super().flags()]

    def argv(self) -> list[str]:
        argv = super().argv()
        return ["env", f"{UNBIND_DELAY_ENV}={self.unbind_delay:g}", *argv] if self.unbind_delay else argv


def split_gpus(agent: OurAgent) -> tuple[list[str], list[str]]:
    """The passthrough devices of GPUs 0 to SLOW-1, and the shared devices of the others."""
    out = subprocess.run([sys.executable, "-m", "agent", "devices", *agent.flags(), "-o", "json"], cwd=ROOT,
                         check=True, capture_output=True).stdout
    devices = {d["name"]: d.get("attributes", {}) for d in orjson.loads(out)}

    def bus(name: str) -> str:
        return str(devices[name]["resource.kubernetes.io/pciBusID"]["string"])

    gpus = sorted((int(n[4:]), n) for n in devices if n.startswith("gpu-") and n[4:].isdigit())
    slow_buses = {bus(n) for _, n in gpus[:SLOW]}
    vfio = sorted(n for n in devices if n.startswith("gpu-") and n.endswith("-vfio") and bus(n) in slow_buses)
    shared = [f"{n}-shared" for _, n in gpus[SLOW:]]
    assert len(vfio) == SLOW and shared, (vfio, shared)
    return vfio, shared


async def burst(side: Side, slow: list[ClaimRef], others: list[ClaimRef]) -> tuple[list[float], list[float]]:
    """Every claim's prepare called at once, the slow ones first (they would take any worker first);
    milliseconds each took (slow, others). Then all unprepared, untimed."""
    started = time.perf_counter()

    async def one(ref: ClaimRef) -> float:
        await prepare(side, [ref])
        return (time.perf_counter() - started) * 1000

    times = await asyncio.gather(*(one(ref) for ref in slow + others))
    await asyncio.gather(*(unprepare(side, [ref]) for ref in slow + others))
    return list(times[:len(slow)]), list(times[len(slow):])


async def measure(r: dict[str, Any], rounds: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="drab-slow-", dir="/tmp"))  # short: unix socket paths
    claims = Claims(work / "offline")
    agent = SixteenGpuAgent(work / "agent", claims.offline)
    try:
        vfio, shared = split_gpus(agent)
        slow = [claims.write(f"vm-{i}", uid_of(500 + i), [d]) for i, d in enumerate(vfio)]
        others = [claims.write(f"share-{i}", uid_of(600 + i), [shared[i % len(shared)]],
                               (share_id_of(600 + i), SHARE_MEMORY)) for i in range(IN_FLIGHT - SLOW)]
        samples: dict[float, tuple[list[float], list[float]]] = {0.0: ([], []), UNBIND_SECONDS: ([], [])}
        for i in range(rounds):
            for delay in (0.0, UNBIND_SECONDS) if i % 2 == 0 else (UNBIND_SECONDS, 0.0):
                agent.unbind_delay = delay
                await agent.start()
                try:
                    async with kc.DRAClient(agent.dra_socket) as client:
                        side = Side("ours", agent, client)
                        await burst(side, slow, others)  # warm-up: the claims read once
                        times = await burst(side, slow, others)
                finally:
                    agent.stop()
                samples[delay][0].extend(times[0])
                samples[delay][1].extend(times[1])
    finally:
        agent.kill()
        shutil.rmtree(work, ignore_errors=True)
    held, base = samples[UNBIND_SECONDS], samples[0.0]
    r["slow_device_others_p99_ms"] = pct(held[1], 99)
    r["slow_device_others_baseline_p99_ms"] = pct(base[1], 99)
    r["slow_device_p99_ratio"] = r["slow_device_others_p99_ms"] / r["slow_device_others_baseline_p99_ms"]
    r["slow_device_passthrough_p50_ms"] = statistics.median(held[0])

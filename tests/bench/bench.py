"""`make bench`: prepare/unprepare latency over the real DRA socket, against a floor measured in
the same run, plus concurrency, scaling with prepared claims, start-up time and memory.

The agent runs as its own process (`dra-agent run --offline`, simulated GPUs), exactly as
`make run` starts it; this process is the kubelet. Figures are printed as a table and written
to .bench/results.json (milliseconds unless the key says otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent import kubelet_client as kc  # noqa: E402
from agent.config import build_settings  # noqa: E402
from agent.inventory.nics import NicSource  # noqa: E402
from agent.names import ClaimRef  # noqa: E402

DRIVER = "dra.example.com"
NODE = "bench-node"

FLOOR_SERVER = r"""
import asyncio, os, sys
import grpc
sys.path.insert(0, sys.argv[3])
from agent.fsutil import atomic_write
from pathlib import Path

async def main(sock, directory):
    target = Path(directory) / "floor.rec"
    payload = b"x" * 512

    def ping(request, context):
        atomic_write(target, payload, mode=0o600, durable=True)
        return b""

    async def handler(request, context):
        return await asyncio.to_thread(ping, request, context)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Floor", {"Ping": grpc.unary_unary_rpc_method_handler(handler)})])
    server.add_insecure_port("unix://" + sock)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def pct(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await fn()
    return (time.perf_counter() - started) * 1000


def claim_doc(name: str, uid: str, devices: list[str], request: str = "req") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "bench", "uid": uid},
        "status": {"allocation": {"devices": {"results": [
            {"request": request, "driver": DRIVER, "pool": NODE, "device": d} for d in devices]}}},
    }


def uid_of(i: int) -> str:
    return f"b0000000-0000-4000-8000-{i:012d}"


class Bench:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.settings = build_settings({
            "driver_name": DRIVER, "node_name": NODE, "kubelet_dir": work / "k", "cdi_dir": work / "cdi",
            "static_cdi_dir": work / "cdi-static", "state_dir": work / "state", "offline": work / "offline",
            "nvml": "sim"})
        self.claims_dir = work / "offline" / "resourceclaims" / "bench"
        self.claims_dir.mkdir(parents=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.results: dict[str, Any] = {}
        self.floor_samples: list[float] = []

    def write_claim(self, name: str, uid: str, devices: list[str]) -> ClaimRef:
        (self.claims_dir / f"{name}.yaml").write_text(yaml.safe_dump(claim_doc(name, uid, devices)))
        return ClaimRef("bench", name, uid)

    # -- processes -------------------------------------------------------------------------------

    async def start_agent(self, log: Path) -> float:
        s = self.settings
        argv = [sys.executable, "-m", "agent", "run", "--driver-name", DRIVER, "--node-name", NODE,
                "--nvml", "sim", "--kubelet-dir", str(s.kubelet_dir), "--cdi-dir", str(s.cdi_dir),
                "--static-cdi-dir", str(s.static_cdi_dir), "--state-dir", str(s.state_dir),
                "--offline", str(s.offline), "--log-format", "json", "--rescan-interval", "3600"]
        started = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("ab"))
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the agent exited ({self.proc.returncode}); see {log}")
            try:
                await kc.get_info(s.registration_socket, timeout=1.0)
                return time.perf_counter() - started
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.002)

    def stop_agent(self) -> int:
        assert self.proc is not None
        rss = 0
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) // 1024
        self.proc.terminate()
        self.proc.wait(timeout=30)
        return rss

    def start_floor(self) -> Callable[[], Awaitable[Any]]:
        """The floor: an empty unary gRPC call over a unix socket to a server that does one atomic,
        fsync'd file write in a worker thread, on the same file system as the agent's state."""
        sock = self.work / "floor.sock"
        self.floor_proc = subprocess.Popen(
            [sys.executable, "-c", FLOOR_SERVER, str(sock), str(self.work), str(ROOT)], stdout=subprocess.PIPE)
        assert self.floor_proc.stdout is not None and self.floor_proc.stdout.readline().strip() == b"ready"
        self.floor_channel = grpc.aio.insecure_channel(f"unix://{sock}")
        call = self.floor_channel.unary_unary("/bench.Floor/Ping")
        return lambda: call(b"")

    # -- measurements ------------------------------------------------------------------------------

    async def round_trips(self, client: kc.DRAClient, ref: ClaimRef, n: int) -> tuple[list[float], list[float]]:
        """Prepare + unprepare `n` times; a floor call between round trips keeps the floor's samples
        taken under the same machine conditions as the agent's."""
        prep, unprep = [], []

        async def prepare() -> None:
            r = await client.prepare([ref])
            if r.claims[ref.uid].error:
                raise SystemExit(f"prepare failed: {r.claims[ref.uid].error}")

        for _ in range(10):
            await prepare()
            await client.unprepare([ref])
        for _ in range(n):
            self.floor_samples.append(await timed(self.floor_call))
            prep.append(await timed(prepare))
            unprep.append(await timed(lambda: client.unprepare([ref])))
        return prep, unprep

    async def fill(self, client: kc.DRAClient, start: int, count: int) -> None:
        refs = [self.write_claim(f"fill-{i}", uid_of(100_000 + i), [f"gpu-{i % 8}"]) for i in range(start, count)]
        for i in range(0, len(refs), 64):
            batch = refs[i:i + 64]
            r = await client.prepare(batch)
            bad = [c.error for c in r.claims.values() if c.error]
            if bad:
                raise SystemExit(f"fill failed: {bad[0]}")

    async def concurrency(self, client: kc.DRAClient) -> float:
        refs = [self.write_claim(f"conc-{i}", uid_of(200 + i), [f"gpu-{i % 8}"]) for i in range(16)]

        async def one(ref: ClaimRef) -> None:
            await client.prepare([ref])

        async def unprepare_all() -> None:
            await asyncio.gather(*(client.unprepare([r]) for r in refs))

        seq, conc = [], []
        for _ in range(5):
            t = time.perf_counter()
            for ref in refs:
                await one(ref)
            seq.append(time.perf_counter() - t)
            await unprepare_all()
            t = time.perf_counter()
            await asyncio.gather(*(one(r) for r in refs))
            conc.append(time.perf_counter() - t)
            await unprepare_all()
        return statistics.median(seq) / statistics.median(conc)

    async def run(self, n: int, fill_to: int) -> dict[str, Any]:
        r = self.results
        self.floor_call = self.start_floor()
        for _ in range(20):
            await self.floor_call()
        log = self.work / "agent.log"
        r["startup_to_getinfo_s"] = await self.start_agent(log)
        nic = await asyncio.to_thread(first_nic)
        one = self.write_claim("one-gpu", uid_of(1), ["gpu-0"])
        eight = self.write_claim("eight-gpus", uid_of(8), [f"gpu-{i}" for i in range(8)])
        async with kc.DRAClient(self.settings.dra_socket) as client:
            prep, unprep = await self.round_trips(client, one, n)
            r["floor_p50_ms"], r["floor_p99_ms"] = pct(self.floor_samples, 50), pct(self.floor_samples, 99)
            r["prepare_1gpu_p50_ms"], r["prepare_1gpu_p99_ms"] = pct(prep, 50), pct(prep, 99)
            r["unprepare_1gpu_p50_ms"] = pct(unprep, 50)
            prep, _ = await self.round_trips(client, eight, n // 2)
            r["prepare_8gpu_p50_ms"], r["prepare_8gpu_p99_ms"] = pct(prep, 50), pct(prep, 99)
            if nic:
                prep, _ = await self.round_trips(client, self.write_claim("nic", uid_of(3), [nic]), n)
                r["prepare_nic_p50_ms"], r["prepare_nic_p99_ms"] = pct(prep, 50), pct(prep, 99)
            else:
                r["prepare_nic_p50_ms"] = None
            r["concurrent16_speedup"] = await self.concurrency(client)
            await self.fill(client, 0, 10)
            prep, _ = await self.round_trips(client, one, n)
            r["p50_at_10_claims_ms"] = pct(prep, 50)
            started = time.perf_counter()
            await self.fill(client, 10, fill_to)
            r["fill_claims_per_s"] = (fill_to - 10) / (time.perf_counter() - started)
            prep, _ = await self.round_trips(client, one, n)
            r[f"p50_at_{fill_to}_claims_ms"] = pct(prep, 50)
        r["rss_mib"] = self.stop_agent()
        r["agent_side_prepare_1gpu_p50_ms"] = agent_side_p50(log, "bench/one-gpu")
        await self.floor_channel.close()
        self.floor_proc.terminate()
        self.floor_proc.wait()
        # Restart with every claim prepared: recovery reads and checks all records first.
        r[f"startup_to_getinfo_with_{fill_to}_claims_s"] = await self.start_agent(log)
        self.stop_agent()
        r["prepare_1gpu_vs_floor"] = r["prepare_1gpu_p50_ms"] / r["floor_p50_ms"]
        r[f"p50_{fill_to}_vs_10_claims"] = r[f"p50_at_{fill_to}_claims_ms"] / r["p50_at_10_claims_ms"]
        r["samples_per_figure"] = n
        return r


def agent_side_p50(log: Path, claim: str) -> float | None:
    """The agent's own view of one claim's prepares: the duration in its log line per prepare."""
    samples = []
    for line in log.read_bytes().splitlines():
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if entry.get("msg", "").startswith("prepared ") and entry.get("claim") == claim:
            samples.append(float(entry["ms"]))
    return pct(samples, 50) if samples else None


def first_nic() -> str | None:
    source = NicSource(build_settings({}))
    source.open()
    try:
        devices = source.scan().devices
    finally:
        source.close()
    return min((d.name for d in devices), default=None)


def show(results: dict[str, Any]) -> str:
    width = max(len(k) for k in results)
    lines = []
    for key, value in results.items():
        text = "n/a" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))
        lines.append(f"{key.ljust(width)}  {text}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--samples", type=int, default=300, help="round trips per figure")
    p.add_argument("--fill", type=int, default=10_000, help="claims prepared before the last figure")
    p.add_argument("--out", type=Path, default=ROOT / ".bench" / "results.json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="drab-", dir="/tmp"))  # short: unix socket paths
    try:
        results = asyncio.run(Bench(work).run(args.samples, args.fill))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(show(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"\nwritten to {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

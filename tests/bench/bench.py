"""`make bench`: prepare/unprepare latency over the real DRA socket, against floors measured in
the same run, plus concurrency, scaling with prepared claims, start-up time, memory and the CLI.

The agent runs as its own process (`dra-agent run --offline`, simulated GPUs), exactly as
`make run` starts it; this process is the kubelet. Two runs: one with every directory on the
disk under /tmp (fsync costs what the disk makes it cost), one on a tmpfs (/dev/shm: no fsync
cost, so what remains is the agent's own time). Figures are printed as a table and written to
.bench/results.json (milliseconds unless the key says otherwise).
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
from pathlib import Path
from typing import Any

import grpc
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "bench")]

from probes import Call, Floor, pct, rss_mib, run_seconds, timed  # noqa: E402

from agent.config import build_settings  # noqa: E402
from agent.inventory.nics import NicSource  # noqa: E402
from agent.kubelet import client as kc  # noqa: E402
from agent.names import ClaimRef  # noqa: E402

DRIVER = "dra.example.com"
NODE = "bench-node"
MIG_DEVICE = "gpu-0-mig-1g10gb-0"  # the smallest GPU instance on the simulated H100 (--dynamic-mig is on)


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
    """One agent's work directory, the agent process, and the floor server beside it."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.settings = build_settings({
            "driver_name": DRIVER, "node_name": NODE, "kubelet_dir": work / "k", "cdi_dir": work / "cdi",
            "static_cdi_dir": work / "cdi-static", "state_dir": work / "state", "offline": work / "offline",
            "nvml": "sim"})
        self.claims_dir = work / "offline" / "resourceclaims" / "bench"
        self.claims_dir.mkdir(parents=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = work / "agent.log"
        self.floor = Floor(work, ROOT)

    def write_claim(self, name: str, uid: str, devices: list[str]) -> ClaimRef:
        (self.claims_dir / f"{name}.yaml").write_text(yaml.safe_dump(claim_doc(name, uid, devices)))
        return ClaimRef("bench", name, uid)

    def flags(self) -> list[str]:
        s = self.settings
        return ["--driver-name", DRIVER, "--node-name", NODE, "--nvml", "sim", "--kubelet-dir", str(s.kubelet_dir),
                "--cdi-dir", str(s.cdi_dir), "--static-cdi-dir", str(s.static_cdi_dir),
                "--state-dir", str(s.state_dir), "--offline", str(s.offline)]

    # -- processes -------------------------------------------------------------------------------

    async def start_agent(self) -> tuple[float, float]:
        """Start the agent; seconds until GetInfo is answered, and until the DRA socket answers an
        empty NodePrepareResources."""
        argv = [sys.executable, "-m", "agent", "run", *self.flags(), "--log-format", "json",
                "--rescan-interval", "3600", "--metrics-address", ""]
        s = self.settings
        started = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log.open("ab"))
        info = dra = 0.0
        while not (info and dra):
            if self.proc.poll() is not None:
                raise SystemExit(f"the agent exited ({self.proc.returncode}); see {self.log}")
            # A call only once the socket exists: a call to a missing socket puts gRPC's (shared)
            # subchannel into its reconnect backoff, and the next calls would measure that backoff.
            if not info and s.registration_socket.exists():
                info = await _answered(lambda: kc.get_info(s.registration_socket, timeout=1.0), started)
            if not dra and s.dra_socket.exists():
                dra = await _answered(lambda: kc.empty_prepare(s.dra_socket, timeout=1.0), started)
            if not (info and dra):
                await asyncio.sleep(0.002)
        return info, dra

    def stop_agent(self) -> int:
        """Stop the agent; its RSS (MiB) just before."""
        assert self.proc is not None
        rss = rss_mib(self.proc.pid)
        self.proc.terminate()
        self.proc.wait(timeout=60)
        return rss

    # -- measurements ------------------------------------------------------------------------------

    async def round_trips(self, client: kc.DRAClient, ref: ClaimRef, n: int,
                          probes: dict[str, list[float]] | None = None) -> tuple[list[float], list[float]]:
        """Prepare + unprepare `n` times; calls to the floor server between round trips keep the
        floors' samples taken under the same machine conditions as the agent's."""
        prep, unprep = [], []
        calls: dict[str, Call] = {"ping": self.floor.ping, "empty": self.floor.empty}

        async def prepare() -> None:
            r = await client.prepare([ref])
            if r.claims[ref.uid].error:
                raise SystemExit(f"prepare failed: {r.claims[ref.uid].error}")

        for _ in range(10):
            await prepare()
            await client.unprepare([ref])
        for _ in range(n):
            for name, samples in (probes or {}).items():
                samples.append(await timed(calls[name]))
            prep.append(await timed(prepare))
            unprep.append(await timed(lambda: client.unprepare([ref])))
        return prep, unprep

    async def mig_figures(self, client: kc.DRAClient, n: int, r: dict[str, Any],
                          probes: dict[str, list[float]] | None = None) -> None:
        """Prepare + unprepare of one 1g MIG placement, as the 1-GPU figure: each prepare turns the GPU's
        MIG mode on and creates the GPU and compute instance in the simulated NVML (which writes its state
        durably after each change, as the hardware keeps it), each unprepare destroys them and turns MIG
        mode off; each step is recorded first, so a MIG prepare writes its record several times."""
        mig = self.write_claim("one-mig", uid_of(9), [MIG_DEVICE])
        prep, unprep = await self.round_trips(client, mig, n, probes)
        r["prepare_mig_p50_ms"], r["prepare_mig_p99_ms"] = pct(prep, 50), pct(prep, 99)
        r["unprepare_mig_p50_ms"] = pct(unprep, 50)

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

    async def status_written(self, count: int, limit: float = 600.0) -> float:
        """Seconds until the offline status directory holds `count` claims' status files."""
        directory = self.work / "offline" / "resourceclaimstatus" / "bench"
        started = time.perf_counter()
        while time.perf_counter() - started < limit:
            if directory.is_dir() and len(os.listdir(directory)) >= count:
                break
            await asyncio.sleep(0.1)
        return time.perf_counter() - started

    def cli_seconds(self, *command: str) -> float:
        return run_seconds([sys.executable, "-m", "agent", *command, *self.flags()], ROOT)

    async def close(self) -> None:
        await self.floor.close()


async def _answered(call: Call, started: float) -> float:
    """Seconds since `started` if the call is answered now, else 0."""
    try:
        await call()
    except grpc.aio.AioRpcError:
        return 0.0
    return time.perf_counter() - started


async def on_disk(work: Path, n: int, fill_to: int, r: dict[str, Any]) -> None:
    b = Bench(work)
    try:
        for _ in range(20):
            await b.floor.ping()
        r["startup_to_getinfo_s"], r["startup_to_dra_ready_s"] = await b.start_agent()
        await asyncio.sleep(1.0)  # the start-up's background work settles
        assert b.proc is not None
        r["rss_idle_mib"] = rss_mib(b.proc.pid)
        r["cli_info_s"] = b.cli_seconds("kubelet", "info")
        nic = await asyncio.to_thread(first_nic)
        one = b.write_claim("one-gpu", uid_of(1), ["gpu-0"])
        eight = b.write_claim("eight-gpus", uid_of(8), [f"gpu-{i}" for i in range(8)])
        async with kc.DRAClient(b.settings.dra_socket) as client:
            floor: list[float] = []
            prep, unprep = await b.round_trips(client, one, n, {"ping": floor})
            r["prepare_1gpu_p50_ms"], r["prepare_1gpu_p99_ms"] = pct(prep, 50), pct(prep, 99)
            r["unprepare_1gpu_p50_ms"] = pct(unprep, 50)
            prep, _ = await b.round_trips(client, eight, n // 2, {"ping": floor})
            r["prepare_8gpu_p50_ms"], r["prepare_8gpu_p99_ms"] = pct(prep, 50), pct(prep, 99)
            await b.mig_figures(client, n, r, {"ping": floor})
            if nic:
                prep, _ = await b.round_trips(client, b.write_claim("nic", uid_of(3), [nic]), n, {"ping": floor})
                r["prepare_nic_p50_ms"], r["prepare_nic_p99_ms"] = pct(prep, 50), pct(prep, 99)
            else:
                r["prepare_nic_p50_ms"] = None
            r["floor_p50_ms"], r["floor_p99_ms"] = pct(floor, 50), pct(floor, 99)
            r["concurrent16_speedup"] = await b.concurrency(client)
            await b.fill(client, 0, 10)
            prep, _ = await b.round_trips(client, one, n)
            r["p50_at_10_claims_ms"] = pct(prep, 50)
            r["cli_claims_s"] = b.cli_seconds("claims")
            started = time.perf_counter()
            await b.fill(client, 10, fill_to)
            r["fill_claims_per_s"] = (fill_to - 10) / (time.perf_counter() - started)
            # The claim status writes of the fill trail it in the background (offline: a file per
            # claim); measured before they are done, the p50 below would time that backlog.
            r["claim_status_backlog_after_fill_s"] = await b.status_written(fill_to)
            prep, _ = await b.round_trips(client, one, n)
            r[f"p50_at_{fill_to}_claims_ms"] = pct(prep, 50)
        r["rss_mib"] = r[f"rss_{fill_to}_mib"] = b.stop_agent()
        r["agent_side_prepare_1gpu_p50_ms"] = agent_side_p50(b.log, "bench/one-gpu")
        # Restart with every claim prepared: recovery reads and checks all records first.
        info, dra = await b.start_agent()
        r[f"startup_to_getinfo_with_{fill_to}_claims_s"] = info
        r[f"startup_to_dra_ready_with_{fill_to}_claims_s"] = dra
        async with kc.DRAClient(b.settings.dra_socket) as client:  # served while records are checked
            r[f"first_prepare_after_start_with_{fill_to}_claims_ms"] = await timed(lambda: client.prepare([one]))
        b.stop_agent()
    finally:
        if b.proc is not None and b.proc.poll() is None:
            b.proc.kill()
        await b.close()


async def on_tmpfs(work: Path, n: int, r: dict[str, Any]) -> None:
    """The agent's own time per prepare: the same round trips with every directory on a tmpfs,
    against an empty call over the same kind of socket."""
    b = Bench(work)
    try:
        for _ in range(20):
            await b.floor.empty()
        await b.start_agent()
        one = b.write_claim("one-gpu", uid_of(1), ["gpu-0"])
        async with kc.DRAClient(b.settings.dra_socket) as client:
            empty: list[float] = []
            floor: list[float] = []
            prep, unprep = await b.round_trips(client, one, n, {"empty": empty, "ping": floor})
        r["prepare_1gpu_tmpfs_p50_ms"], r["unprepare_1gpu_tmpfs_p50_ms"] = pct(prep, 50), pct(unprep, 50)
        r["empty_call_tmpfs_p50_ms"], r["floor_tmpfs_p50_ms"] = pct(empty, 50), pct(floor, 50)
        b.stop_agent()
    finally:
        if b.proc is not None and b.proc.poll() is None:
            b.proc.kill()
        await b.close()


async def run(n: int, fill_to: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    # An installed agent has its modules' bytecode (pip and the image compile it); a checkout run with
    # PYTHONDONTWRITEBYTECODE would compile every module at each start and time the compiler instead.
    subprocess.run([sys.executable, "-m", "compileall", "-q", "agent", "cdi"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    if shm is not None:
        work = Path(tempfile.mkdtemp(prefix="drab-", dir=shm))
        try:
            await on_tmpfs(work, n, r)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    # What an earlier run (or anything else) left to write back would be paid by the fsyncs timed
    # here, unevenly: it is written out first.
    os.sync()
    work = Path(tempfile.mkdtemp(prefix="drab-", dir="/tmp"))  # short: unix socket paths
    try:
        await on_disk(work, n, fill_to, r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r["prepare_1gpu_vs_floor"] = r["prepare_1gpu_p50_ms"] / r["floor_p50_ms"]
    r[f"p50_{fill_to}_vs_10_claims"] = r[f"p50_at_{fill_to}_claims_ms"] / r["p50_at_10_claims_ms"]
    if shm is not None:
        r["agent_ms_per_prepare_tmpfs"] = r["prepare_1gpu_tmpfs_p50_ms"] - r["empty_call_tmpfs_p50_ms"]
    r["prepare_8gpu_vs_1gpu"] = r["prepare_8gpu_p50_ms"] / r["prepare_1gpu_p50_ms"]
    r["prepare_mig_vs_1gpu"] = r["prepare_mig_p50_ms"] / r["prepare_1gpu_p50_ms"]
    if r["prepare_nic_p50_ms"] is not None:
        r["prepare_nic_vs_1gpu"] = r["prepare_nic_p50_ms"] / r["prepare_1gpu_p50_ms"]
    r["samples_per_figure"] = n
    return dict(sorted(r.items()))


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
    results = asyncio.run(run(args.samples, args.fill))
    print(show(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"\nwritten to {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make bench`: the agent beside a peer driver built on the official kubeletplugin helper, called
the same way by one kubelet stand-in, in turn, sample by sample; plus the agent's own figures
(latency against floors measured in the same run, scaling with prepared claims, start-up, memory,
the CLI).

The agent runs as its own process (`dra-agent run --offline DIR`, simulated GPUs), exactly as
`make run` starts it, reading each claim from DIR. The peer (bench/peer/driver, Go) reads each
claim with client-go from an API stand-in (bench/peer/claimsapi) that serves the same files as
JSON over HTTP on loopback. Two runs: every directory on a tmpfs (/dev/shm: no fsync cost), then
on the disk under /tmp. Figures are printed as a table and written to .bench/results.json
(milliseconds unless the key says otherwise; ratios are agent / peer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import fleet  # noqa: E402
import idle  # noqa: E402
import kubesched  # noqa: E402
import measure  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402
import slowdevice  # noqa: E402
import soak  # noqa: E402
from drivers import Claims, Driver, OurAgent, PeerDriver, share_id_of, uid_of  # noqa: E402
from measure import Side  # noqa: E402
from probes import Floor, filesystem_of, pct, run_seconds, timed  # noqa: E402

from agent.config import build_settings  # noqa: E402
from agent.facts import NicFacts  # noqa: E402
from agent.inventory.nics import NicSource  # noqa: E402
from agent.kubelet import client as kc  # noqa: E402
from agent.names import ClaimRef  # noqa: E402

MIG_DEVICE = "gpu-0-mig-1g10gb-0"  # the smallest GPU instance on the simulated H100 (--dynamic-mig is on)
NODE_FILL = 110  # the kubelet's default pod limit
SHARE_MEMORY = "4Gi"  # 120 shares over 8 GPUs of 80 GiB: 15 a GPU fit


@dataclass
class Options:
    samples: int
    rounds: int
    fill_rounds: int
    starts: int
    mid: int
    fill: int
    peer: peers.PeerBinaries | None
    metadata: bool
    fleet: tuple[int, int, float]  # agents (0: none), prepared claims each, idle seconds
    soak_cycles: int = soak.CYCLES
    idle_seconds: float = 300.0
    sched: kubesched.Options | None = None  # the scheduler's part (bench/kubesched.py); None: not run


class Run:
    """One run's directory: the claims, the floor server, the agent and (with Go) the peer."""

    def __init__(self, work: Path, opts: Options) -> None:
        self.work, self.opts = work, opts
        self.claims = Claims(work / "offline")
        self.floor = Floor(work, ROOT)
        self.agent = OurAgent(work / "agent", self.claims.offline)
        self.api: peers.ClaimsApi | None = None
        self.peer: PeerDriver | None = None
        if opts.peer is not None:
            attributes = work / "attributes.json"
            attributes.write_bytes(device_attributes(self.agent))
            self.api = peers.ClaimsApi(opts.peer.claims_api, self.claims.offline, work / "claimsapi.log")
            self.peer = PeerDriver(work / "peer", opts.peer.driver, self.api.url, attributes, opts.metadata)

    @property
    def drivers(self) -> list[Driver]:
        return [d for d in (self.agent, self.peer) if d is not None]

    @contextlib.asynccontextmanager
    async def sides(self) -> AsyncIterator[list[Side]]:
        names = {"agent": "ours", "peer": "peer"}
        clients = [kc.DRAClient(d.dra_socket) for d in self.drivers]
        try:
            yield [Side(names[d.label], d, c) for d, c in zip(self.drivers, clients, strict=True)]
        finally:
            for c in clients:
                await c.close()

    async def close(self) -> None:
        for d in self.drivers:
            d.kill()
        if self.api is not None:
            self.api.close()
        await self.floor.close()


_STARTED = time.perf_counter()


def step(what: str) -> None:
    """A line of progress on stderr: the seconds since the bench started, and what comes next."""
    print(f"[{time.perf_counter() - _STARTED:6.1f}s] {what}", file=sys.stderr, flush=True)


def device_attributes(agent: OurAgent) -> bytes:
    """Each device's attributes as the agent publishes them (`dra-agent devices -o json`), for the
    peer's device metadata: both then write the same attributes."""
    out = subprocess.run([sys.executable, "-m", "agent", "devices", *agent.flags(), "-o", "json"], cwd=ROOT,
                         check=True, capture_output=True).stdout
    return orjson.dumps({d["name"]: d.get("attributes", {}) for d in orjson.loads(out)})


def put(r: dict[str, Any], key: str, per_side: dict[str, Any]) -> None:
    """`key` for the agent, `peer_<key>` for the peer."""
    for side, value in per_side.items():
        r[key if side == "ours" else f"peer_{key}"] = value


def ratio(r: dict[str, Any], name: str, key: str) -> None:
    if r.get(f"peer_{key}"):
        r[f"peer_ratio_{name}"] = r[key] / r[f"peer_{key}"]


async def throughput(sides: Sequence[Side], run: Run, fs: str, rounds: int, r: dict[str, Any]) -> None:
    """Claims per second, 16 calls of one claim one at a time and all in flight."""
    refs = [run.claims.write(f"conc-{i}", uid_of(200 + i), [f"gpu-{i % 8}"]) for i in range(16)]
    times = await measure.serial_and_concurrent(sides, refs, rounds)
    put(r, f"serial_claims_per_s_{fs}", {s: 16 / t[0] for s, t in times.items()})
    put(r, f"conc16_claims_per_s_{fs}", {s: 16 / t[1] for s, t in times.items()})
    ratio(r, f"serial_claims_per_s_{fs}", f"serial_claims_per_s_{fs}")
    ratio(r, f"conc16_claims_per_s_{fs}", f"conc16_claims_per_s_{fs}")
    if fs == "ext4":
        put(r, "concurrent16_speedup", {s: t[0] / t[1] for s, t in times.items()})


async def on_tmpfs(work: Path, opts: Options, r: dict[str, Any]) -> None:
    """The same round trips with every directory on a tmpfs: no fsync cost, what remains is each
    driver's own time (and, for the agent, its time over an empty call to the floor server)."""
    run = Run(work, opts)
    try:
        step("tmpfs: start the drivers")
        for _ in range(20):
            await run.floor.empty()
        for d in run.drivers:
            await d.start()
        one = run.claims.write("one-gpu", uid_of(1), ["gpu-0"])
        others = [run.claims.write(f"fill-{i}", uid_of(100_000 + i), [f"gpu-{i % 8}"]) for i in range(10)]
        async with run.sides() as sides:
            for s in sides:
                await measure.fill(s, others)
            step("tmpfs: prepare + unprepare, 10 other claims prepared")
            trips, probed = await measure.round_trips(sides, one, opts.samples,
                                                      {"empty": run.floor.empty, "ping": run.floor.ping})
            put(r, "rt_10_tmpfs_p50_ms", {s: pct(t.both, 50) for s, t in trips.items()})
            ratio(r, "rt_10_tmpfs", "rt_10_tmpfs_p50_ms")
            r["prepare_1gpu_tmpfs_p50_ms"] = pct(trips["ours"].prepare, 50)
            r["unprepare_1gpu_tmpfs_p50_ms"] = pct(trips["ours"].unprepare, 50)
            r["empty_call_tmpfs_p50_ms"], r["floor_tmpfs_p50_ms"] = pct(probed["empty"], 50), pct(probed["ping"], 50)
            step("tmpfs: 16 claims one at a time and in flight")
            await throughput(sides, run, "tmpfs", opts.rounds, r)
    finally:
        await run.close()


async def startups(run: Run, n: int, r: dict[str, Any]) -> None:
    """Exec -> GetInfo answered and -> DRA socket answering (medians of `n` starts, the drivers in
    turn, nothing prepared)."""
    times: dict[str, list[tuple[float, float]]] = {d.label: [] for d in run.drivers}
    for i in range(n):
        for d in run.drivers if i % 2 == 0 else list(reversed(run.drivers)):
            times[d.label].append(await d.start())
            d.stop()
    for label, samples in times.items():
        prefix = "" if label == "agent" else "peer_"
        r[f"{prefix}startup_to_getinfo_s"] = statistics.median(s[0] for s in samples)
        r[f"{prefix}startup_to_dra_ready_s"] = statistics.median(s[1] for s in samples)
    ratio(r, "start_to_getinfo", "startup_to_getinfo_s")


async def agent_only(side: Side, run: Run, one: ClaimRef, n: int, r: dict[str, Any]) -> None:
    """The agent's latency by kind of claim, against the floor (an empty call plus one durable
    512-byte write): 1 GPU, 8 GPUs, a 1g MIG placement (each prepare turns MIG mode on and creates
    the GPU and compute instance in the simulated NVML, each unprepare destroys them), a NIC."""
    floor: list[float] = []
    probes = {"ping": run.floor.ping}

    async def figures(ref: ClaimRef, count: int) -> measure.RoundTrips:
        trips, probed = await measure.round_trips([side], ref, count, probes)
        floor.extend(probed["ping"])
        return trips["ours"]

    t = await figures(one, n)
    r["prepare_1gpu_p50_ms"], r["prepare_1gpu_p99_ms"] = pct(t.prepare, 50), pct(t.prepare, 99)
    r["unprepare_1gpu_p50_ms"] = pct(t.unprepare, 50)
    t = await figures(run.claims.write("eight-gpus", uid_of(8), [f"gpu-{i}" for i in range(8)]), n // 2)
    r["prepare_8gpu_p50_ms"], r["prepare_8gpu_p99_ms"] = pct(t.prepare, 50), pct(t.prepare, 99)
    t = await figures(run.claims.write("one-mig", uid_of(9), [MIG_DEVICE]), n // 2)
    r["prepare_mig_p50_ms"], r["prepare_mig_p99_ms"] = pct(t.prepare, 50), pct(t.prepare, 99)
    r["unprepare_mig_p50_ms"] = pct(t.unprepare, 50)
    nic = await asyncio.to_thread(first_nic)
    if nic:
        t = await figures(run.claims.write("nic", uid_of(3), [nic]), n)
        r["prepare_nic_p50_ms"], r["prepare_nic_p99_ms"] = pct(t.prepare, 50), pct(t.prepare, 99)
    else:
        r["prepare_nic_p50_ms"] = None
    r["floor_p50_ms"], r["floor_p99_ms"] = pct(floor, 50), pct(floor, 99)


async def node_fill(sides: Sequence[Side], run: Run, rounds: int, r: dict[str, Any]) -> None:
    """110 claims, each a share of its own (a share ID of one of the 8 shared GPUs), as 110
    NodePrepareResources calls at once and one at a time, with 10 other claims (shares too) prepared.
    Shares, because the simulated machine has too few devices of other kinds for 110 claims, and a
    GPU is not shared while it is prepared whole: the other claims are unprepared after."""
    share = [run.claims.write(f"pod-{i}", uid_of(300 + i), [f"gpu-{i % 8}-shared"], (share_id_of(i), SHARE_MEMORY))
             for i in range(NODE_FILL + 10)]
    others, refs = share[NODE_FILL:], share[:NODE_FILL]
    for s in sides:
        await measure.fill(s, others)
    times = await measure.serial_and_concurrent(sides, refs, rounds)
    for s in sides:
        await measure.unprepare(s, others)
    put(r, f"node_fill_{NODE_FILL}_s", {s: t[1] for s, t in times.items()})
    put(r, f"node_fill_{NODE_FILL}_serial_s", {s: t[0] for s, t in times.items()})
    put(r, f"node_fill_{NODE_FILL}_vs_serial", {s: t[1] / t[0] for s, t in times.items()})
    ratio(r, f"node_fill_{NODE_FILL}", f"node_fill_{NODE_FILL}_s")


async def on_disk(work: Path, opts: Options, r: dict[str, Any]) -> None:
    run = Run(work, opts)
    mid, fill_to = opts.mid, opts.fill
    try:
        for _ in range(20):
            await run.floor.ping()
        step("disk: start-up")
        await startups(run, opts.starts, r)
        for d in run.drivers:
            await d.start()
        await asyncio.sleep(1.0)  # the start-up's background work settles
        put(r, "rss_idle_mib", {"ours" if d.label == "agent" else "peer": d.rss() for d in run.drivers})
        r["cli_info_s"] = run_seconds([sys.executable, "-m", "agent", "kubelet", "info", *run.agent.flags()], ROOT)
        one = run.claims.write("one-gpu", uid_of(1), ["gpu-0"])
        fills = [run.claims.write(f"fill-{i}", uid_of(100_000 + i), [f"gpu-{i % 8}"]) for i in range(fill_to)]
        async with run.sides() as sides:
            ours = sides[0]
            step("disk: the agent alone by kind of claim, against the floor")
            await agent_only(ours, run, one, opts.samples, r)
            step("disk: empty calls")
            empty = await measure.empty_calls(sides, opts.samples)
            put(r, "dra_empty_call_p50_ms", {s: pct(v, 50) for s, v in empty.items()})
            ratio(r, "empty_call", "dra_empty_call_p50_ms")
            step("disk: 16 claims one at a time and in flight")
            await throughput(sides, run, "ext4", opts.rounds, r)
            step(f"disk: node fill, {NODE_FILL} claims")
            await node_fill(sides, run, opts.fill_rounds, r)
            for s in sides:
                await measure.fill(s, fills[:10])
            step("disk: prepare + unprepare, 10 other claims prepared")
            trips, _ = await measure.round_trips(sides, one, opts.samples)
            put(r, "rt_10_ext4_p50_ms", {s: pct(t.both, 50) for s, t in trips.items()})
            ratio(r, "rt_10_ext4", "rt_10_ext4_p50_ms")
            r["p50_at_10_claims_ms"] = pct(trips["ours"].prepare, 50)
            r["cli_claims_s"] = run_seconds([sys.executable, "-m", "agent", "claims", *run.agent.flags()], ROOT)
            step(f"disk: fill to {mid} claims")
            seconds = {s.name: await measure.fill(s, fills[10:mid]) for s in sides}
            put(r, f"fill_to_{mid}_claims_per_s", {s: (mid - 10) / t for s, t in seconds.items()})
            step(f"disk: prepare + unprepare, {mid} other claims prepared")
            trips, _ = await measure.round_trips(sides, one, opts.samples)
            put(r, f"rt_{mid}_ext4_p50_ms", {s: pct(t.both, 50) for s, t in trips.items()})
            ratio(r, f"rt_{mid}_ext4", f"rt_{mid}_ext4_p50_ms")
            put(r, f"rss_{mid}_mib", {"ours" if d.label == "agent" else "peer": d.rss() for d in run.drivers})
            ratio(r, f"rss_{mid}", f"rss_{mid}_mib")
            if run.peer is not None:  # the rest is the agent's alone
                run.peer.stop()
            step(f"disk: the agent alone, fill to {fill_to} claims")
            started = time.perf_counter()
            await measure.fill(ours, fills[mid:])
            r["fill_claims_per_s"] = (fill_to - mid) / (time.perf_counter() - started)
            # The claim status writes of the fill trail it in the background (offline: a file per
            # claim); measured before they are done, the p50 below would time that backlog.
            r["claim_status_backlog_after_fill_s"] = await status_written(run, fill_to)
            trips, _ = await measure.round_trips([ours], one, opts.samples)
            r[f"p50_at_{fill_to}_claims_ms"] = pct(trips["ours"].prepare, 50)
        r["rss_mib"] = r[f"rss_{fill_to}_mib"] = run.agent.stop()
        r["agent_side_prepare_1gpu_p50_ms"] = agent_side_p50(run.agent.log, "bench/one-gpu")
        step(f"disk: the agent's restart with {fill_to} claims")
        # Restart with every claim prepared: recovery reads and checks all records first.
        info, dra = await run.agent.start()
        r[f"startup_to_getinfo_with_{fill_to}_claims_s"] = info
        r[f"startup_to_dra_ready_with_{fill_to}_claims_s"] = dra
        async with kc.DRAClient(run.agent.dra_socket) as client:  # served while records are checked
            r[f"first_prepare_after_start_with_{fill_to}_claims_ms"] = await timed(lambda: client.prepare([one]))
        run.agent.stop()
    finally:
        await run.close()


async def status_written(run: Run, count: int, limit: float = 600.0) -> float:
    """Seconds until the offline status directory holds `count` claims' status files."""
    directory = run.claims.offline / "resourceclaimstatus" / "bench"
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        if directory.is_dir() and len(os.listdir(directory)) >= count:
            break
        await asyncio.sleep(0.1)
    return time.perf_counter() - started


async def run_all(opts: Options) -> dict[str, Any]:
    r: dict[str, Any] = {}
    # An installed agent has its modules' bytecode (pip and the image compile it); a checkout run with
    # PYTHONDONTWRITEBYTECODE would compile every module at each start and time the compiler instead.
    subprocess.run([sys.executable, "-m", "compileall", "-q", "agent", "cdi"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    if os.access("/dev/shm", os.W_OK):
        work = Path(tempfile.mkdtemp(prefix="drab-", dir="/dev/shm"))
        try:
            await on_tmpfs(work, opts, r)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    # What an earlier run (or anything else) left to write back would be paid by the fsyncs timed
    # here, unevenly: it is written out first.
    os.sync()
    work = Path(tempfile.mkdtemp(prefix="drab-", dir="/tmp"))  # short: unix socket paths
    r["disk_filesystem"] = filesystem_of(work)
    try:
        await on_disk(work, opts, r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    step("a slow device beside 102 claims; then the agent idle")
    await slowdevice.measure(r, opts.fill_rounds)
    await idle.measure(r, opts.idle_seconds)
    agents, claims, quiet = opts.fleet
    if agents:
        await asyncio.to_thread(fleet.run, agents, claims, quiet, r, step)  # its own event loops, for the prepares
    if opts.soak_cycles:
        r.update(await soak.run(opts.soak_cycles, progress=step))
    if opts.sched is not None:
        r.update(await asyncio.to_thread(kubesched.run, opts.sched, step))
    fill_to = opts.fill
    r["prepare_1gpu_vs_floor"] = r["prepare_1gpu_p50_ms"] / r["floor_p50_ms"]
    r[f"p50_{fill_to}_vs_10_claims"] = r[f"p50_at_{fill_to}_claims_ms"] / r["p50_at_10_claims_ms"]
    if "prepare_1gpu_tmpfs_p50_ms" in r:
        r["agent_ms_per_prepare_tmpfs"] = r["prepare_1gpu_tmpfs_p50_ms"] - r["empty_call_tmpfs_p50_ms"]
    r["prepare_8gpu_vs_1gpu"] = r["prepare_8gpu_p50_ms"] / r["prepare_1gpu_p50_ms"]
    r["prepare_mig_vs_1gpu"] = r["prepare_mig_p50_ms"] / r["prepare_1gpu_p50_ms"]
    if r["prepare_nic_p50_ms"] is not None:
        r["prepare_nic_vs_1gpu"] = r["prepare_nic_p50_ms"] / r["prepare_1gpu_p50_ms"]
    r["samples_per_figure"] = opts.samples
    r["rounds_per_figure"] = opts.rounds
    r["node_fill_rounds"] = opts.fill_rounds
    if opts.peer is not None:
        r["peer"] = f"{opts.peer.go_version}, device metadata {'on' if opts.metadata else 'off'}"
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
    # Not the uplink: a NIC claim moves its NIC into the pod, and the agent refuses that for the link
    # that carries the node's default route (on a machine with one NIC, no NIC figure).
    return min((d.name for d in devices if isinstance(d.node, NicFacts) and not d.node.uplink), default=None)


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def sched_only(opts: kubesched.Options | None, out: Path) -> int:
    """`--only sched`: the scheduler's part alone, its own table and file."""
    if opts is None:
        print("--only sched with --sched-nodes 0: nothing to run", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminated)
    try:
        results = kubesched.run(opts, step)
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    print(report.sched_table(results) + "\n\n" + report.every_key(results))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"\nwritten to {os.path.relpath(out)}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=300, help="samples per latency figure (default: 300)")
    p.add_argument("--rounds", type=int, default=7,
                   help="rounds per throughput and node-fill figure, the median taken (default: 7)")
    p.add_argument("--node-fill-rounds", type=int, default=3,
                   help="rounds of the node fill, the median taken (default: 3)")
    p.add_argument("--starts", type=int, default=5, help="starts per start-up figure (default: 5)")
    p.add_argument("--mid", type=int, default=1_000,
                   help="claims prepared on both drivers for the scaling and memory comparison (default: 1000)")
    p.add_argument("--fill", type=int, default=10_000,
                   help="claims prepared on the agent before its last figures (default: 10000)")
    p.add_argument("--peer", choices=("auto", "off"), default="auto",
                   help="auto: build and run the peer driver when Go is installed (default); off: the agent alone")
    p.add_argument("--peer-metadata", choices=("on", "off"), default="on",
                   help="the peer's helper writes device metadata, as the agent does (default: on)")
    p.add_argument("--fleet-agents", type=int, default=20,
                   help="agents as nodes against one real API server for the fleet_* figures; 0: none (default: 20)")
    p.add_argument("--fleet-claims", type=int, default=100, help="prepared claims per fleet agent (default: 100)")
    p.add_argument("--fleet-idle-seconds", type=float, default=600.0,
                   help="the fleet's idle window, one default garbage collection period (default: 600)")
    p.add_argument("--soak-cycles", type=soak.cycles, default=soak.CYCLES, help=soak.CYCLES_HELP)
    p.add_argument("--idle-seconds", type=float, default=300.0,
                   help="how long the idle agent's CPU and wake-ups are measured (default: 300)")
    p.add_argument("--sched-nodes", type=int, default=100,
                   help="fake Nodes for the scheduler's part (bench/kubesched.py); 0: not run (default: 100)")
    p.add_argument("--sched-pods", type=int, default=30,
                   help="pods per round of the scheduler's part, a round per kind and inventory (default: 30)")
    p.add_argument("--sched-gates", type=kubesched.gate_sets, default=("default", "alpha"),
                   help="the scheduler's part with 1.37's default gates, with the DRA alpha gates on, or both "
                   "(default: default,alpha)")
    p.add_argument("--sched-profile", type=kubesched.kinds, default=("gpu", "passthrough"),
                   help="kinds whose extra round on the richest inventory is profiled (CPU, pprof) into "
                   ".bench/sched-profile-<kind>.pb.gz; empty: none (default: gpu,passthrough)")
    p.add_argument("--sched-what-if", action="store_true",
                   help="also the scheduler's rounds on the what-if inventories of bench/kubesched.py (WHAT_IF)")
    p.add_argument("--only", choices=("all", "sched"), default="all",
                   help="sched: the scheduler's part alone, written to .bench/sched.json unless --out says "
                   "otherwise (default: all)")
    p.add_argument("--out", type=Path, default=None,
                   help="default: .bench/results.json (--only sched: .bench/sched.json)")
    args = p.parse_args()
    schedule = kubesched.Options(args.sched_nodes, args.sched_pods, args.sched_gates, args.sched_profile,
                                 what_if=args.sched_what_if) if args.sched_nodes else None
    if args.only == "sched":
        return sched_only(schedule, args.out or ROOT / ".bench" / "sched.json")
    args.out = args.out or ROOT / ".bench" / "results.json"
    if not 10 < args.mid < args.fill:
        p.error("--mid must be more than 10 and less than --fill")
    # SIGTERM ends the run as Ctrl-C does: the drivers and servers it started are stopped on the way out.
    signal.signal(signal.SIGTERM, _terminated)
    log: list[str] = []
    binaries = peers.build(log) if args.peer == "auto" else None
    if args.peer == "off":
        log.append("--peer off: the agent alone")
    print("\n".join(log))
    opts = Options(args.samples, args.rounds, args.node_fill_rounds, args.starts, args.mid, args.fill, binaries,
                   args.peer_metadata == "on", (args.fleet_agents, args.fleet_claims, args.fleet_idle_seconds),
                   args.soak_cycles, args.idle_seconds, schedule)
    if binaries is not None:
        print("claims: the agent reads the offline directory's YAML files; the peer reads the same claims "
              "with client-go (GET, JSON over HTTP on loopback) from the bench's claims API")
    try:
        results = asyncio.run(run_all(opts))
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    if binaries is not None:
        print("\n" + report.side_by_side(results, args.mid))
        print("\nthe agent alone\n" + report.agent_targets(results))
    if schedule is not None:
        print("\nthe scheduler (bench/kubesched.py)\n" + report.sched_table(results))
    print("\n" + report.every_key(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"\nwritten to {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

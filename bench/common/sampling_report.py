"""The report of a sampled run (:mod:`bench.common.sampling`): markdown sections for memory per process,
the parser-session cache, the client's requests and the app's, and the plot's panels (RSS absolute and
against its baseline, the cache against its bounds, the load)."""

from __future__ import annotations

from typing import Any

from bench.common.report import fmt


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

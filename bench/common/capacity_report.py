"""``capacity.json``'s outputs (:mod:`bench.capacity_bench` writes it): the markdown report, the plot of
a miss's cost by position, and the constants in ``capacity.yaml``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def plot(data: dict[str, Any], out: Path) -> None:
    from bench.common.plots import COLORS, log_y, pyplot, rolling_median

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    rows, fit = data["misses"]["rows"], data["misses"]["fit"]
    xs = [r["position"] for r in rows]
    for variant, color, label in (("new_conversation", COLORS["vllm"], "miss, conversation new to the replica"),
                                  ("config_cached", "#ff7f0e", "miss, request config cached")):
        ax.plot(xs, [r[variant]["cpu_ms"] for r in rows], "o", color=color, label=f"{label} (median)")
        a, b = fit[variant]["a_ms"], fit[variant]["b_ms_per_token"]
        lo = min(x for x in xs if x > 0)  # the fit is for replays: drawn from the first one (a can be < 0)
        grid = [lo + (max(xs) - lo) * k / 50 for k in range(51)]  # a straight line, on a log axis
        ax.plot(grid, [a + b * x for x in grid], "-", color=color, alpha=0.6, label=f"fit {a:.2f} + {b * 1e3:.2f} µs × p")
    hx, hy = rolling_median([ms / 1e3 for ms in data["hits"]["cpu_ms_by_position"][1:]], 100)
    ax.plot(hx, hy, "-", color=COLORS["ours"], label="hit (rolling median of 100 positions)")
    log_y(ax)
    ax.set_xlabel("position in the stream (output tokens carried)")
    ax.set_ylabel("CPU ms per chunk (thread time)")
    m = data["machine"]
    ax.set_title(f"ParserDerender chunk cost, in-process (qwen3-tiny, hermes + qwen3)\n"
                 f"{m['date_utc']} · {m['cpu']} · serve_app {m['git_commit']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def render(data: dict[str, Any]) -> str:
    m, h, mi, ring, md, serve = (data[k] for k in ("machine", "hits", "misses", "ring", "model", "serve"))
    n = data["opts"]["tokens"]
    lines = [
        "# ParserDerender capacity model (in-process, qwen3-tiny, hermes + qwen3)",
        "",
        f"{m['date_utc']} · {m['cpu']} · nproc {m['nproc']} · {m['mem_gib']} GiB · Python {m['python']} · "
        f"serve_app {m['git_commit']}. `.venv/bin/python -m bench.capacity_bench"
        + (" --quick" if data["opts"]["quick"] else "") + f"`; the machine was {100 * m['background_cpu_util']:.0f}% busy "
        "with other work just before.",
        "",
        "The real `ParserDerenderService.chat_with_outcome` in one thread, no Ray and no HTTP: CPU is the calling "
        "thread's (`time.thread_time`), wall is `perf_counter`. Workload: `parser_bench`'s tool-and-reasoning "
        "output (a long `<think>` block, an answer, two hermes tool calls), one token per chunk, the client "
        "carrying `stream_state`. Client work (building bodies, reading states) is not counted.",
        "",
        f"## 1. Hit cost (session cached), positions 1..{n}, {data['opts']['streams']} streams",
        "",
        "| | mean ms | p50 ms | p99 ms |",
        "|---|---|---|---|",
        f"| CPU | {h['cpu']['mean_ms']:.3f} | {h['cpu']['p50_ms']:.3f} | {h['cpu']['p99_ms']:.3f} |",
        f"| wall | {h['wall']['mean_ms']:.3f} | {h['wall']['p50_ms']:.3f} | {h['wall']['p99_ms']:.3f} |",
        "",
        f"**{md['chunks_per_s_per_core']:.0f} chunks/s per core** on hits (1000 / mean CPU ms). A hit grows slowly "
        f"with the position (the carried state is parsed, checked and written back whole): "
        f"hit_ms(p) ≈ {h['fit_a_ms']:.3f} + {h['fit_b_ms_per_token'] * 1e3:.4f} µs × p.",
        "",
        "| positions | CPU p50 ms | CPU p99 ms |",
        "|---|---|---|",
    ]
    lines += [f"| {w['positions']} | {w['p50_ms']:.3f} | {w['p99_ms']:.3f} |" for w in h["windows_cpu"]]
    lines += [
        "",
        "Windows of 100 positions over the per-position medians of the streams (position 0 opens the stream). "
        "Mean hit CPU ms over a whole stream of L tokens: "
        + ", ".join(f"L = {k}: {v:.3f}" for k, v in h["mean_cpu_ms_by_length"].items()) + ".",
    ]
    lines += [
        "",
        f"## 2. Miss cost by position (median of {data['opts']['reps']}; session cache cleared, so the chunk replays the carried state)",
        "",
        "| position | CPU ms, config cached | CPU ms, new conversation | wall ms, new conversation | µs per token since the last row |",
        "|---|---|---|---|---|",
    ]
    prev = None
    for r in mi["rows"]:
        cpu = r["new_conversation"]["cpu_ms"]
        step = f"{(cpu - prev[1]) / (r['position'] - prev[0]) * 1e3:.1f}" if prev else "–"
        wall = r["new_conversation"]["wall_ms"]
        lines.append(f"| {r['position']} | {r['config_cached']['cpu_ms']:.2f} | {cpu:.2f} | {wall:.2f} | {step} |")
        prev = (r["position"], cpu)
    f_new, f_cached = mi["fit"]["new_conversation"], mi["fit"]["config_cached"]
    lines += [
        "",
        "Least squares miss_ms(p) = a + b·p (position 0 is a new stream: nothing to replay):",
        "",
        f"- **new conversation** (a session moved to a replica that has not seen its `chat_request`; used below): "
        f"**a = {f_new['a_ms']:.2f} ms, b = {f_new['b_ms_per_token'] * 1e3:.2f} µs per carried token**",
        f"- config cached: a = {f_cached['a_ms']:.2f} ms, b = {f_cached['b_ms_per_token'] * 1e3:.2f} µs per token",
        "",
        "The curve bends up a little (the last column), so the straight line's intercept is below the measured "
        "cost at position 0 (a new stream), and can be negative: use the fit for p of a few hundred and more. "
        f"Each carried token adds {f_new['b_ms_per_token'] / md['hit_ms']:.3f} mean hits' worth of CPU to a miss; "
        f"a miss at 1000 costs {(f_new['a_ms'] + 1000 * f_new['b_ms_per_token']) / md['hit_ms']:.0f} mean hits.",
        "",
        f"![miss cost by position]({data['png']})",
        "",
        "## 3. Sessions moved when replicas are added and removed",
        "",
        f"Ray's `ConsistentHashRouter` ring itself ({ring['router_kwargs']}, mmh3 with Ray's seed, vnode keys "
        f"`<unique_id>:<i>`; its `_rebuild_ring` / `_lookup_ranked_replicas` on a router built without a cluster), "
        f"{ring['sessions']} session ids, {ring['trials']} draws of replica ids from Ray's own generator. Up: a replica "
        "joins; down: one of the N + 1, chosen at random, leaves. *Busiest* is the most loaded replica's share of "
        "sessions × replicas (1.0 is an even spread): the replica that saturates first.",
        "",
        "| replicas | ideal 1/(N+1) | moved up, mean (min–max) | moved down, mean (min–max) | busiest share × N+1 |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['from']} ↔ {r['to']} | {100 * r['ideal']:.1f}% | {100 * r['up_mean']:.1f}% "
              f"({100 * r['up_min']:.1f}–{100 * r['up_max']:.1f}) | {100 * r['down_mean']:.1f}% "
              f"({100 * r['down_min']:.1f}–{100 * r['down_max']:.1f}) | {r['busiest_share_x_replicas']:.2f} |"
              for r in ring["rows"]]
    lines += [
        "",
        "**Hit rate over a scale event.** Streams of L chunks (one token each) start at a steady rate, so at the "
        "event a live stream's position is uniform over 0..L−1 and it has (L + 1)/2 chunks left on average. A "
        "moved stream misses exactly once (its next chunk replays on the new owner, later chunks hit there); the "
        "others only hit; streams opened after the event are not affected. Over the chunks the live streams send "
        "from the event to their end:",
        "",
        "    hit_rate = 1 − moved_fraction / ((L + 1) / 2)",
        "    extra CPU per live stream = moved_fraction · (miss_a + miss_b · (L − 1)/2 − hit_ms)",
        "",
        "| event | L | moved | hit rate | extra CPU ms per live stream |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {e['from']} → {e['to']} | {e['length']} | {100 * e['moved']:.1f}% | {100 * e['hit_rate']:.2f}% | "
              f"{e['extra_cpu_ms_per_live_stream']:.2f} |" for e in md["scale_events"]]
    lines += [
        "",
        "Not modelled: a primary that rejects a chunk (backpressure: `max_ongoing_requests`) sends it to a ring "
        "successor (`num_fallback_replicas`), which misses; and a replica that dies loses all its sessions "
        "(its share moves, as a scale-down).",
        "",
        "## 4. The model",
        "",
        "A replica is one Python process: its event loop does a request's work on one core whatever `num_cpus` says "
        "(that only places it), so capacity is counted in cores, one per replica at most. CPU per unit of the "
        f"CPU tier in Serve (HAProxy, Serve's proxy, Ingress, ParserDerender), from `bench/results/load.json` "
        f"(serve_app {serve['load_commit']}, the shipped plan: parser streams derendered in the Ingress, "
        "HAProxy hashing `x-session-id`), at its highest concurrency:",
        "",
        "| workload | unit | c | " + " | ".join(serve["parser"]["roles"]) + " | CPU tier |",
        "|---|---|---|" + "---|" * (len(serve["parser"]["roles"]) + 1),
    ]
    for w, unit in (("parser", "chunk"), ("composed", "token")):
        r = serve[w]
        lines.append(f"| {w} | {unit} | {r['concurrency']} | " + " | ".join(f"{v:.3f}" for v in r["roles"].values())
                     + f" | **{r['tier_ms']:.3f}** |")
    lines += [
        "",
        f"In-process a hit costs {md['hit_ms']:.3f} CPU ms on average over a {n}-token stream (section 1); the rest of "
        f"the {md['parser_tier_ms_per_chunk']:.2f} ms is HTTP, HAProxy and Serve's request path. A miss at position p "
        f"adds about {1000 * md['miss_b_ms_per_token']:.1f} µs · p (section 2): at 1000 tokens it costs "
        f"{md['miss_a_ms'] + 1000 * md['miss_b_ms_per_token']:.1f} ms, so the tier is sized on hits and the hit rate "
        "of section 3 keeps replay below 1% of chunks even while replicas are added.",
        "",
        f"Cores and replicas of the CPU tier per engine producing T tokens/s (one token per chunk), at utilisation {md['utilisation']}:",
        "",
        "    parser HTTP streams:   cores = T · tier_ms_per_chunk / 1000 / 0.7",
        "    composed API:          cores = T · tier_ms_per_token / 1000 / 0.7",
        "    Ingress replicas = ceil(cores)   (one core each)",
        "",
        "| T tok/s | parser streams: cores | Ingress replicas | composed: cores | Ingress replicas |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {s['tokens_per_s']} | {s['parser_stream_cores']:.1f} | {s['parser_stream_replicas']} | "
              f"{s['composed_cores']:.1f} | {s['composed_replicas']} |" for s in md["sizing"]]
    lines += [
        "",
        "**`target_ongoing_requests`** (what Serve's autoscaler holds per replica: requests in flight there).",
        "",
        f"- *Chunk requests* (ParserDerender; each parser chunk is one short request): with one server per replica, "
        f"Little's law for a single queue (M/M/1) puts u / (1 − u) requests in flight at utilisation u: "
        f"{md['chunk_target_ongoing_requests']:.2f} at u = {md['utilisation']}. Hence **2**; a higher target lets a replica "
        "queue (8 meant u ≈ 0.89 before scaling).",
        "- *Composed streams* (Ingress): a stream holds its request for its whole life, so the target is the open "
        "streams a replica serves at utilisation 0.7: streams = 0.7 · 1000 / (tier_ms_per_token · r) at r tokens/s "
        "per stream:",
        "",
        "| r tok/s per stream | composed streams per Ingress replica |",
        "|---|---|",
    ]
    lines += [f"| {s['tokens_per_s_per_stream']} | {s['streams_per_replica']:.0f} |" for s in md["composed_streams"]]
    lines += ["", f"Constants for configuration: `{data['yaml_path']}`."]
    return "\n".join(lines) + "\n"


def write_yaml(data: dict[str, Any], path: Path) -> None:
    md, m = data["model"], data["machine"]
    lines = [
        "# CPU-tier capacity constants, measured by bench/capacity_bench.py; the derivation and the tables are",
        "# in bench/results/capacity.md. CPU ms per chunk (one token per chunk) or per composed token,",
        f"# on {m['cpu']} ({m['nproc']} CPUs), serve_app {m['git_commit']}, {m['date_utc']}.",
        f"hit_ms: {md['hit_ms']:.4f}  # in-process, a chunk whose parser session is cached",
        f"miss_a_ms: {md['miss_a_ms']:.4f}  # a miss at position p costs miss_a_ms + miss_b_ms_per_token * p",
        f"miss_b_ms_per_token: {md['miss_b_ms_per_token']:.6f}",
        f"parser_tier_ms_per_chunk: {md['parser_tier_ms_per_chunk']:.4f}  # HAProxy, Serve, Ingress, ParserDerender (load.json)",
        f"composed_tier_ms_per_token: {md['composed_tier_ms_per_token']:.4f}",
        f"utilisation: {md['utilisation']}",
        f"chunk_target_ongoing_requests: {md['chunk_target_ongoing_requests']:.2f}  # u / (1 - u)",
        "# cores = T * tier_ms / 1000 / utilisation; Ingress replicas = ceil(cores), one core each",
        "sizing:",
    ]
    for s in md["sizing"]:
        lines += [f"  - tokens_per_s: {s['tokens_per_s']}",
                  f"    parser_stream_ingress_replicas: {s['parser_stream_replicas']}",
                  f"    composed_ingress_replicas: {s['composed_replicas']}"]
    lines.append("composed_streams_per_ingress_replica:  # target_ongoing_requests, by decode tokens/s per stream")
    lines += [f"  r_{s['tokens_per_s_per_stream']}_tok_s: {s['streams_per_replica']:.0f}" for s in md["composed_streams"]]
    path.write_text("\n".join(lines) + "\n")
    yaml.safe_load(path.read_text())  # stays valid YAML

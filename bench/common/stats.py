"""Percentiles, latency summaries (nearest rank on sorted samples, as every report so far), trends."""

from __future__ import annotations

import statistics
from typing import Any


def percentile(sorted_vals: list[float], q: float) -> float:
    """The sample at rank ``round(q * (n - 1))`` of already sorted values; NaN when there are none."""
    if not sorted_vals:
        return float("nan")
    idx = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return sorted_vals[idx]


def latency_stats(seconds: list[float]) -> dict[str, Any]:
    """n, p50 / p90 / p99 and mean in milliseconds of latencies given in seconds."""
    s = sorted(seconds)
    return {"n": len(s), "p50_ms": percentile(s, 0.5) * 1e3, "p90_ms": percentile(s, 0.9) * 1e3,
            "p99_ms": percentile(s, 0.99) * 1e3, "mean_ms": (sum(s) / len(s) * 1e3) if s else float("nan")}


def slope_per_min(pts: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute (NaN under two points)."""
    if len(pts) < 2:
        return float("nan")
    mt = statistics.fmean(t for t, _ in pts)
    mv = statistics.fmean(v for _, v in pts)
    den = sum((t - mt) ** 2 for t, _ in pts)
    return sum((t - mt) * (v - mv) for t, v in pts) / den * 60 if den else float("nan")

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


BURST_GAP_S = 0.0005  # an event read with the one before it (the same socket read), as a client times them
STALL_GAP_S = 0.25  # a pause no engine step on this box explains (a step at c=64 takes ~20 ms)


def stream_gaps(itls: list[list[float]]) -> dict[str, Any]:
    """How a streaming client received its events, from its inter-event gaps per request (seconds,
    ``vllm bench serve``'s ``itls``): the share of events that came in the same read as the one before
    (a burst: they were held somewhere and let go together; a share of the ``gaps``, one fewer than a
    request's events), the longest gap, and the requests with a
    gap of ``STALL_GAP_S`` or more. A smooth stream has no bursts and no long gap, whatever its speed."""
    gaps = [g for request in itls for g in request]
    return {
        "requests": len(itls),
        "gaps": len(gaps),
        "burst_share": sum(g < BURST_GAP_S for g in gaps) / len(gaps) if gaps else float("nan"),
        "longest_gap_ms": max(gaps) * 1e3 if gaps else float("nan"),
        "stalled_requests": sum(1 for request in itls if request and max(request) >= STALL_GAP_S),
    }

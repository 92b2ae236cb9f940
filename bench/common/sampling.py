"""Sampling a running app over a long run and judging the samples: every ``interval`` seconds the RSS of
every Serve process (:func:`bench.common.procs.sample_processes`), the app's ``/metrics`` (requests by
route and status, the parser-session cache per ParserDerender replica) and the client's counts; then
whether each process's memory stayed flat after warm-up, and the cache's peaks against its bounds."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from typing import Any, Awaitable, Callable

from bench.common.checked_http import CheckedClient
from bench.common.kills import killer
from bench.common.load import progress
from bench.common.procs import cmd_name, sample_processes
from bench.common.stats import slope_per_min

SERVE_ROLES = ("replica", "controller", "proxy", "child")  # gated on memory; "ray-system" and "client" are informational


def parse_metrics(text: str) -> dict[str, Any]:
    """The app's own series from ``/metrics``: requests by route and status (summed over Ingress replicas) and
    the parser-session cache per ParserDerender replica."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.harness.metrics import summed_by

    cache: dict[str, dict[str, float]] = {}
    out: dict[str, Any] = {}
    cache_keys = {"serve_app_parser_session_cache_sessions": "sessions", "serve_app_parser_session_cache_tokens": "tokens",
                  "serve_app_parser_session_cache_evictions_total": "evictions",
                  "serve_app_parser_session_cache_expirations_total": "expirations"}
    scalars = {"serve_app_parser_session_cache_max_tokens": "max_tokens", "serve_app_parser_session_stats_up": "stats_up",
               "serve_app_metrics_ingress_replicas": "ingress_replicas"}
    families = list(text_string_to_metric_families(text))  # parsed once for the loop and both sums
    for family in families:
        for s in family.samples:
            if s.name in scalars:
                out[scalars[s.name]] = s.value
            elif s.name in cache_keys:
                cache.setdefault(s.labels.get("replica", "?")[:8], {})[cache_keys[s.name]] = s.value
    out.update(requests=summed_by(families, "serve_app_http_requests_total", "method", "route", "status"),
               cache=cache, chunks=summed_by(families, "serve_app_parser_session_chunks_total", "outcome"))
    return out


async def take_sample(client: CheckedClient, samples: list[dict[str, Any]], t0: float, level_of: Callable[[float], int]) -> None:
    """One sample (``t`` seconds from ``t0``) appended to ``samples``, and a progress line."""
    t = time.perf_counter() - t0
    procs = await asyncio.to_thread(sample_processes)
    metrics: dict[str, Any] | None = None
    res = await client.request("metrics scrape", "GET", "/metrics", None, timeout=20)
    if res and res[0] == 200:
        metrics = parse_metrics(res[1].decode())
    tl = client.t
    sample = {
        "t": round(t, 2),
        "active_workers": level_of(t),
        "rss": {k: v["rss"] for k, v in procs.items()},
        "roles": {k: v["role"] for k, v in procs.items()},
        "pids": {k: v.get("pids") or [v["pid"]] for k, v in procs.items()},
        "metrics": metrics,
        "client_requests": tl.requests,
        "client_5xx": sum(n for (_, s), n in tl.status.items() if s >= 500),
        "client_hangs": sum(tl.hangs.values()),
    }
    samples.append(sample)
    cache = (metrics or {}).get("cache", {})
    rss = ", ".join(f"{k} {v['rss'] / 2**20:.0f}" for k, v in sorted(procs.items()) if v["role"] != "client")
    progress(f"  [{t:6.0f} s] workers {sample['active_workers']}, {tl.requests} requests, 5xx {sample['client_5xx']}, "
             f"hangs {sample['client_hangs']}, cache {[(int(c.get('sessions', 0)), int(c.get('tokens', 0))) for c in cache.values()]}; "
             f"RSS MiB: {rss}")


async def sampler(client: CheckedClient, samples: list[dict[str, Any]], t0: float, stop: asyncio.Event, interval: float,
                  level_of: Callable[[float], int]) -> None:
    """Every ``interval`` seconds (from ``t0``) until ``stop``: :func:`take_sample`."""
    for n in itertools.count(1):
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, t0 + n * interval - time.perf_counter()))
            return
        except TimeoutError:
            await take_sample(client, samples, t0, level_of)


async def sampled_run(client: CheckedClient, samples: list[dict[str, Any]], traffic: Callable[[float], Awaitable[None]], *,
                      duration: float, interval: float, level_of: Callable[[float], int], kills: list[tuple[float, str]],
                      kill_events: list[dict[str, Any]]) -> float:
    """``traffic(t0)`` with a sample before it, one every ``interval`` seconds while it runs, one a moment
    after; replicas killed on the ``kills`` schedule into ``kill_events``. Returns the traffic's seconds."""
    t0 = time.perf_counter()
    stop = asyncio.Event()
    await take_sample(client, samples, t0, level_of)  # the start, before the traffic
    sampling = asyncio.create_task(sampler(client, samples, t0, stop, interval, level_of))
    client.t.t0 = t0
    killing = asyncio.create_task(killer(kills, duration, t0, kill_events))
    await traffic(t0)
    await killing
    traffic_s = time.perf_counter() - t0
    stop.set()
    await sampling
    await asyncio.sleep(min(5.0, interval))
    await take_sample(client, samples, t0, level_of)  # after the traffic: what is left
    return traffic_s


def memory_rows(samples: list[dict[str, Any]], warm: float, tol: float) -> dict[str, dict[str, Any]]:
    """Per process: its RSS after ``warm`` seconds (a process seen later gets its own warm-up) against a
    baseline (median of the first 3 samples after it), PASS if every later sample is within ``tol``."""
    t_last = max((s["t"] for s in samples), default=0.0)
    series: dict[str, list[tuple[float, float]]] = {}
    roles: dict[str, str] = {}
    for s in samples:
        for label, rss in s["rss"].items():
            series.setdefault(label, []).append((s["t"], rss / 2**20))
            roles[label] = s["roles"][label]
    memory = {}
    for label, pts in sorted(series.items()):
        first_seen = pts[0][0]
        base_from = warm if first_seen <= samples[0]["t"] + 1 else first_seen + warm  # a replica started later warms up too
        post = [p for p in pts if p[0] >= base_from]
        row: dict[str, Any] = {"role": roles[label], "gated": roles[label] in SERVE_ROLES, "start_mib": pts[0][1],
                               "first_seen_s": first_seen, "last_seen_s": pts[-1][0], "samples": len(pts)}
        if pts[-1][0] < t_last - 1:
            row["gone"] = True
        if len(post) < 3:
            row.update(verdict="n/a", why=f"{len(post)} samples after its warm-up")
        else:
            base = statistics.median(v for _, v in post[:3])
            end = statistics.median(v for _, v in post[-3:])
            hi, lo = max(v for _, v in post), min(v for _, v in post)
            row.update(baseline_mib=base, end_mib=end, max_mib=hi, min_mib=lo, growth_pct=100 * (end / base - 1),
                       max_pct=100 * (hi / base - 1), min_pct=100 * (lo / base - 1),
                       slope_mib_per_min=slope_per_min(post),
                       verdict="PASS" if hi <= base * (1 + tol) and lo >= base * (1 - tol) else "FAIL")
        memory[label] = row
    return memory


def cache_rows(samples: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], int]:
    """Per ParserDerender replica: the cache's peaks, last counters and sizes; and how many samples had a
    replica's stats missing."""
    rows: dict[str, dict[str, Any]] = {}
    stats_down = 0
    for s in samples:
        m = s.get("metrics") or {}
        if m and m.get("stats_up") == 0:
            stats_down += 1
        for replica, c in (m.get("cache") or {}).items():
            row = rows.setdefault(replica, {"max_sessions_seen": 0.0, "max_tokens_seen": 0.0, "samples": 0})
            row["samples"] += 1
            row["max_sessions_seen"] = max(row["max_sessions_seen"], c.get("sessions", 0))
            row["max_tokens_seen"] = max(row["max_tokens_seen"], c.get("tokens", 0))
            row["evictions"], row["expirations"] = c.get("evictions", 0), c.get("expirations", 0)
            row["final_sessions"], row["final_tokens"] = c.get("sessions", 0), c.get("tokens", 0)
    return rows, stats_down


def haproxy_pids(samples: list[dict[str, Any]]) -> set[int]:
    """The pids of every ``haproxy`` child the samples saw."""
    return {int(p) for s in samples for label, pids in s["pids"].items() if label.endswith("› haproxy") for p in pids}


def stop_leftovers(pids: set[int]) -> None:
    """HAProxy processes this run started that outlived their manager: by pid, only those (and only if that
    pid is still an ``haproxy``)."""
    import psutil

    time.sleep(2)
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if cmd_name(proc) == "haproxy":
                progress(f"stopping leftover haproxy {pid}")
                proc.terminate()
        except psutil.Error:
            pass

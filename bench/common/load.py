"""Load driving: one async call run by N workers for a while, with latency, throughput and CPU per request
(:func:`measure`); or N workers each running whole sessions (a stream of chunk calls, a streamed
completion) that record what they measure into a :class:`Recorder`, with a progress line on stderr
(:func:`run_sessions`)."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
from collections import Counter
from typing import Any, AsyncIterator, Awaitable, Callable

from bench.common.cpu import cpu_by_role, machine_busy_s, proc_cpu
from bench.common.stats import latency_stats, percentile


def client_session(concurrency: int) -> Any:
    """The aiohttp client every HTTP case uses: keep-alive, enough connections for ``concurrency``."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(concurrency, 1) * 2, ttl_dns_cache=None),
        timeout=aiohttp.ClientTimeout(total=120),
    )


def http_call(session: Any, method: str, url: str, body: bytes | None) -> Callable[[], Awaitable[bytes]]:
    """A call that sends one request and returns the answer's body, failing unless it is 200."""
    headers = {"content-type": "application/json"} if body is not None else {}

    async def call() -> bytes:
        async with session.request(method, url, data=body, headers=headers) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
            return data

    return call


async def _drive(call: Callable[[], Awaitable[Any]], concurrency: int, duration: float, min_requests: int,
                 max_duration: float) -> tuple[list[float], list[str], float]:
    lat: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    deadline, hard = start + duration, start + max_duration

    async def worker() -> None:
        while True:
            now = time.perf_counter()
            if now >= hard or (now >= deadline and len(lat) >= min_requests) or len(errors) > 20:
                return
            try:
                await call()
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(repr(exc)[:300])
            else:
                lat.append(time.perf_counter() - now)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, errors, time.perf_counter() - start


async def measure(call: Callable[[], Awaitable[Any]], *, concurrency: int, duration: float, warmup: float,
                  min_requests: int = 0) -> dict[str, Any]:
    """Warm up, then drive ``call`` from ``concurrency`` workers; latency, throughput and CPU per request."""
    if warmup > 0:
        await _drive(call, concurrency, warmup, 0, warmup * 3 + 5)
    procs0, busy0, own0 = proc_cpu(), machine_busy_s(), time.process_time()
    lat, errors, elapsed = await _drive(call, concurrency, duration, min_requests, duration * 3 + 5)
    busy, own = machine_busy_s() - busy0, time.process_time() - own0
    by_role = cpu_by_role(procs0, proc_cpu())
    lat.sort()
    n = len(lat)
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "n": n,
        "errors": len(errors),
        "elapsed_s": round(elapsed, 3),
        "rps": n / elapsed if elapsed else 0.0,
        "p50_ms": percentile(lat, 0.50) * 1e3,
        "p90_ms": percentile(lat, 0.90) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "mean_ms": (sum(lat) / n * 1e3) if n else float("nan"),
        "max_ms": (lat[-1] * 1e3) if n else float("nan"),
        "machine_cpu_util": busy / elapsed / (os.cpu_count() or 1) if elapsed else 0.0,
        "cpu_ms_per_req": busy / n * 1e3 if n else float("nan"),
        "client_cpu_ms_per_req": own / n * 1e3 if n else float("nan"),
        "server_cpu_ms_per_req": (busy - own) / n * 1e3 if n else float("nan"),
        "cpu_ms_per_req_by_role": {k: v / n * 1e3 for k, v in sorted(by_role.items())} if n else {},
    }
    if errors:
        out["first_error"] = errors[0]
    return out


# --------------------------------------------------------------------------------------------
# Sessions: N workers, each running whole sessions (one stream, one streamed request) back to back
# --------------------------------------------------------------------------------------------


class Recorder:
    """What one case's sessions record while they run: named latency series (seconds, optionally by
    position in the session), named counts, errors and finished sessions. The progress line reads it live."""

    def __init__(self) -> None:
        self.series: dict[str, list[float]] = {}
        self.by_position: dict[str, dict[int, list[float]]] = {}
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.sessions = 0

    def add(self, name: str, seconds: float, position: int | None = None) -> None:
        self.series.setdefault(name, []).append(seconds)
        if position is not None:
            self.by_position.setdefault(name, {}).setdefault(position, []).append(seconds)

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n


Session = Callable[[Recorder, int], Awaitable[None]]
"""One session: records into the recorder; the int is the session's number in the case (0, 1, ...)."""


def progress(line: str) -> None:
    """A progress line on stderr (results go to stdout)."""
    print(line, file=sys.stderr, flush=True)


async def _ticker(label: str, rec: Recorder, unit: str, t0: float, interval: float, run_start: float | None) -> None:
    while True:
        await asyncio.sleep(interval)
        now = time.perf_counter()
        run = f"[run {now - run_start:5.0f} s] " if run_start is not None else ""
        err = f", {len(rec.errors)} errors" if rec.errors else ""
        progress(f"  {run}{label}: {now - t0:5.1f} s, {rec.counts[unit]} {unit} done, {rec.sessions} sessions{err}")


def position_p50_ms(by_position: dict[int, list[float]], bucket: int) -> list[list[float]]:
    """``[first position, p50 ms, samples]`` per bucket of ``bucket`` consecutive positions."""
    out: list[list[float]] = []
    if not by_position:
        return out
    for start in range(0, max(by_position) + 1, bucket):
        vals = sorted(v for p in range(start, start + bucket) for v in by_position.get(p, ()))
        if vals:
            out.append([start, percentile(vals, 0.5) * 1e3, len(vals)])
    return out


async def run_sessions(session: Session, *, concurrency: int, unit: str, min_sessions_per_worker: int = 1,
                       duration: float = 0.0, max_duration: float = 900.0, label: str = "", progress_interval: float = 5.0,
                       run_start: float | None = None, position_bucket: int = 10) -> dict[str, Any]:
    """``concurrency`` workers run sessions back to back until each has run ``min_sessions_per_worker`` and
    ``duration`` seconds have passed (no new session after ``max_duration``; a session once started is
    finished). Returns elapsed time, counts and rates per second (``<count>_per_s``), latency stats per
    series (and p50 by position where recorded), CPU per ``unit`` by process role, errors. Prints a
    progress line on stderr every ``progress_interval`` seconds (0: none)."""
    rec = Recorder()
    numbers = itertools.count()
    procs0, busy0, own0 = proc_cpu(), machine_busy_s(), time.process_time()
    t0 = time.perf_counter()
    deadline, hard = t0 + duration, t0 + max_duration

    async def worker() -> None:
        done = 0
        while len(rec.errors) <= 20:
            now = time.perf_counter()
            if now >= hard or (done >= min_sessions_per_worker and now >= deadline):
                return
            try:
                await session(rec, next(numbers))
            except Exception as exc:  # noqa: BLE001 - counted and reported
                rec.errors.append(repr(exc)[:300])
            else:
                rec.sessions += 1
            done += 1

    ticker = asyncio.create_task(_ticker(label, rec, unit, t0, progress_interval, run_start)) if progress_interval > 0 else None
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        if ticker is not None:
            ticker.cancel()
    elapsed = time.perf_counter() - t0
    busy, own = machine_busy_s() - busy0, time.process_time() - own0
    by_role = cpu_by_role(procs0, proc_cpu())
    units = rec.counts[unit]
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "sessions": rec.sessions,
        "errors": len(rec.errors),
        "elapsed_s": round(elapsed, 3),
        "counts": dict(rec.counts),
        **{f"{k}_per_s": v / elapsed if elapsed else 0.0 for k, v in rec.counts.items()},
        "latency": {k: latency_stats(v) for k, v in rec.series.items()},
        "position_p50_ms": {k: position_p50_ms(v, position_bucket) for k, v in rec.by_position.items()},
        "machine_cpu_util": busy / elapsed / (os.cpu_count() or 1) if elapsed else 0.0,
        f"server_cpu_ms_per_{unit}": (busy - own) / units * 1e3 if units else float("nan"),
        f"client_cpu_ms_per_{unit}": own / units * 1e3 if units else float("nan"),
        f"cpu_ms_per_{unit}_by_role": {k: v / units * 1e3 for k, v in sorted(by_role.items())} if units else {},
        "other_cpu_util": by_role.get("other", 0.0) / elapsed / (os.cpu_count() or 1) if elapsed else 0.0,
    }
    if rec.errors:
        out["first_error"] = rec.errors[0]
    return out


async def sse_events(resp: Any) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an aiohttp SSE response, up to ``[DONE]`` (not included)."""
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return
        yield data

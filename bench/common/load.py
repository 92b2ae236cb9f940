"""Load driving: one async call run by N workers for a while, with latency, throughput and CPU per request."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Awaitable, Callable

from bench.common.cpu import cpu_by_role, machine_busy_s, proc_cpu
from bench.common.stats import percentile


def client_session(concurrency: int) -> Any:
    """The aiohttp client every HTTP case uses: keep-alive, enough connections for ``concurrency``."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(concurrency, 1) * 2, ttl_dns_cache=None),
        timeout=aiohttp.ClientTimeout(total=120),
    )


def http_call(session: Any, method: str, url: str, body: bytes | None) -> Callable[[], Awaitable[None]]:
    """A call that sends one request and fails unless the answer is 200."""
    headers = {"content-type": "application/json"} if body is not None else {}

    async def call() -> None:
        async with session.request(method, url, data=body, headers=headers) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")

    return call


async def _drive(call: Callable[[], Awaitable[None]], concurrency: int, duration: float, min_requests: int,
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


async def measure(call: Callable[[], Awaitable[None]], *, concurrency: int, duration: float, warmup: float,
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

"""A checking HTTP client for long mixed runs (the soak): every request under a client deadline (past it:
a hang), its status counted by request kind and checked (200, or a 4xx in vLLM's error envelope for a
bad request), latencies kept, failures noted with their time into the run, all in a :class:`Tally`."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import orjson

JSON_HEADERS = {"content-type": "application/json"}


class Tally:
    """What the client saw: responses by (request kind, status), latencies, hangs, errors, mismatches, events."""

    def __init__(self) -> None:
        self.status: Counter[tuple[str, int]] = Counter()
        self.latency: dict[str, list[float]] = {}
        self.hangs: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.mismatches: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.samples: list[str] = []  # the first few errors, hangs and unexpected answers, in words
        self.requests = 0
        self.t0: float | None = None  # the traffic's start: failures are timed from it
        self.failures: list[tuple[float, str]] = []  # (seconds into the traffic, what): every failed request

    def note(self, line: str) -> None:
        if self.t0 is not None and not line.startswith("retried chunk differs"):
            self.failures.append((round(time.perf_counter() - self.t0, 2), line[:120]))
        if len(self.samples) < 40:
            self.samples.append(line[:400])

    def summary(self) -> dict[str, Any]:
        """The JSON-able summary the report reads (latency stats with max per request kind)."""
        from bench.common.stats import latency_stats

        lat = {}
        for k, v in self.latency.items():
            st = latency_stats(v)
            st["max_ms"] = max(v) * 1e3 if v else float("nan")
            lat[k] = st
        return {"requests": self.requests, "status": {f"{k} {s}": n for (k, s), n in sorted(self.status.items())}, "latency": lat,
                "hangs": dict(self.hangs), "errors": dict(self.errors), "unexpected": dict(self.unexpected),
                "mismatches": dict(self.mismatches), "events": dict(self.events), "samples": self.samples, "failures": self.failures}


class CheckedClient:
    """Requests against ``base`` through an aiohttp session, each checked and counted into ``tally``;
    ``timeout`` is the client deadline of a request, ``stream_timeout`` of a whole SSE stream."""

    def __init__(self, http: Any, base: str, tally: Tally, *, timeout: float, stream_timeout: float) -> None:
        self.http, self.base, self.t = http, base, tally
        self.timeout, self.stream_timeout = timeout, stream_timeout

    async def request(self, kind: str, method: str, path: str, body: bytes | None, *, bad: bool = False,
                      timeout: float | None = None) -> tuple[int, bytes] | None:
        """Send one request under the client deadline; count its status. None on a hang or a transport error."""
        import aiohttp

        t0 = time.perf_counter()
        self.t.requests += 1
        try:
            async with asyncio.timeout(timeout or self.timeout):
                async with self.http.request(method, self.base + path, data=body,
                                             headers=JSON_HEADERS if body is not None else None) as resp:
                    data, status = await resp.read(), resp.status
        except TimeoutError:
            self.t.hangs[kind] += 1
            self.t.note(f"hang: {kind} {method} {path} after {time.perf_counter() - t0:.1f} s")
            return None
        except (aiohttp.ClientError, OSError) as exc:
            self.t.errors[kind] += 1
            self.t.note(f"transport error: {kind} {method} {path}: {exc!r}")
            return None
        self._count(kind, status, time.perf_counter() - t0, bad, data)
        return status, data

    def _count(self, kind: str, status: int, seconds: float, bad: bool, data: bytes) -> None:
        self.t.status[(kind, status)] += 1
        self.t.latency.setdefault(kind, []).append(seconds)
        ok = 400 <= status < 500 if bad else status == 200
        if not ok:
            self.t.unexpected[kind] += 1
            self.t.note(f"unexpected {status}: {kind}: {data[:300]!r}")
        if bad and ok:
            try:
                env = orjson.loads(data)["error"]
                if env.get("code") != status:
                    raise ValueError(env)
            except Exception:  # noqa: BLE001 - counted
                self.t.unexpected[kind + " (no envelope)"] += 1
                self.t.note(f"4xx without the envelope: {kind}: {data[:300]!r}")

    async def sse(self, kind: str, body: bytes, *, path: str = "/v1/chat/completions", drop_after: int | None = None,
                  timeout: float | None = None) -> list[Any] | None:
        """A streamed POST: its events (None on failure); ``drop_after``: close the connection after that
        many events (a client disconnect)."""
        import aiohttp

        t0 = time.perf_counter()
        self.t.requests += 1
        events: list[Any] = []
        done = False
        try:
            async with asyncio.timeout(timeout or self.stream_timeout):
                async with self.http.post(self.base + path, data=body, headers=JSON_HEADERS) as resp:
                    status = resp.status
                    if status != 200:
                        self._count(kind, status, time.perf_counter() - t0, False, await resp.read())
                        return None
                    async for line in resp.content:
                        if not line.startswith(b"data: "):
                            continue
                        data = line[6:].strip()
                        if data == b"[DONE]":
                            done = True
                            break
                        event = orjson.loads(data)
                        if "error" in event:
                            self.t.errors[kind + " (in-band error)"] += 1
                            self.t.note(f"in-band error: {kind}: {data[:300]!r}")
                        events.append(event)
                        if drop_after is not None and len(events) >= drop_after:
                            resp.close()  # drop the connection mid-stream
                            break
        except TimeoutError:
            self.t.hangs[kind] += 1
            self.t.note(f"hang: {kind} after {time.perf_counter() - t0:.1f} s, {len(events)} events")
            return None
        except (aiohttp.ClientError, OSError) as exc:
            self.t.errors[kind] += 1
            self.t.note(f"transport error: {kind}: {exc!r}")
            return None
        self._count(kind, status, time.perf_counter() - t0, False, b"")
        if drop_after is None and not done:
            self.t.errors[kind + " (no [DONE])"] += 1
            self.t.note(f"stream without [DONE]: {kind}")
        return events

"""Prometheus metrics of our own, served by the ingress at ``/metrics``.

Ray Serve exports its ``ray_serve_*`` series separately through Ray's metrics agent; these are the
per-route counters and latencies as the client sees them at the ingress. Each ingress replica keeps
its own registry (scrape every replica, or sum in Prometheus).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "HttpMetrics", "MetricsMiddleware"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class HttpMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "serve_app_http_requests",
            "HTTP requests served by the ingress, by route template, method and status.",
            ("route", "method", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "serve_app_http_request_duration_seconds",
            "Time from request start to the last response byte, by route template and method.",
            ("route", "method"),
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.parser_sessions = Counter(
            "serve_app_parser_session_chunks",
            "Parser-derender stream chunks by session-cache outcome: hit (live parser found), miss "
            "(history replayed), new (first chunk), none (usage-only chunk, nothing to parse).",
            ("outcome",),
            registry=self.registry,
        )
        self.replayed_chunks = Counter(
            "serve_app_parser_replays",
            "Parser-derender stream chunks answered by replaying the carried history (cache misses).",
            registry=self.registry,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware (no per-request task group, unlike ``BaseHTTPMiddleware``)."""

    def __init__(self, app: Any, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            # Templates, not raw paths, so label cardinality stays bounded.
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe(template, scope.get("method", ""), status, time.perf_counter() - start)

"""Prometheus metrics of our own, served by the ingress at ``/metrics``.

Ray Serve exports its ``ray_serve_*`` series separately through Ray's metrics agent; these are the
per-route counters and latencies as the client sees them at the ingress, and the parser-session
cache. Every Ingress replica counts in its own registry, but a scrape reaches whichever replica the
proxy picks, so the replica answering ``/metrics`` gathers every Ingress replica's series
(:meth:`HttpMetrics.set_replicas`) and labels each with its ``replica``: any one scrape target (the
Serve port, or the Kubernetes Service in front of it) sees the whole deployment, and rates stay right
when replicas come and go. Sum over ``replica`` in PromQL.

The parser-session caches live in the ParserDerender replicas and, with parser derender colocated,
in the Ingress replicas: the ingress asks them for their cache stats when it is scraped
(:meth:`HttpMetrics.set_session_caches`) and exports the answers, one series per replica holding
sessions (``replica`` label; ``Ingress:<id>`` for an Ingress). The dashboard and alert queries are in
``deploy/grafana/serve_app.json`` and ``docs/operations.md``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "HttpMetrics", "MetricsMiddleware", "ReplicaCollector", "SessionCacheCollector"]

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

        # What /metrics answers: every Ingress replica's series, then the ParserDerender caches.
        self.replicas = ReplicaCollector(self.registry)
        self.session_caches = SessionCacheCollector()
        self.exported = CollectorRegistry(auto_describe=False)
        self.exported.register(self.replicas)
        self.exported.register(self.session_caches)

    def families(self) -> list[Metric]:
        """This replica's own series, for the replica that answers a scrape."""
        return list(self.registry.collect())

    def set_replicas(self, families: Mapping[str, Sequence[Metric]]) -> None:
        """Every Ingress replica's :meth:`families`, by replica id, exported until the next call."""
        self.replicas.update(families)

    def set_session_caches(self, stats: Sequence[Any] | None, max_tokens: int | None = None) -> None:
        """The session caches' stats (``ParserDerender.stats()`` answers, and the Ingress replicas'
        own), exported until the next call."""
        self.session_caches.update(stats, max_tokens)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)

    def render(self) -> bytes:
        """The ``/metrics`` exposition (before any :meth:`set_replicas`: this replica's series, unlabelled)."""
        return generate_latest(self.exported)


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


class ReplicaCollector(Collector):
    """Each Ingress replica's series with a ``replica`` label, merged family by family (a family's
    samples must be one group in the text format)."""

    def __init__(self, own: CollectorRegistry) -> None:
        self._own = own
        self._replicas: Mapping[str, Sequence[Metric]] | None = None

    def update(self, families: Mapping[str, Sequence[Metric]]) -> None:
        self._replicas = dict(families)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self._replicas is None:
            yield from self._own.collect()
            return
        merged: dict[str, Metric] = {}
        for replica, families in sorted(self._replicas.items()):
            for family in families:
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp, sample.exemplar)
        yield from merged.values()
        count = GaugeMetricFamily("serve_app_metrics_ingress_replicas", "Ingress replicas whose series this scrape holds.")
        count.add_metric([], len(self._replicas))
        yield count


class SessionCacheCollector(Collector):
    """The parser-session caches' stats as of the last scrape (each ParserDerender replica's, and each
    Ingress replica's own, labelled ``Ingress:<id>``, when parser derender is colocated), read at collect time.

    A custom collector instead of labelled gauges: a replica that is gone simply stops appearing,
    with no label set to clear.
    """

    def __init__(self) -> None:
        self._stats: list[dict[str, Any]] = []
        self._up: int | None = None  # None: no ParserDerender in this graph, nothing to export
        self._max_tokens: int | None = None

    def update(self, stats: Sequence[Any] | None, max_tokens: int | None = None) -> None:
        """``stats``: one ``ParserDerender.stats()`` dict per replica (anything else marks a replica
        that did not answer); ``None``: the replicas could not be asked."""
        self._up = int(stats is not None and all(isinstance(s, dict) for s in stats))
        self._stats = [s for s in stats or () if isinstance(s, dict) and "replica" in s]
        self._max_tokens = max_tokens

    def describe(self) -> list[Metric]:
        return []  # names depend on the graph (none without a ParserDerender): not pre-registered

    def collect(self) -> Iterator[Metric]:
        if self._up is None:
            return
        up = GaugeMetricFamily(
            "serve_app_parser_session_stats_up",
            "1 when the last scrape got every ParserDerender replica's session-cache stats, else 0 (the series below then miss replicas).",
        )
        up.add_metric([], self._up)
        yield up
        if self._max_tokens is not None:
            bound = GaugeMetricFamily(
                "serve_app_parser_session_cache_max_tokens",
                "The configured per-replica bound on tokens held (parser_sessions.max_tokens).",
            )
            bound.add_metric([], self._max_tokens)
            yield bound
        families = (
            (
                GaugeMetricFamily,
                "serve_app_parser_session_cache_sessions",
                "Live parser sessions cached, per replica holding them (ParserDerender, or Ingress:<id> when colocated).",
                "sessions",
            ),
            (
                GaugeMetricFamily,
                "serve_app_parser_session_cache_tokens",
                "Token ids held by the cached sessions (their outputs; the cache's memory bound), per replica holding them.",
                "session_tokens",
            ),
            (
                CounterMetricFamily,
                "serve_app_parser_session_cache_evictions",
                "Sessions evicted to stay within max_sessions / max_tokens, per replica holding sessions.",
                "evictions",
            ),
            (
                CounterMetricFamily,
                "serve_app_parser_session_cache_expirations",
                "Sessions dropped after ttl_s unused, per replica holding sessions.",
                "expirations",
            ),
        )
        for family, name, doc, key in families:
            metric = family(name, doc, labels=("replica",))
            for s in self._stats:
                metric.add_metric([str(s["replica"])], float(s.get(key, 0)))
            yield metric

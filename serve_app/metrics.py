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
sessions (``replica`` label; ``Ingress:<id>`` for an Ingress).

The Engine replicas' vLLM series are asked for the same way (:meth:`HttpMetrics.set_engines`) and
exported under vLLM's own names and labels, as ``vllm serve`` serves them (``vllm:num_requests_running``,
``vllm:time_to_first_token_seconds``, ...), plus ``replica``: the Engine replica. Each Engine replica
also hands the same series to Ray's metrics agent (``ray_vllm_*``, tag ``ReplicaId``), as Ray Serve
LLM does (``serve_app/_vllm.py:engine_stat_loggers``).

Composed requests: the routes time their chunks (:meth:`HttpMetrics.timed`: time to first token and
between tokens, as the client sees them) and the stages before the response starts
(:meth:`HttpMetrics.composed_stage`: render, then the engine up to its first chunk), so the tier's
own share of a time to first token is the route's less vLLM's. A response that fails after its first
byte (an in-band error frame, an exception, the client going away) is counted by cause in
``serve_app_stream_errors_total`` and recorded with the error's status, not the 200 it started with.
The dashboard and alert queries are in ``deploy/grafana/serve_app.json`` and
``deploy/prometheus/alerts.yml``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect

from serve_app.errors import envelope
from serve_app.logs import get_logger

__all__ = [
    "CONTENT_TYPE_LATEST",
    "PARSER_FALLBACK_REASONS",
    "STREAM_ERROR_CAUSES",
    "EngineCollector",
    "HttpMetrics",
    "MetricsMiddleware",
    "ReplicaCollector",
    "SessionCacheCollector",
    "ask_every_replica",
]

logger = get_logger(__name__)

# Whole requests: sub-millisecond render calls up to streams of an hour.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# vLLM's own TTFT and inter-token boundaries (vllm/v1/metrics/buckets.py), so the composed route's
# quantiles compare with the engine's; the inter-token ones start lower, at one millisecond.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)

PARSER_FALLBACK_REASONS = ("unroutable", "replica_died")
STREAM_ERROR_CAUSES = ("engine_died", "timeout", "client_disconnect", "internal")
_CAUSE_BY_STATUS = {503: "engine_died", 504: "timeout"}  # after the first byte only the engine can be gone
_CLIENT_CLOSED = 499  # nginx's "client closed request": recorded as the status of a request the client left
_START = "serve_app.start"  # ASGI scope key: when the middleware saw the request (for time to first token)
_SSE_ERROR = b'data: {"error"'  # an in-band error frame: vLLM's (`json.dumps`) and the composed path's
_COMPOSED_ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}  # composed_stage's route label


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
        self.ttft = Histogram(
            "serve_app_time_to_first_token_seconds",
            "Composed streams: time from the request's arrival to its first chunk with tokens, by route.",
            ("route",),
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "serve_app_inter_token_latency_seconds",
            "Composed streams: time between consecutive chunks with tokens of one response, by route.",
            ("route",),
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.stages = Histogram(
            "serve_app_composed_stage_seconds",
            "Composed requests: time in each stage before the response starts, by route and stage: render "
            "(the request to the engine's token ids), engine_first_chunk (a stream: sent to the Engine until "
            "its first chunk is back, vllm:time_to_first_token_seconds included), engine (a whole generation).",
            ("route", "stage"),
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "serve_app_stream_errors",
            "Responses that failed after their first byte (counted with that error's status in "
            "serve_app_http_requests_total, not 200), by route and cause: engine_died, timeout, "
            "client_disconnect, internal.",
            ("route", "cause"),
            registry=self.registry,
        )
        self._stream_routes: set[str] = set()
        self.in_flight = Gauge(
            "serve_app_http_requests_in_flight",
            "HTTP requests this Ingress replica is serving now, open streams included.",
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
        self.parser_fallbacks = Counter(
            "serve_app_parser_local_fallbacks",
            "Parser-derender stream chunks meant for ParserDerender that the Ingress parsed itself (parser "
            "derender colocated), by reason: unroutable (no replica to take it), replica_died (its replica "
            "died under the call).",
            ("reason",),
            registry=self.registry,
        )
        for reason in PARSER_FALLBACK_REASONS:  # at 0 from the start, so a first fallback shows as a rate
            self.parser_fallbacks.labels(reason)
        self._outcomes: dict[str, Any] = {}  # filled as outcomes occur: no series without parser derender
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

        # What /metrics answers: every Ingress replica's series, then the ParserDerender caches.
        self.replicas = ReplicaCollector(self.registry)
        self.session_caches = SessionCacheCollector()
        self.exported = CollectorRegistry(auto_describe=False)
        self.engines = EngineCollector()
        self.exported.register(self.replicas)
        self.exported.register(self.session_caches)
        self.exported.register(self.engines)

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

    def set_engines(self, answers: Sequence[Any] | None) -> None:
        """The Engine replicas' ``Engine.metric_families()`` answers (``(replica id, families)``;
        anything else marks a replica that did not answer), exported until the next call; ``None``:
        the replicas could not be asked."""
        self.engines.update(answers)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        # Each label set's children looked up once (prometheus_client's labels() is ~2.5 us a call, on
        # every request); the sets are bounded: route templates, methods and statuses.
        children = self._children.get((route, method, status))
        if children is None:
            children = self._children[(route, method, status)] = (self.requests.labels(route, method, str(status)),
                                                                  self.latency.labels(route, method))
        children[0].inc()
        children[1].observe(seconds)

    def parser_chunk(self, outcome: str) -> None:
        """One parser-derender stream chunk, by its session-cache outcome (``SessionOutcome``)."""
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = self.parser_sessions.labels(outcome)
        child.inc()

    def stream_started(self, route: str) -> None:
        """Every cause's error counter at 0 for a streaming route, so a first failure shows as a rate."""
        if route not in self._stream_routes:
            self._stream_routes.add(route)
            for cause in STREAM_ERROR_CAUSES:
                self.stream_errors.labels(route, cause)

    def composed_stage(self, endpoint: str, stage: str, seconds: float) -> None:
        """One composed request's time in one stage (:class:`serve_app.compose.ComposedService`'s
        ``observe``); the composed API by handle counts under the route it shares with HTTP."""
        self.stages.labels(_COMPOSED_ROUTES[endpoint], stage).observe(seconds)

    async def timed(self, chunks: AsyncGenerator[dict[str, Any], None], scope: Mapping[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """A composed stream's chunk dicts, passed through, timed for the route's time to first token
        (from the request's arrival) and inter-token latency (between chunks with tokens; usage-only
        chunks and the in-band error carry none)."""
        route = _template(scope)
        last = scope.get(_START) or time.perf_counter()
        histogram, itl = self.ttft.labels(route), self.itl.labels(route)  # looked up once, not per token
        try:
            async for chunk in chunks:
                if chunk.get("choices"):
                    now = time.perf_counter()
                    histogram.observe(now - last)
                    histogram, last = itl, now
                yield chunk
        finally:
            await chunks.aclose()

    def render(self) -> bytes:
        """The ``/metrics`` exposition (before any :meth:`set_replicas`: this replica's series, unlabelled)."""
        return generate_latest(self.exported)

    async def scrape(
        self, own: tuple[str, list[Metric], dict[str, Any] | None], peers: Any, parser_derender: Any, engine: Any, max_tokens: int
    ) -> bytes:
        """The ``/metrics`` exposition for a scrape, whichever Ingress replica it reached: asked at
        scrape time, every Ingress replica's families (``peers``: this deployment's handle; ``own``:
        this replica's ``(replica id, families, session-cache stats)``, the shape each answers), the
        ParserDerender replicas' session caches next to the Ingress replicas' own, and the Engine
        replicas' vLLM series. A stage that is absent (``None``) exports nothing of its own."""
        peer_answers, caches, engines = await asyncio.gather(
            ask_every_replica(peers, "metric_families", "other Ingress replicas' metrics"),
            ask_every_replica(parser_derender, "stats", "session-cache stats"),
            ask_every_replica(engine, "metric_families", "engine metrics"),
        )
        replies = {a[0]: a for a in peer_answers or () if isinstance(a, tuple)} | {own[0]: own}
        self.set_replicas({r[0]: r[1] for r in replies.values()})
        if engine is not None:
            self.set_engines(engines)
        if parser_derender is not None:
            local_caches = [r[2] for r in replies.values() if len(r) > 2 and r[2] is not None]
            self.set_session_caches(None if caches is None else [*caches, *local_caches], max_tokens)
        return self.render()


async def ask_every_replica(handle: Any, method: str, what: str) -> list[Any] | None:
    """``method`` on every replica behind a deployment ``handle``: one call each, 2 s at most, an
    exception in place of a replica that failed; ``None`` when there is no such stage or it could not
    be asked. A scrape never fails because a stage is down."""
    if handle is None:
        return None
    try:
        return await handle.broadcast(method).results_async(timeout_s=2.0, return_exceptions=True)
    except Exception as exc:
        logger.info("%s unavailable: %s", what, exc)
        return None


class MetricsMiddleware:
    """Pure ASGI middleware (no per-request task group, unlike ``BaseHTTPMiddleware``).

    It records the status the client got: a response that breaks off after its first byte counts as
    the error that broke it (an in-band error frame's code, the exception's status, 499 when the client
    left), and in ``serve_app_stream_errors_total`` by cause.
    """

    def __init__(self, app: Any, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = scope[_START] = time.perf_counter()
        self.metrics.in_flight.inc()
        status: int | None = None  # as sent in http.response.start
        finished = disconnected = False
        in_band: int | None = None  # the code of an error frame sent inside a started stream

        async def receive_wrapper() -> dict[str, Any]:
            nonlocal disconnected
            try:
                message = await receive()
            except Exception as exc:
                # Ray 2.60's receive raises its call to the proxy's TaskCancelledError when the client
                # left mid-stream (Serve turns only a KeyError into http.disconnect): it is one, for
                # every layer below too; else the stream the client left ends as a 500.
                if type(exc).__name__ != "TaskCancelledError":
                    raise
                message = {"type": "http.disconnect"}
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status, finished, in_band
            if message["type"] == "http.response.start":
                status = message["status"]
                if dict(message.get("headers") or ()).get(b"content-type", b"").startswith(b"text/event-stream"):
                    self.metrics.stream_started(_template(scope))
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if in_band is None and body.startswith(_SSE_ERROR):
                    in_band = _error_code(body)
                finished = not message.get("more_body", False)
            await send(message)

        raised: int | None = None  # the status of an exception that escaped the app
        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except (asyncio.CancelledError, ClientDisconnect):  # the client went away (Serve cancels its request)
            disconnected = True
            raise
        except Exception as exc:
            raised = envelope(exc)[0]  # what the outermost handler answers, if nothing was sent
            raise
        finally:
            self.metrics.in_flight.dec()
            route = _template(scope)
            failed: int | None = None
            if status is None:  # nothing sent
                status = _CLIENT_CLOSED if disconnected and raised is None else raised or 500
            elif in_band is not None:
                failed = in_band
            elif not finished:  # broke off after its first byte
                failed = raised or _CLIENT_CLOSED
            if failed is not None:
                cause = "client_disconnect" if failed == _CLIENT_CLOSED else _CAUSE_BY_STATUS.get(failed, "internal")
                self.metrics.stream_errors.labels(route, cause).inc()
                status = failed
            self.metrics.observe(route, scope.get("method", ""), status, time.perf_counter() - start)


def _template(scope: Mapping[str, Any]) -> str:
    """The route template, not the raw path, so label cardinality stays bounded."""
    return getattr(scope.get("route"), "path", None) or "unmatched"


def _error_code(frame: bytes) -> int:
    """The ``code`` of an in-band ``data: {"error": {...}}`` frame (500 if it has none)."""
    try:
        code = json.loads(frame[len(b"data: ") :])["error"]["code"]
        return int(code) if int(code) >= 400 else 500
    except (ValueError, KeyError, TypeError):
        return 500


def _by_replica(replicas: Mapping[str, Sequence[Metric]]) -> Iterator[Metric]:
    """Each replica's families merged family by family (a family's samples must be one group in the
    text format), every sample labelled with its ``replica``."""
    merged: dict[str, Metric] = {}
    for replica, families in sorted(replicas.items()):
        for family in families:
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                out.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp, sample.exemplar)
    yield from merged.values()


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
        yield from _by_replica(self._replicas)
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


class EngineCollector(Collector):
    """vLLM's series from every Engine replica as of the last scrape, under vLLM's names and labels
    (``model_name``, ``engine``, ...) plus ``replica``, and whether every replica answered."""

    def __init__(self) -> None:
        self._replicas: dict[str, Sequence[Metric]] = {}
        self._up: int | None = None  # None: no Engine in this graph, nothing to export

    def update(self, answers: Sequence[Any] | None) -> None:
        replies = [a for a in answers or () if isinstance(a, tuple) and len(a) == 2]
        self._up = int(answers is not None and len(replies) == len(answers))
        self._replicas = {str(replica): families for replica, families in replies}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self._up is None:
            return
        yield from _by_replica(self._replicas)
        up = GaugeMetricFamily(
            "serve_app_engine_metrics_up",
            "1 when the last scrape got every Engine replica's vLLM series, else 0 (the vllm:* series then miss replicas).",
        )
        up.add_metric([], self._up)
        yield up
        count = GaugeMetricFamily("serve_app_metrics_engine_replicas", "Engine replicas whose vllm:* series this scrape holds.")
        count.add_metric([], len(self._replicas))
        yield count

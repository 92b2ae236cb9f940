"""``serve_app.metrics``: the series the ingress exports at scrape time (every Ingress replica's, the
ParserDerender session caches, the Engine replicas' vLLM series), and the stream metrics its middleware
keeps (time to first token, inter-token latency, errors after the first byte), driven through a real
FastAPI app."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_app.metrics import HttpMetrics


def _samples(metrics: HttpMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name.startswith("serve_app_parser_session_")
    }


def _stats(replica: str, sessions: int, tokens: int) -> dict:
    return {"replica": replica, "sessions": sessions, "session_tokens": tokens, "hits": 9, "misses": 1, "evictions": 2, "expirations": 3}


def test_without_a_parser_derender_no_session_cache_series_exist():
    assert _samples(HttpMetrics()) == {}


def test_each_replica_gets_its_series_and_a_gone_replica_disappears():
    metrics = HttpMetrics()
    metrics.set_session_caches([_stats("r1", 2, 100), _stats("r2", 5, 700)], max_tokens=1000)
    got = _samples(metrics)
    assert got[("serve_app_parser_session_stats_up", ())] == 1
    assert got[("serve_app_parser_session_cache_max_tokens", ())] == 1000
    assert got[("serve_app_parser_session_cache_sessions", (("replica", "r2"),))] == 5
    assert got[("serve_app_parser_session_cache_tokens", (("replica", "r1"),))] == 100
    assert got[("serve_app_parser_session_cache_evictions_total", (("replica", "r1"),))] == 2
    assert got[("serve_app_parser_session_cache_expirations_total", (("replica", "r2"),))] == 3

    metrics.set_session_caches([_stats("r2", 1, 50), TimeoutError("r1 did not answer")], max_tokens=1000)
    got = _samples(metrics)
    assert got[("serve_app_parser_session_stats_up", ())] == 0  # a replica is missing
    assert ("serve_app_parser_session_cache_sessions", (("replica", "r1"),)) not in got
    assert got[("serve_app_parser_session_cache_tokens", (("replica", "r2"),))] == 50


def test_replicas_that_could_not_be_asked_leave_only_the_up_series_at_zero():
    metrics = HttpMetrics()
    metrics.set_session_caches(None, max_tokens=1000)
    got = _samples(metrics)
    assert got[("serve_app_parser_session_stats_up", ())] == 0
    assert not any(name == "serve_app_parser_session_cache_sessions" for name, _ in got)


def test_a_scrape_holds_every_ingress_replicas_series_labelled_by_replica():
    a, b = HttpMetrics(), HttpMetrics()
    a.observe("/v1/chat/completions/render", "POST", 200, 0.003)
    b.observe("/v1/chat/completions/render", "POST", 200, 0.004)
    b.observe("/v1/chat/completions/render", "POST", 503, 0.001)
    a.set_replicas({"ra": a.families(), "rb": b.families()})
    families = {f.name: f for f in text_string_to_metric_families(a.render().decode())}
    requests = {
        (s.labels["replica"], s.labels["status"]): s.value for s in families["serve_app_http_requests"].samples if s.name.endswith("_total")
    }
    assert requests == {("ra", "200"): 1, ("rb", "200"): 1, ("rb", "503"): 1}
    counts = [s for s in families["serve_app_http_request_duration_seconds"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["replica"] for s in counts) == ["ra", "rb"]
    assert families["serve_app_metrics_ingress_replicas"].samples[0].value == 2


# --- the Engine replicas' vLLM series, as the ingress exports them ----------------------------------


def _vllm_families(running: float, tokens: float) -> list:
    """vLLM's families as its PrometheusStatLogger registers them (names, labels, a counter, a histogram)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    labels = ("model_name", "engine")
    Gauge("vllm:num_requests_running", "running", labels, registry=registry).labels("qwen3-tiny", "0").set(running)
    Counter("vllm:generation_tokens", "tokens", labels, registry=registry).labels("qwen3-tiny", "0").inc(tokens)
    Histogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=(0.1, 1), registry=registry).labels("qwen3-tiny", "0").observe(
        0.5
    )
    return list(registry.collect())


def _scrape(metrics: HttpMetrics) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(metrics.render().decode())}


def test_engine_series_keep_vllms_names_and_labels_plus_the_engine_replica():
    metrics = HttpMetrics()
    metrics.set_engines([("e1", _vllm_families(2, 30)), ("e2", _vllm_families(1, 12))])
    got = _scrape(metrics)
    running = {(s.labels["replica"], s.labels["model_name"], s.labels["engine"]): s.value for s in got["vllm:num_requests_running"]}
    assert running == {("e1", "qwen3-tiny", "0"): 2, ("e2", "qwen3-tiny", "0"): 1}
    tokens = {s.labels["replica"]: s.value for s in got["vllm:generation_tokens"] if s.name == "vllm:generation_tokens_total"}
    assert tokens == {"e1": 30, "e2": 12}
    buckets = [s for s in got["vllm:time_to_first_token_seconds"] if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert {s.labels["replica"] for s in buckets} == {"e1", "e2"} and {s.labels["le"] for s in buckets} == {"0.1", "1.0", "+Inf"}
    assert got["serve_app_engine_metrics_up"][0].value == 1
    assert got["serve_app_metrics_engine_replicas"][0].value == 2


def test_an_engine_replica_that_does_not_answer_drops_out_and_marks_the_scrape():
    metrics = HttpMetrics()
    metrics.set_engines([("e1", _vllm_families(0, 1)), TimeoutError("e2 did not answer")])
    got = _scrape(metrics)
    assert {s.labels["replica"] for s in got["vllm:num_requests_running"]} == {"e1"}
    assert got["serve_app_engine_metrics_up"][0].value == 0
    assert got["serve_app_metrics_engine_replicas"][0].value == 1
    metrics.set_engines(None)  # the Engine deployment could not be asked at all
    got = _scrape(metrics)
    assert "vllm:num_requests_running" not in got and got["serve_app_engine_metrics_up"][0].value == 0


def test_without_an_engine_no_engine_series_exist():
    assert not [name for name in _scrape(HttpMetrics()) if name.startswith(("vllm:", "serve_app_engine", "serve_app_metrics_engine"))]


# --- streams: time to first token, inter-token latency, errors after the first byte ------------------


def _value(metrics: HttpMetrics, name: str, **labels: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def test_composed_stream_chunks_are_timed_first_token_then_between_tokens():
    from types import SimpleNamespace

    metrics = HttpMetrics()
    chunks = [{"choices": [{"index": 0, "delta": {"content": c}}]} for c in "abc"] + [{"choices": [], "usage": {"total_tokens": 3}}]

    async def engine():
        for chunk in chunks:
            await asyncio.sleep(0)
            yield chunk

    async def run() -> list:
        scope = {"route": SimpleNamespace(path="/v1/chat/completions")}
        return [c async for c in metrics.timed(engine(), scope)]

    assert asyncio.run(run()) == chunks  # passed through untouched
    route = "/v1/chat/completions"
    assert _value(metrics, "serve_app_time_to_first_token_seconds_count", route=route) == 1
    assert _value(metrics, "serve_app_inter_token_latency_seconds_count", route=route) == 2  # the usage chunk carries no token


def test_composed_stages_are_recorded_under_their_route_and_stage():
    metrics = HttpMetrics()
    metrics.composed_stage("chat", "render", 0.003)
    metrics.composed_stage("chat", "engine_first_chunk", 0.03)
    metrics.composed_stage("completion", "render", 0.002)
    name = "serve_app_composed_stage_seconds"
    assert _value(metrics, name + "_count", route="/v1/chat/completions", stage="render") == 1
    assert _value(metrics, name + "_sum", route="/v1/chat/completions", stage="engine_first_chunk") == pytest.approx(0.03)
    assert _value(metrics, name + "_count", route="/v1/completions", stage="render") == 1
    assert _value(metrics, name + "_count", route="/v1/completions", stage="engine_first_chunk") == 0


def _sse_app(frames: list[bytes], fail_after: int | None = None, route: str = "/v1/chat/completions") -> Any:
    """A FastAPI app whose one route streams ``frames`` (raising after ``fail_after`` of them), behind the middleware."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    async def body():
        for i, frame in enumerate(frames):
            if i == fail_after:
                raise RuntimeError("broke mid-stream")
            yield frame
            await asyncio.sleep(0)

    @app.post(route)
    async def stream() -> StreamingResponse:
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/whole")
    async def whole() -> JSONResponse:
        return JSONResponse({"ok": True})

    return app


async def _call(
    app: Any, path: str, method: str = "POST", leave_after_first_byte: bool = False, leave_as: BaseException | None = None
) -> list[dict]:
    """Drive the ASGI app as a server does; optionally the client hangs up once the first body byte
    arrived: ``receive`` then answers ``http.disconnect``, or raises ``leave_as``."""
    sent: list[dict] = []
    requested, first_byte = False, asyncio.Event()

    async def receive() -> dict:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        if leave_after_first_byte:
            await first_byte.wait()
            if leave_as is not None:
                raise leave_as
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # the client stays to the end (the server stops listening then)
        raise AssertionError

    async def send(message: dict) -> None:
        sent.append(message)
        if leave_after_first_byte and message["type"] == "http.response.body" and message.get("body"):
            first_byte.set()
            await asyncio.Event().wait()  # writing to a client that is gone: only cancellation ends it

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "root_path": "",
        "server": ("t", 80),
        "client": ("c", 1),
    }
    try:
        await app(scope, receive, send)
    except RuntimeError:
        pass  # re-raised for the server, as ServerErrorMiddleware does
    return sent


def _middleware(app: Any) -> tuple[HttpMetrics, Any]:
    from serve_app.metrics import MetricsMiddleware

    metrics = HttpMetrics()
    return metrics, MetricsMiddleware(app, metrics)


FRAME = b'data: {"choices":[{"index":0}]}\n\n'


@pytest.mark.parametrize(
    ("error", "status", "cause"),
    [
        (
            b'data: {"error":{"message":"A replica went away.","type":"ServiceUnavailableError","param":null,"code":503}}\n\n',
            "503",
            "engine_died",
        ),
        (b'data: {"error": {"message": "x", "type": "GatewayTimeoutError", "param": null, "code": 504}}\n\n', "504", "timeout"),
        (b'data: {"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}\n\n', "500", "internal"),
    ],
)
def test_an_in_band_error_frame_counts_as_its_error_not_a_200(error, status, cause):
    metrics, app = _middleware(_sse_app([FRAME, error, b"data: [DONE]\n\n"]))
    sent = asyncio.run(_call(app, "/v1/chat/completions"))
    assert sent[0]["status"] == 200  # what the client saw first
    route = "/v1/chat/completions"
    assert _value(metrics, "serve_app_http_requests_total", route=route, status=status) == 1
    assert _value(metrics, "serve_app_http_requests_total", route=route, status="200") == 0
    assert _value(metrics, "serve_app_stream_errors_total", route=route, cause=cause) == 1
    assert _value(metrics, "serve_app_stream_errors_total", route=route) == 1
    # Every cause exists from the route's first stream on, at 0 until it happens.
    causes = {
        s.labels["cause"]
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
        if s.name == "serve_app_stream_errors_total"
    }
    assert causes == {"engine_died", "timeout", "client_disconnect", "internal"}


def test_a_stream_whose_generator_raises_after_the_first_byte_is_an_internal_error():
    metrics, app = _middleware(_sse_app([FRAME, FRAME], fail_after=1))
    asyncio.run(_call(app, "/v1/chat/completions"))
    assert _value(metrics, "serve_app_http_requests_total", status="500") == 1
    assert _value(metrics, "serve_app_stream_errors_total", cause="internal") == 1


def test_a_client_that_leaves_mid_stream_is_a_499_client_disconnect():
    metrics, app = _middleware(_sse_app([FRAME] * 50))
    sent = asyncio.run(_call(app, "/v1/chat/completions", leave_after_first_byte=True))
    assert not any(m["type"] == "http.response.body" and not m.get("more_body") for m in sent)  # it never finished
    assert _value(metrics, "serve_app_http_requests_total", status="499") == 1
    assert _value(metrics, "serve_app_stream_errors_total", cause="client_disconnect") == 1


def test_a_client_that_leaves_while_serves_receive_raises_task_cancelled_is_a_499_too():
    """Ray 2.60's receive raises the cancelled proxy call's TaskCancelledError (not http.disconnect)
    when the client left mid-stream: still a 499 client_disconnect, not a 500."""
    from ray.exceptions import TaskCancelledError

    metrics, app = _middleware(_sse_app([FRAME] * 50))
    sent = asyncio.run(_call(app, "/v1/chat/completions", leave_after_first_byte=True, leave_as=TaskCancelledError()))
    assert not any(m["type"] == "http.response.body" and not m.get("more_body") for m in sent)
    assert _value(metrics, "serve_app_http_requests_total", status="499") == 1
    assert _value(metrics, "serve_app_stream_errors_total", cause="client_disconnect") == 1
    assert _value(metrics, "serve_app_stream_errors_total", cause="internal") == 0


def test_complete_streams_and_whole_responses_are_no_stream_errors():
    metrics, app = _middleware(_sse_app([FRAME, FRAME, b"data: [DONE]\n\n"]))
    asyncio.run(_call(app, "/v1/chat/completions"))
    asyncio.run(_call(app, "/whole", method="GET"))
    assert _value(metrics, "serve_app_http_requests_total", status="200") == 2
    assert _value(metrics, "serve_app_stream_errors_total") == 0


def test_request_durations_reach_an_hour():
    bounds = {s.labels["le"] for s in _scrape_after(HttpMetrics(), 45 * 60) if s.name.endswith("_bucket")}
    assert {"30.0", "300.0", "3600.0"} <= bounds


def _scrape_after(metrics: HttpMetrics, seconds: float) -> list:
    metrics.observe("/v1/chat/completions", "POST", 200, seconds)
    return _scrape(metrics)["serve_app_http_request_duration_seconds"]

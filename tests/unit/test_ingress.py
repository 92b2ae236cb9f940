"""``serve_app.ingress`` without Ray.

* The session-affinity hint: the stream id read from a raw derender body, in linear time.
* ``/abort_requests``: any body that is not a JSON object is a 400 in vLLM's envelope, never a 500
  (the route method is called on a stand-in ``self``: it only needs the engine handle).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from serve_app.config import AppArgs
from serve_app.errors import ApiError, envelope
from serve_app.ingress import Ingress
from serve_app.wire import stream_id


class _Engine:
    def __init__(self) -> None:
        self.aborted: list = []

    def broadcast(self, method: str, request_ids):
        self.aborted.append((method, request_ids))

        async def results_async():
            return None

        return SimpleNamespace(results_async=results_async)


def _abort(body: bytes, content_type: bytes = b"application/json"):
    engine = _Engine()
    owner = SimpleNamespace(_require_engine=lambda: engine, _background=set(), args=AppArgs(limits={"max_abort_ids": 3}))

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(b"content-type", content_type)]
    request = Request({"type": "http", "method": "POST", "path": "/abort_requests", "headers": headers}, receive)

    async def call():
        response = await Ingress.func_or_class._abort(owner, request)
        await asyncio.gather(*owner._background)
        return response

    return asyncio.run(call()), engine


def test_abort_takes_request_ids():
    response, engine = _abort(b'{"request_ids": ["a", "b"]}')
    assert response.status_code == 200 and engine.aborted == [("abort", ["a", "b"])]


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xfe\xfd",  # not UTF-8
        b'{"request_ids": ["\xff"]}',
        b'{"request_ids": [' + b"9" * 5000 + b"]}",  # past Python's int-string limit
        b'{"request_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deeper than json's recursion limit
    ],
)
def test_unparseable_bodies_are_a_400_bad_request(body):
    with pytest.raises(ApiError) as got:
        _abort(body)
    status, env = envelope(got.value)
    assert status == 400 and env["error"]["type"] == "BadRequestError" and env["error"]["code"] == 400


@pytest.mark.parametrize(
    "body",
    [
        b'{"request_ids": "abc"}',  # not a list
        b'{"request_ids": [1, 2]}',
        b'{"request_ids": [""]}',
        b'{"request_ids": ["' + b"x" * 257 + b'"]}',
        b'{"request_ids": ["a", "b", "c", "d"]}',  # past limits.max_abort_ids (3 here)
    ],
)
def test_the_broadcast_is_bounded(body):
    with pytest.raises(ApiError) as got:
        _abort(body)
    assert got.value.status_code == 400 and got.value.param == "request_ids"


def test_abort_needs_a_json_content_type():
    with pytest.raises(ApiError) as got:
        _abort(b'{"request_ids": ["a"]}', content_type=b"text/plain")
    assert got.value.status_code == 400
    response, engine = _abort(b'{"request_ids": ["a"]}', content_type=b"application/json")
    assert response.status_code == 200 and engine.aborted == [("abort", ["a"])]


@pytest.mark.parametrize("body", [b"", b"{", b"not json"])
def test_malformed_json_keeps_vllms_400(body):
    with pytest.raises(StarletteHTTPException) as got:
        _abort(body)
    assert got.value.status_code == 400 and got.value.detail.startswith("JSON decode error: ")


@pytest.mark.parametrize("body", [b"{}", b"[]", b'"x"', b'{"request_ids": null}'])
def test_missing_request_ids_is_a_400(body):
    with pytest.raises(StarletteHTTPException) as got:
        _abort(body)
    assert (got.value.status_code, got.value.detail) == (400, "Missing 'request_ids' in request body")



@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({"stream": True, "generate_chunk": {"request_id": "abc", "choices": []}}, "abc"),
        ({"stream": True, "generate_chunk": {"choices": [{"index": 0, "token_ids": [1]}], "request_id": "r-1"}}, "r-1"),
        ({"stream": True, "generate_chunk": {"request_id": 'a"b\\c', "choices": []}}, 'a"b\\c'),
        ({"stream": True, "generate_chunk": {"request_id": "héllo ☃", "choices": []}}, "héllo ☃"),
        ({"stream": True, "generate_chunk": {"request_id": "x" * 256}}, "x" * 256),
        ({"stream": True, "generate_chunk": {"request_id": "é" * 256}}, "é" * 256),  # \u00e9 each, as ASCII
        # Not found, or not a usable id: no affinity (always safe).
        ({"stream": True, "generate_chunk": {"request_id": "x" * 257}}, None),
        ({"stream": True, "generate_chunk": {"request_id": ""}}, None),
        ({"stream": True, "generate_chunk": {"request_id": 5}}, None),
        ({"stream": True, "generate_chunk": {"choices": []}}, None),
        ({"generate_response": {"request_id": "r"}}, None),
        ({"chat_request": {"messages": [{"content": "generate_chunk"}]}, "generate_chunk": {"request_id": "r"}}, "r"),
    ],
)
def test_stream_id_reads_the_chunk_request_id(body, want):
    assert stream_id(json.dumps(body).encode()) == want
    assert stream_id(json.dumps(body, ensure_ascii=False, indent=2).encode()) == want


@pytest.mark.parametrize(
    "raw",
    [
        b'{"generate_chunk":{"request_id":"abc"}}',
        b'{ "generate_chunk" :\n\t{ "request_id"\r\n: "abc" } }',
        b'{"generate_chunk": {"choices": [], "request_id": "abc"}}',
    ],
)
def test_stream_id_whitespace_variants(raw):
    assert stream_id(raw) == "abc"


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b'"generate_chunk"',
        b'{"generate_chunk":{"request_id":"abc',  # unterminated
        b'{"generate_chunk":{"request_id":"a\\',
        b'{"generate_chunk":"request_id","request_id":"abc"}',  # generate_chunk is not an object
        b'{"generate_chunk":{"request_id":"\xff\xfe"}}',
    ],
)
def test_stream_id_malformed_is_none(raw):
    assert stream_id(raw) is None


@pytest.mark.parametrize(
    "raw",
    [
        # The bodies that took 112 s and 18 s with the backtracking regex.
        b'{"generate_chunk":{' + b'"generate_chunk":{}' * 7000 + b"}",
        b'"generate_chunk":{' * 5000 + (b'"request_id":"' + b"x" * 300) * 300,
        b'{"generate_chunk":{' + (b'"request_id":"' + b"x" * 300 + b'",') * 500 + b"}",
        b'{"generate_chunk":{"request_id":"' + b"\\" * 176_000,
        b'{"generate_chunk":{' + b'"request_id" ' * 14_000 + b"}",
        b'{"generate_chunk"' * 10_000 + b'"request_id":"' * 10_000,
    ],
)
def test_stream_id_is_linear_on_hostile_bodies(raw):
    """Work counted, not timed: the bytes ``stream_id`` scans or copies grow linearly with the body
    (eight times the body, at most about eight times the work; a quadratic scan would be ~64 times)."""
    work = []
    for body in (raw, raw * 8):
        counted = _CountingBytes(body)
        stream_id(counted)
        work.append(counted.work)
    assert work[1] <= 9 * work[0] + 8192, work


class _CountingBytes(bytes):
    """Bytes that count what ``find`` scans and what slicing copies (the scanner's only work)."""

    work = 0

    def find(self, sub, start=None, end=None):  # type: ignore[override]
        found = super().find(sub, start, end)
        first = 0 if start is None else start
        self.work += (len(self) if found < 0 else found + len(sub)) - first
        return found

    def __getitem__(self, key):  # type: ignore[override]
        item = super().__getitem__(key)
        if isinstance(key, slice):
            self.work += len(item)
        return item


def test_overload_and_unavailable_stages_answer_503_with_retry_after():
    from ray.serve.exceptions import BackPressureError

    from serve_app.errors import ServiceUnavailableError
    from serve_app.ingress import _any_exception

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []})
    for exc in (BackPressureError(num_queued_requests=9, max_queued_requests=8), ServiceUnavailableError("down")):
        response = asyncio.run(_any_exception(request, exc))
        assert response.status_code == 503 and int(response.headers["retry-after"]) > 0
        assert json.loads(response.body)["error"]["code"] == 503
    response = asyncio.run(_any_exception(request, ApiError("bad", status_code=400, err_type="BadRequestError")))
    assert response.status_code == 400 and "retry-after" not in response.headers


# --- the front door (issue 19, class 6): trailing slashes, HEAD, headers Ray cannot decode, slow bodies ---

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from serve_app.front_door import (  # noqa: E402
    ONE_BODY_ROUTES,
    BodyDeadlineMiddleware,
    ServeHintsMiddleware,
    StrictHeadersMiddleware,
    middlewares,
    undecodable_header,
    with_serve_hints,
)


@pytest.fixture
def client(monkeypatch):
    """The Ingress's FastAPI app as Serve runs it: its routes get ``self`` from the replica context
    (a stand-in Ingress here: these routes read only ``self.model``)."""
    from ray import serve

    from serve_app.ingress import api

    owner = SimpleNamespace(model=SimpleNamespace(served_model_names=["m"], model_dir="/models/m", max_model_len=64))
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=owner))
    return TestClient(api)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/health/"),
        ("GET", "/v1/models/"),
        ("GET", "/version/"),
        ("POST", "/v1/chat/completions/render/"),
        ("POST", "/v1/chat/completions/"),
        ("POST", "/tokenize/"),
    ],
)
def test_a_trailing_slash_is_the_404_envelope_not_a_redirect(client, method, path):
    r = client.request(method, path, headers={"host": "evil.example"}, json={}, follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json() == {"error": {"message": "Not Found", "type": "Not Found", "param": None, "code": 404}}


@pytest.mark.parametrize("path", ["/health", "/version", "/v1/models"])
def test_head_answers_like_get_without_a_body(client, path):
    got, head = client.get(path), client.head(path)
    assert got.status_code == head.status_code == 200
    assert head.content == b"" and head.headers.get("content-type") == got.headers.get("content-type")


def _run_asgi(app, headers, messages=()):
    """One request through an ASGI app: (status, headers, body, whether the app behind ran)."""
    sent: list = []
    pending = list(messages) or [{"type": "http.request", "body": b"", "more_body": False}]
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/tokenize", "headers": headers}
    asyncio.run(app(inner)(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body, bool(reached)


def _ray_reads(headers: list[tuple[bytes, bytes]]) -> None:
    """What Ray 2.60's replica decodes before any app code, in its own words (replica.py,
    ``_direct_ingress_asgi`` and ``get_asgi_tracing_context`` with tracing on; http_util.py)."""
    from ray.serve._private.http_util import parse_disconnect_disabled_header, parse_request_timeout_header, parse_session_id_header

    as_dict = dict(headers)
    as_dict.get(b"x-request-id", b"").decode("utf-8")
    parse_disconnect_disabled_header(as_dict)
    parse_request_timeout_header(as_dict, None)
    parse_session_id_header(as_dict)
    for key, value in as_dict.items():
        if key.decode().lower().replace("-", "_") == "serve_multiplexed_model_id":
            value.decode()
            break
    for key, value in headers:
        if key.decode() in ("traceparent", "tracestate"):
            value.decode()


_NAMES = [
    b"x-request-id",
    b"x-session-id",
    b"x_session_id",
    b"x-request-timeout-seconds",
    b"x-request-disconnect-disabled",
    b"serve_multiplexed_model_id",
    b"serve-multiplexed-model-id",
    b"traceparent",
    b"tracestate",
    b"user-agent",
    b"content-type",
    b"x-other",
    b"x-\xff-name",
    b"x-caf\xc3\xa9",
]
_VALUES = st.one_of(
    st.binary(max_size=6),  # mostly not UTF-8
    st.text(max_size=6).map(lambda t: t.encode("utf-8", "surrogatepass")),  # UTF-8, and encoded surrogates (not UTF-8)
    st.sampled_from([b"\xff", b"\x80", b"\xe2\x82", b"\xc0\xaf", b"\xed\xa0\x80", b"caf\xc3\xa9", b"5"]),
)
_HEADERS = st.lists(st.tuples(st.sampled_from(_NAMES), _VALUES), max_size=6, unique_by=lambda h: h[0].replace(b"-", b"_"))


@settings(max_examples=400, deadline=None)
@given(_HEADERS)
def test_strict_headers_reject_exactly_what_ray_cannot_decode(headers):
    """Ray's own decoding code is the oracle: every header list it fails on is a 400 here (so Ray never
    sees it), and with UTF-8 names, a 400 here only where Ray would fail."""
    try:
        _ray_reads(headers)
        ray_fails = False
    except UnicodeDecodeError:
        ray_fails = True
    rejected = undecodable_header(headers) is not None
    if ray_fails:
        assert rejected
    names_decode = all(_decodes(name) for name, _ in headers)
    if rejected and names_decode:
        assert ray_fails
    status, response_headers, body, reached = _run_asgi(StrictHeadersMiddleware, headers)
    assert reached is not rejected
    if rejected:
        error = json.loads(body)["error"]
        assert status == 400 and response_headers[b"content-type"] == b"application/json"
        assert error["type"] == "BadRequestError" and error["code"] == 400 and "UTF-8" in error["message"]


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("name", [b"x-request-id", b"x-session-id", b"x-request-timeout-seconds", b"serve_multiplexed_model_id"])
def test_a_raw_byte_in_a_header_ray_decodes_is_a_400_naming_it(name):
    status, _, body, reached = _run_asgi(StrictHeadersMiddleware, [(b"host", b"h"), (name, b"a\xffb")])
    assert (status, reached) == (400, False)
    assert json.loads(body)["error"]["param"] == name.decode()
    # Other headers keep their bytes (Starlette reads them as latin-1, as vLLM does).
    assert _run_asgi(StrictHeadersMiddleware, [(b"user-agent", b"a\xffb"), (b"x-session-id", b"caf\xc3\xa9")])[:1] == (200,)


def test_the_callback_ray_calls_returns_starlette_middleware():
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    assert [m.cls for m in validate_http_proxy_callback_return(middlewares())] == [ServeHintsMiddleware, StrictHeadersMiddleware]


def _ingress_post_routes() -> set[str]:
    from serve_app.ingress import api

    return {r.path for r in api.routes if "POST" in getattr(r, "methods", ())}


def test_one_body_routes_are_the_ingress_routes_that_hold_no_engine_request():
    assert ONE_BODY_ROUTES <= _ingress_post_routes()
    assert _ingress_post_routes() - ONE_BODY_ROUTES == {"/inference/v1/generate", "/v1/chat/completions", "/v1/completions"}


def _hints(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The disconnect hint values Ray's parser would see after :func:`with_serve_hints`."""
    scope = with_serve_hints({"type": "http", "method": method, "path": path, "headers": headers})
    from ray.serve._private.http_util import parse_disconnect_disabled_header

    values = [v for k, v in scope["headers"] if k == b"x-request-disconnect-disabled"]
    assert parse_disconnect_disabled_header(dict(scope["headers"])) is (values == [b"?1"])
    return values


@pytest.mark.parametrize("path", sorted(ONE_BODY_ROUTES))
def test_one_body_routes_skip_serves_disconnect_watch(path):
    assert _hints("POST", path, [(b"host", b"h")]) == [b"?1"]
    assert _hints("POST", path, [(b"x-request-disconnect-disabled", b"?0")]) == [b"?1"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/inference/v1/generate"])
def test_a_client_cannot_switch_off_the_disconnect_watch_of_an_engine_request(path):
    original = [(b"host", b"h"), (b"X-Request-Disconnect-Disabled", b"?1")]
    assert _hints("POST", path, original) == []
    assert original == [(b"host", b"h"), (b"X-Request-Disconnect-Disabled", b"?1")]  # the caller's list is not mutated
    assert _hints("GET", "/v1/chat/completions/derender", [(b"x-request-disconnect-disabled", b"?1")]) == []


def _deadline_app(**limits):
    """BodyDeadlineMiddleware in front of a route that reads the body, with the Ingress's error handlers."""
    from serve_app.ingress import _any_exception

    app = FastAPI()
    app.add_exception_handler(ApiError, _any_exception)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    app.add_middleware(BodyDeadlineMiddleware, **limits)
    return app


def _post(app, chunks, gap_s: float, then_wait_s: float = 0.0):
    """POST /echo with a body sent as ``chunks`` (``None`` forever: one byte at a time), ``gap_s`` apart.
    Returns the response start, its body, and whether the body was complete when the answer began."""
    sent: list = []
    source = iter(chunks) if chunks is not None else iter(lambda: b"x", None)
    state = {"complete": False}

    async def receive():
        if state["complete"]:
            await asyncio.sleep(then_wait_s)
            return {"type": "http.disconnect"}
        await asyncio.sleep(gap_s)
        chunk = next(source, None)
        state["complete"] = chunk is None
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(message):
        if message["type"] == "http.response.start":
            message = {**message, "body_complete": state["complete"]}
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": "/echo", "root_path": "", "query_string": b"", "headers": headers}
    asyncio.run(app(scope, receive, send))
    start = sent[0]
    return start, b"".join(m.get("body", b"") for m in sent[1:]), start["body_complete"]


def test_a_trickled_body_is_a_408_and_the_connection_closes():
    # One byte every 10 ms is 100 B/s, under the 1000 B/s asked for after 50 ms: answered while it still trickles.
    start, body, complete = _post(_deadline_app(base_s=0.05, min_rate=1000), None, gap_s=0.01)
    assert start["status"] == 408 and not complete
    assert (b"connection", b"close") in start["headers"]
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("RequestTimeoutError", 408) and "did not arrive in time" in error["message"]


def test_a_body_that_keeps_coming_is_not_cut_and_a_finished_one_waits_freely():
    # 10 kB a chunk: each buys 20 s at 500 B/s, far past any scheduling delay; after the body the route
    # (and a stream waiting on disconnect) may take as long as it likes.
    start, body, complete = _post(_deadline_app(base_s=0.05, min_rate=500), [b"x" * 10_000] * 20, gap_s=0.01, then_wait_s=0.2)
    assert start["status"] == 200 and complete and json.loads(body) == {"bytes": 200_000}
    assert (b"connection", b"close") not in start["headers"]


# --- OneBodyRoutes: the one-body POST routes answered without FastAPI's router, as FastAPI answers them ---


class _OneBodyOwner:
    """A stand-in Ingress: every one-body route's method answers as the body says."""

    def __init__(self) -> None:
        self.through_fastapi: list[bool] = []  # whether FastAPI's ExceptionMiddleware saw the request

    async def answer(self, request: Request):
        from fastapi.responses import Response

        from serve_app.errors import BadRequestError, ServiceUnavailableError

        self.through_fastapi.append("starlette.exception_handlers" in request.scope)
        how = (await request.body()).decode()
        if how == "api-error":
            raise BadRequestError("bad input", param="messages")
        if how == "unavailable":
            raise ServiceUnavailableError("the stage is down")
        if how == "not-found":
            raise StarletteHTTPException(404, "Not Found")
        if how == "crash":
            raise RuntimeError("boom")
        return Response(json.dumps({"path": request.url.path, "ct": request.headers.get("content-type")}), media_type="application/json")


def _one_body_app(fast: bool):
    """The Ingress's exception handlers and metrics middleware, a route for each one-body path and one
    other POST route; with ``fast``, :class:`OneBodyRoutes` innermost, as the Ingress adds it."""
    from fastapi.responses import Response

    from serve_app.ingress import OneBodyRoutes, api, one_body_routes
    from serve_app.metrics import HttpMetrics, MetricsMiddleware

    owner, http_metrics = _OneBodyOwner(), HttpMetrics()
    app = FastAPI(redirect_slashes=False)
    app.exception_handlers.update(api.exception_handlers)
    for path in sorted(ONE_BODY_ROUTES):
        app.add_api_route(path, owner.answer, methods=["POST"], name="answer")

    @app.post("/other")
    async def other() -> Response:
        return Response(b"{}", media_type="application/json")

    if fast:
        app.add_middleware(OneBodyRoutes, routes=one_body_routes(app, owner), exception_handlers=app.exception_handlers)
    app.add_middleware(MetricsMiddleware, metrics=http_metrics)
    return app, owner, http_metrics


def _answers(app) -> list[tuple]:
    client = TestClient(app, raise_server_exceptions=False)
    out = []
    for path in sorted(ONE_BODY_ROUTES):
        for how in ("ok", "api-error", "unavailable", "not-found", "crash"):
            r = client.post(path, content=how, headers={"content-type": "application/json"})
            out.append((path, how, r.status_code, r.content, sorted((k, v) for k, v in r.headers.items() if k != "date")))
    for method, path in (("GET", "/v1/chat/completions/derender"), ("POST", "/other"), ("POST", "/v1/chat/completions/derender/")):
        r = client.request(method, path)
        out.append((method, path, r.status_code, r.content, sorted((k, v) for k, v in r.headers.items() if k != "date")))
    return out


def test_one_body_routes_answer_as_fastapi_does_without_its_router():
    fast_app, fast_owner, fast_metrics = _one_body_app(fast=True)
    slow_app, slow_owner, slow_metrics = _one_body_app(fast=False)
    fast, slow = _answers(fast_app), _answers(slow_app)
    assert fast == slow
    statuses = {(how, status) for _, how, status, *_ in fast[: 5 * len(ONE_BODY_ROUTES)]}
    assert statuses == {("ok", 200), ("api-error", 400), ("unavailable", 503), ("not-found", 404), ("crash", 500)}
    assert dict(fast[2][4])["retry-after"]  # the 503's Retry-After, from the Ingress's own handler
    # The fast app's route methods ran outside FastAPI's exception middleware, the other's inside it.
    assert fast_owner.through_fastapi == [False] * 5 * len(ONE_BODY_ROUTES)
    assert slow_owner.through_fastapi == [True] * 5 * len(ONE_BODY_ROUTES)
    # The metrics middleware labels both by the matched route template, as before.
    from prometheus_client import generate_latest

    def counts(m) -> list[bytes]:
        return [line for line in generate_latest(m.registry).splitlines() if line.startswith(b"serve_app_http_requests_total")]

    assert counts(fast_metrics) == counts(slow_metrics)
    assert any(b'route="/v1/chat/completions/derender"' in line and b'status="400"' in line for line in counts(fast_metrics))

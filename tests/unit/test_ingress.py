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
from serve_app.ingress import Ingress, stream_id


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

"""``/abort_requests``: any body that is not a JSON object is a 400 in vLLM's envelope, never a 500.

The route method is called on a stand-in ``self`` (no Ray): it only needs the engine handle.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from serve_app.errors import ApiError, envelope
from serve_app.ingress import Ingress


class _Engine:
    def __init__(self) -> None:
        self.aborted: list = []

    def broadcast(self, method: str, request_ids):
        self.aborted.append((method, request_ids))

        async def results_async():
            return None

        return SimpleNamespace(results_async=results_async)


def _abort(body: bytes):
    engine = _Engine()
    owner = SimpleNamespace(_require_engine=lambda: engine, _background=set())

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/abort_requests", "headers": []}, receive)

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

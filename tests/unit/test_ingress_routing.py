"""The Ingress's session-affinity hint: the stream id read from a raw derender body, in linear time."""

from __future__ import annotations

import json
import time

import pytest

from serve_app.ingress import stream_id


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
    start = time.perf_counter()
    stream_id(raw)
    stream_id(raw * 8)
    assert time.perf_counter() - start < 1.0

"""In-memory plain streams (the composed path) answer exactly as the carried-state HTTP API does."""

from __future__ import annotations

import json

import pytest

from serve_app.config import AppArgs
from serve_app.derender.plain import build_plain_service


@pytest.fixture(scope="module")
def service():
    args = AppArgs(model="mistral-sp")
    return build_plain_service(args, args.resolve())


def _chunks(ids: list[int]) -> list[dict]:
    return [
        {"request_id": "r", "choices": [{"index": 0, "token_ids": ids[i : i + 2], "finish_reason": "stop" if i + 2 >= len(ids) else None}]}
        for i in range(0, len(ids), 2)
    ] + [{"request_id": "r", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(ids)}}]


@pytest.mark.parametrize(("kind", "request_field", "original"), [
    ("chat", "chat_request", {"messages": [{"role": "user", "content": "hi"}]}),
    ("completion", "completion_request", {"prompt": "hi"}),
])
def test_feed_equals_http_api(service, kind, request_field, original):
    prompt = [1, 22557, 1526]
    ids = [22557, 1526, 29491, 1183, 12180, 29473, 243, 162, 155, 131, 2]
    opened = getattr(service, f"open_{kind}_stream")(original, prompt, 3)
    call = getattr(service, kind)
    state = None
    for chunk in _chunks(ids):
        fed = opened.feed(chunk)
        body = {"stream": True, "generate_chunk": chunk, "stream_state": state, request_field: original,
                "prompt_token_ids": prompt, "prompt_tokens": 3}
        http = json.loads(call(body))
        state = http["stream_state"]
        assert {k: v for k, v in fed.items() if k != "created"} == {k: v for k, v in http["chunk"].items() if k != "created"}
        assert opened.state == state

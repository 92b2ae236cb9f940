"""Property-based fuzzing of every route over real HTTP: hostile input never gets a 5xx.

Valid bodies for each route are mutated field by field (wrong types, huge and deeply nested values,
out-of-range numbers, dropped fields, unknown keys), and raw random bytes are posted too. Every
answer must be a 2xx (for the harmless mutations) or a 4xx in vLLM's error envelope: never a 5xx,
a hang or a dropped connection. Afterwards the app is still healthy and still answers correctly.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
MESSAGES = [{"role": "user", "content": "Hi"}]
CHUNK = {"request_id": "fuzz", "choices": [{"index": 0, "token_ids": [9707, 1879], "finish_reason": None}]}

# route -> a valid body (engine routes get small max_tokens so a valid mutation stays cheap)
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions/render": {"messages": MESSAGES, "max_tokens": 4},
    "/v1/completions/render": {"prompt": "Hi", "max_tokens": 4},
    "/v1/messages/render": {"model": "qwen3-tiny", "max_tokens": 4, "messages": MESSAGES},
    "/v1/responses/render": {"input": "Hi", "max_output_tokens": 4},
    "/tokenize": {"prompt": "Hello world"},
    "/detokenize": {"tokens": [9707, 1879]},
    "/v1/chat/completions/derender": {
        "generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": [9707, 1879, 151645]}]},
        "prompt_token_ids": PROMPT,
        "chat_request": {"messages": MESSAGES},
    },
    "/v1/completions/derender": {
        "generate_responses": [{"request_id": "g", "choices": [{"index": 0, "token_ids": [9707, 1879]}]}],
        "completion_request": {"prompt": "Hi"},
    },
    "/inference/v1/generate": {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0}},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2, "temperature": 0},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2, "temperature": 0},
    "/abort_requests": {"request_ids": ["fuzz-none"]},
}
STREAM_DERENDER = {"stream": True, "generate_chunk": CHUNK, "prompt_token_ids": PROMPT, "chat_request": {"messages": MESSAGES}}

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**5000, -1, 2**32, 2**64, 0.5, -0.0]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "x" * 100_000, "\ud800", "<|im_end|>", "../../etc/passwd"]),
    st.lists(st.integers(min_value=-5, max_value=2**33), max_size=20),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=4),
    st.sampled_from([[[[[[[[[[[]]]]]]]]]], {"a": {"b": {"c": {}}}}, [None] * 50]),
)
RAW = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"NaN", b'{"messages": NaN}', b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000]),
)


def _mutations(body: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """One field (top level or one level down) replaced, dropped, or an unknown key added."""
    paths = [(k,) for k in body] + [(k, j) for k, v in body.items() if isinstance(v, dict) for j in v]

    def apply(path: tuple, value: Any, action: str) -> dict[str, Any]:
        out = json.loads(json.dumps(body))
        holder = out if len(path) == 1 else out[path[0]]
        if action == "drop":
            holder.pop(path[-1], None)
        elif action == "extra":
            holder["fuzz_unknown_key"] = value
        else:
            holder[path[-1]] = value
        return out

    return st.builds(apply, st.sampled_from(paths), HOSTILE, st.sampled_from(["replace", "replace", "drop", "extra"]))


def _post(client: httpx.Client, route: str, body: Any) -> httpx.Response:
    # json.dumps escapes to ASCII, so lone surrogates travel as valid JSON text; huge ints are written
    # out in full here (the server's own limit is what is under test).
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        content = json.dumps(body).encode()
    finally:
        sys.set_int_max_str_digits(limit)
    return client.post(route, content=content, headers={"content-type": "application/json"})


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and isinstance(error["message"], str) and error["type"]


@pytest.fixture(scope="module")
def client(engine_app_url: str):
    with httpx.Client(base_url=engine_app_url, timeout=120) as c:
        yield c


FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("route", list(ROUTES))
@FUZZ
@given(data=st.data())
def test_mutated_bodies_never_get_a_5xx(client, route, data):
    body = data.draw(_mutations(ROUTES[route]))
    _check(_post(client, route, body))


@FUZZ
@given(data=st.data())
def test_mutated_stream_chunks_never_get_a_5xx(client, data):
    _check(_post(client, "/v1/chat/completions/derender", data.draw(_mutations(STREAM_DERENDER))))


@pytest.mark.parametrize("route", list(ROUTES))
@FUZZ
@given(raw=RAW)
def test_raw_bytes_never_get_a_5xx(client, route, raw):
    _check(client.post(route, content=raw, headers={"content-type": "application/json"}))


def test_the_app_is_healthy_and_correct_afterwards(client):
    assert client.get("/health").status_code == 200
    rendered = client.post("/v1/chat/completions/render", json={"messages": MESSAGES}).json()
    assert rendered["token_ids"][-3:] == [151644, 77091, 198]
    out = client.post("/v1/completions/derender", json=ROUTES["/v1/completions/derender"]).json()
    assert out["choices"][0]["text"] == "Hello world"

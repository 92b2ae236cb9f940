"""Property-based fuzzing of every route over real HTTP: hostile input never gets a 5xx.

Valid bodies for each route (``tests/hostile.py``: chat_request tools and tool_choice, logprob
entries, prompt_logprobs, stream_state, every depth a client can send) are mutated one value at a
time, wherever it sits (wrong types, huge and deeply nested values, out-of-range numbers, lone
surrogates, dropped fields, unknown keys and list entries), and raw random bytes are posted too. Every
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

from tests.hostile import EXAMPLES, MESSAGES, ROUTES, mutations

RAW = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"NaN", b'{"messages": NaN}', b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000]),
)


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


@pytest.mark.parametrize(("route", "body"), EXAMPLES, ids=[f"{r}{' stream' if b.get('stream') else ''}" for r, b in EXAMPLES])
@FUZZ
@given(data=st.data())
def test_mutated_bodies_never_get_a_5xx(client, route, body, data):
    _check(_post(client, route, data.draw(mutations(body))))


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

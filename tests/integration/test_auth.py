"""API keys over real HTTP through Ray Serve: guarded routes answer 401 in the envelope without a key,
probes stay open, and a key from the config works end to end."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import deploy_app

KEY = "sk-test-9f3b"


@pytest.fixture(scope="module")
def keyed_url(serve_instance: None, model_dirs) -> Iterator[str]:
    from ray import serve

    yield deploy_app("keyed", "/keyed", model="mistral-sp", max_model_len=2048, api_key=KEY)
    serve.delete("keyed")  # the rest of the session needs the room


def test_guarded_routes_need_the_key(keyed_url):
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(base_url=keyed_url, timeout=60) as c:
        for method, path, payload in [
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions/render", body),
            ("POST", "/tokenize", {"prompt": "Hi"}),
            ("POST", "/abort_requests", {"request_ids": ["x"]}),
        ]:
            r = c.request(method, path, json=payload)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == 401 and r.headers["www-authenticate"] == "Bearer"
            wrong = c.request(method, path, json=payload, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/v1/models", headers=auth).json()["data"][0]["id"] == "mistral-sp"
        rendered = c.post("/v1/chat/completions/render", json=body, headers=auth)
        assert rendered.status_code == 200 and rendered.json()["token_ids"]
        for probe in ("/health", "/ready", "/metrics", "/version"):
            assert c.get(probe).status_code in (200, 503), probe  # open: never 401
        assert c.get("/health").status_code == 200

"""``serve_app.auth``: API keys as ``vllm serve --api-key``, checked before any route runs."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from serve_app.auth import ApiKeyMiddleware
from serve_app.config import AppArgs

PATHS = ["/v1/models", "/v1/chat/completions", "/inference/v1/generate", "/tokenize", "/detokenize", "/abort_requests", "/health",
         "/ready", "/metrics", "/version"]
GUARDED = {"/v1/models", "/v1/chat/completions", "/inference/v1/generate", "/tokenize", "/detokenize", "/abort_requests"}


@pytest.fixture(scope="module")
def client() -> TestClient:
    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST", "OPTIONS"]) for p in PATHS])
    return TestClient(ApiKeyMiddleware(app, keys=["first-key", "second-key"]))


@pytest.mark.parametrize("path", PATHS)
def test_guarded_routes_need_a_key_and_probes_do_not(client, path):
    bare = client.get(path)
    if path in GUARDED:
        assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
        assert bare.json() == {"error": {"message": "Unauthorized: a valid API key is required.", "type": "Unauthorized",
                                         "param": None, "code": 401}}
    else:
        assert bare.status_code == 200


@pytest.mark.parametrize("authorization", ["Bearer first-key", "Bearer second-key", "bearer second-key"])
def test_any_configured_key_is_accepted(client, authorization):
    assert client.post("/v1/chat/completions", headers={"Authorization": authorization}).status_code == 200


@pytest.mark.parametrize("authorization", ["Bearer wrong", "Bearer first-key2", "Basic first-key", "first-key", "Bearer ", ""])
def test_wrong_or_malformed_keys_are_refused(client, authorization):
    assert client.post("/v1/chat/completions", headers={"Authorization": authorization}).status_code == 401


def test_preflight_passes(client):
    assert client.options("/v1/chat/completions").status_code == 200


def test_keys_come_from_the_config_else_the_environment(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert AppArgs().api_keys() == []
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert AppArgs().api_keys() == ["from-env"]
    args = AppArgs(api_key="from-config")
    assert args.api_keys() == ["from-config"]
    assert "from-config" not in repr(args) and "from-config" not in str(args.model_dump())  # never logged

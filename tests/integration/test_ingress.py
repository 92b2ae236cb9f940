"""The ingress over real HTTP, through Ray Serve's proxy: health, models, version, metrics, envelopes."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def client(app_url: str):
    with httpx.Client(base_url=app_url, timeout=30) as c:
        yield c


def test_health(client):
    r = client.get("/health")
    assert (r.status_code, r.content) == (200, b"")


def test_models_lists_served_name_with_max_model_len(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == ("qwen3-tiny", "model", "vllm", 4096)
    assert card["root"].endswith("qwen3-tiny") and card["permission"][0]["object"] == "model_permission"


def test_version_is_vllms(client):
    assert client.get("/version").json() == {"version": "0.32.0"}


@pytest.mark.parametrize(
    ("method", "path", "status", "err_type"),
    [("GET", "/no/such/route", 404, "Not Found"), ("POST", "/health", 405, "Method Not Allowed")],
)
def test_framework_errors_use_the_envelope(client, method, path, status, err_type):
    r = client.request(method, path)
    assert r.status_code == status
    assert r.json() == {"error": {"message": err_type, "type": err_type, "param": None, "code": status}}


def test_body_over_limit_is_413_from_content_length(client):
    r = client.post("/v1/models", content=b"x" * ((1 << 20) + 1), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "PayloadTooLargeError"


def test_streamed_body_over_limit_is_413_before_parsing(client):
    def chunks():  # no Content-Length: the limit must trip while the body streams in
        for _ in range(20):
            yield b"[" * 65536

    r = client.post("/v1/chat/completions/render", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"] == {
        "message": "Request body exceeds the server maximum of 1048576 bytes.",
        "type": "PayloadTooLargeError",
        "param": None,
        "code": 413,
    }


def test_metrics_count_requests_per_route_template(client):
    def count(text: str, route: str, status: str) -> float:  # summed over Ingress replicas (the ``replica`` label)
        want = {"method": "GET", "route": route, "status": status}
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "serve_app_http_requests_total" and {k: v for k, v in s.labels.items() if k != "replica"} == want
        )

    before = client.get("/metrics").text
    for _ in range(3):
        client.get("/version")
    client.get("/no/such/route")
    after = client.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    assert count(after.text, "/version", "200") - count(before, "/version", "200") == 3
    assert count(after.text, "unmatched", "404") - count(before, "unmatched", "404") == 1
    assert "serve_app_http_request_duration_seconds_bucket" in after.text

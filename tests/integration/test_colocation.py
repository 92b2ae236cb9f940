"""Render, PlainDerender and the parsers colocated in the Ingress answer exactly as the deployed
stages do."""

from __future__ import annotations

import httpx
from ray import serve
from transformers import AutoTokenizer

from tests.harness.metrics import session_outcomes as outcomes_in
from tests.integration.test_parser_derender import CHAT_REQUEST, OUTPUT, _normalize, _stream_http

MESSAGES = [{"role": "user", "content": "Hi there 🦜"}]


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def test_colocated_stages_match_deployed_ones(app_url, colocated_app_url):
    with httpx.Client(timeout=60) as c:
        for path, body in [
            ("/v1/chat/completions/render", {"messages": MESSAGES, "max_tokens": 16}),
            ("/tokenize", {"prompt": "Hello world"}),
        ]:
            a = c.post(app_url + path, json=body, headers={"X-Request-Id": "same"})
            b = c.post(colocated_app_url + path, json=body, headers={"X-Request-Id": "same"})
            assert (a.status_code, a.json()) == (b.status_code, b.json())
        # "length": the special token is text here (a stop on it would leave it out), shown when not skipped
        gens = [{"request_id": "g", "choices": [{"index": 0, "token_ids": [9707, 1879, 11, 151645], "finish_reason": "length"}]}]
        body = {"generate_responses": gens, "completion_request": {"prompt": "x", "skip_special_tokens": False}}
        a = c.post(app_url + "/v1/completions/derender", json=body).json()
        b = c.post(colocated_app_url + "/v1/completions/derender", json=body).json()
        assert _without(a, "created") == _without(b, "created")
        assert b["choices"][0]["text"] == "Hello world,<|im_end|>"
        err = c.post(colocated_app_url + "/v1/chat/completions/render", json={"model": "x", "messages": MESSAGES})
        assert err.status_code == 404 and err.json()["error"]["param"] == "model"


def test_colocated_stages_stay_deployed_for_handle_callers(colocated_app_url):
    import json

    deployments = serve.status().applications["colocated"].deployments
    assert {"Ingress", "Render", "PlainDerender", "ParserDerender"} <= set(deployments)
    render = serve.get_deployment_handle("Render", app_name="colocated")
    rendered = json.loads(render.chat.remote({"messages": MESSAGES}).result())
    assert rendered["token_ids"][-3:] == [151644, 77091, 198]


def session_outcomes(base_url: str) -> dict[str, float]:
    """The Ingress's parser-session counters by outcome, from /metrics."""
    return outcomes_in(httpx.get(base_url + "/metrics", timeout=30).text)


def parser_derender_chunks(app_name: str) -> dict[str, int]:
    """Chunks each live ParserDerender replica of ``app_name`` has looked up (hits and misses). A
    replica killed a moment ago may still be in the handle's view: its call fails, it is left out."""
    parser = serve.get_deployment_handle("ParserDerender", app_name=app_name)
    stats = parser.broadcast("stats").results(timeout_s=60, return_exceptions=True)
    return {s["replica"]: s["hits"] + s["misses"] for s in stats if isinstance(s, dict)}


def test_colocated_parser_stream_matches_parser_derender_deployment(app_url, colocated_app_url, model_dirs):
    """A tool + reasoning stream sent with ``x-session-id`` is derendered by the Ingress's own parsers
    (no Serve hop): chunk for chunk what the ParserDerender deployment produces, every chunk after the
    first a hit in the Ingress's session cache (one Ingress replica: every chunk reaches it). Without
    the header the stream goes to the ParserDerender deployment, with the same chunks."""
    tok = AutoTokenizer.from_pretrained(model_dirs["qwen3-tiny"])
    with httpx.Client(timeout=60) as c:
        prompt = c.post(app_url + "/v1/chat/completions/render", json=CHAT_REQUEST).json()["token_ids"]
    output = tok.encode(OUTPUT) + [tok.convert_tokens_to_ids("<|im_end|>")]
    deployed = [_normalize(c) for c in _stream_http(app_url, "coloc", prompt, output)]

    def deployment_chunks() -> int:
        counts = parser_derender_chunks("colocated")
        assert counts  # every replica that answered, and at least one did
        return sum(counts.values())

    before, deployment_before = session_outcomes(colocated_app_url), deployment_chunks()
    local = _stream_http(colocated_app_url, "coloc", prompt, output, headers={"x-session-id": "coloc"})
    after, deployment_after = session_outcomes(colocated_app_url), deployment_chunks()
    assert [_normalize(c) for c in local] == deployed
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in local)
    assert after.get("hit", 0) - before.get("hit", 0) == len(output) - 1
    assert after.get("miss", 0) == before.get("miss", 0) and deployment_after == deployment_before

    # The Ingress's own cache is exported next to ParserDerender's, labelled by the Ingress replica.
    held = [line for line in httpx.get(colocated_app_url + "/metrics", timeout=30).text.splitlines()
            if line.startswith('serve_app_parser_session_cache_sessions{replica="Ingress:')]
    assert held and float(held[0].rsplit(" ", 1)[1]) >= 1, held

    forwarded = _stream_http(colocated_app_url, "coloc", prompt, output)
    assert [_normalize(c) for c in forwarded] == deployed
    assert deployment_chunks() - deployment_after == len(output) - 1

"""Render and PlainDerender colocated in the Ingress answer exactly as the deployed stages do."""

from __future__ import annotations

import httpx
from ray import serve

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

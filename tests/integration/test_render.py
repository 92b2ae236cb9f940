"""Render endpoints through the ingress over HTTP: shapes, ids, errors, and our fixes."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client(app_url: str):
    with httpx.Client(base_url=app_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs["qwen3-tiny"])


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == status
    return body["error"]


class TestChatRender:
    def test_token_ids_are_the_chat_template(self, client, tok):
        r = client.post("/v1/chat/completions/render", json={"messages": USER}, headers={"X-Request-Id": "rid"})
        body = r.json()
        assert body["request_id"] == "chatcmpl-rid"
        assert body["token_ids"] == tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True)["input_ids"]
        # qwen3-tiny ships Qwen3's generation_config: its defaults reach sampling_params.
        params = body["sampling_params"]
        assert (params["temperature"], params["top_p"], params["top_k"]) == (0.6, 0.95, 20)
        assert params["max_tokens"] == 4096 - len(body["token_ids"])
        assert body["reasoning_ended"] is False  # qwen3 reasoning parser configured, prompt leaves it open

    def test_stream_options_pass_through(self, client):
        body = client.post(
            "/v1/chat/completions/render",
            json={"messages": USER, "stream": True, "stream_options": {"include_usage": True}},
        ).json()
        assert body["stream"] is True and body["stream_options"]["include_usage"] is True
        assert body["sampling_params"]["output_kind"] == 1  # DELTA

    def test_max_tokens_16_is_kept(self, client):
        # vLLM 0.32 omits max_tokens == 16 from sampling_params; generate then ignores the budget.
        body = client.post("/v1/chat/completions/render", json={"messages": USER, "max_tokens": 16}).json()
        assert body["sampling_params"]["max_tokens"] == 16

    def test_unknown_model_is_404(self, client):
        err = _error(client.post("/v1/chat/completions/render", json={"model": "nope", "messages": USER}), 404)
        assert (err["type"], err["param"]) == ("NotFoundError", "model")
        assert err["message"] == "The model `nope` does not exist. Valid aliases: qwen3-tiny."

    def test_beam_search_is_400(self, client):
        err = _error(client.post("/v1/chat/completions/render", json={"messages": USER, "use_beam_search": True}), 400)
        assert err["message"] == "Beam search is not supported by the render endpoint"

    def test_prompt_longer_than_max_model_len_is_400(self, client):
        err = _error(client.post("/v1/chat/completions/render", json={"messages": [{"role": "user", "content": "hi " * 5000}]}), 400)
        assert "maximum context length is 4096 tokens" in err["message"]

    def test_invalid_tool_choice_is_400(self, client):
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        choice = {"type": "function", "function": {"name": "g"}}
        err = _error(client.post("/v1/chat/completions/render", json={"messages": USER, "tools": tools, "tool_choice": choice}), 400)
        assert err["message"].startswith("The tool specified in `tool_choice` does not match any of the specified `tools`")
        assert err["param"] == "tool_choice"

    def test_images_are_refused_for_a_text_only_model(self, client):
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        r = client.post("/v1/chat/completions/render", json={"messages": [{"role": "user", "content": [image]}]})
        assert 400 <= r.status_code < 500
        assert r.json()["error"]["code"] == r.status_code

    @pytest.mark.parametrize(
        ("content", "ctype", "param"),
        [(b"{bad", "application/json", "body.1"), (b'{"messages": "x"}', "application/json", "body.messages"), (b"{}", "text/plain", None)],
    )
    def test_malformed_bodies_are_400_with_the_envelope(self, client, content, ctype, param):
        err = _error(client.post("/v1/chat/completions/render", content=content, headers={"content-type": ctype}), 400)
        assert (err["type"], err["param"]) == ("Bad Request", param)
        assert err["message"].startswith("1 validation error:\n  ")


class TestCompletionRender:
    def test_one_generate_request_per_prompt_with_default_max_tokens(self, client, tok):
        r = client.post("/v1/completions/render", json={"prompt": ["a b", "c"]}, headers={"X-Request-Id": "x"})
        items = r.json()
        assert [i["request_id"] for i in items] == ["cmpl-x-0", "cmpl-x-1"]
        assert [i["token_ids"] for i in items] == [tok.encode("a b"), tok.encode("c")]
        assert all(i["sampling_params"]["max_tokens"] == 16 for i in items)  # OpenAI default, kept

    def test_token_id_prompts(self, client):
        items = client.post("/v1/completions/render", json={"prompt": [[1, 2, 3], [4]]}).json()
        assert [i["token_ids"] for i in items] == [[1, 2, 3], [4]]


class TestOtherRenderRoutes:
    def test_messages_render(self, client, tok):
        body = client.post(
            "/v1/messages/render",
            json={"model": "qwen3-tiny", "max_tokens": 9, "system": "S", "messages": USER},
        ).json()
        msgs = [{"role": "system", "content": "S"}, *USER]
        assert body["token_ids"] == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert body["sampling_params"]["max_tokens"] == 9

    def test_responses_render_is_stateless(self, client):
        body = client.post("/v1/responses/render", json={"input": "Hello", "max_output_tokens": 7}).json()
        assert body["request_id"].startswith("resp_") and body["sampling_params"]["max_tokens"] == 7
        err = _error(client.post("/v1/responses/render", json={"input": "x", "previous_response_id": "resp_1"}), 400)
        assert (err["type"], err["param"]) == ("invalid_request_error", "previous_response_id")

    def test_tokenize_and_detokenize(self, client):
        assert client.post("/tokenize", json={"prompt": "Hello world"}).json() == {
            "count": 2, "max_model_len": 4096, "tokens": [9707, 1879], "token_strs": None,
        }
        assert client.post("/detokenize", json={"tokens": [9707, 1879]}).json() == {"prompt": "Hello world"}
        rendered = client.post("/v1/chat/completions/render", json={"messages": USER}).json()
        assert client.post("/tokenize", json={"messages": USER}).json()["tokens"] == rendered["token_ids"]

"""Derender endpoints through the ingress over HTTP: routing, round trips, errors, light replicas."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.harness.derender_stream import carry_state, split, token_chunks

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def plain(plain_app_url: str):
    with httpx.Client(base_url=plain_app_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def mistral(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs["mistral-sp"])


def _render(client: httpx.Client, **extra) -> dict:
    return client.post("/v1/chat/completions/render", json={"messages": MESSAGES, **extra}).json()


class TestPlainChat:
    def test_round_trip_keeps_the_leading_space(self, plain, mistral):
        rendered = _render(plain)
        ids = mistral.encode("The answer is four.", add_special_tokens=False) + [mistral.eos_token_id]
        body = {
            "generate_response": {"request_id": "generate-tokens-1", "choices": [{"index": 0, "token_ids": ids}]},
            "prompt_tokens": len(rendered["token_ids"]),
            "prompt_token_ids": rendered["token_ids"],
            "chat_request": {"messages": MESSAGES},
        }
        out = plain.post("/v1/chat/completions/derender", json=body).json()
        assert out["object"] == "chat.completion" and out["id"] == "generate-tokens-1"
        assert out["choices"][0]["message"]["content"] == " The answer is four."  # seeded: space kept, </s> skipped
        assert out["usage"] == {
            "prompt_tokens": len(rendered["token_ids"]),
            "total_tokens": len(rendered["token_ids"]) + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        unseeded = plain.post("/v1/chat/completions/derender", json={**body, "prompt_token_ids": None}).json()
        assert unseeded["choices"][0]["message"]["content"] == "The answer is four."

    def test_streaming_one_token_per_chunk_equals_non_streaming(self, plain, mistral):
        ids = mistral.encode("Parrots 🦜 and 日本語", add_special_tokens=False)
        text, roles, state = [], [], None

        def post(body: dict) -> dict:
            return plain.post("/v1/chat/completions/derender", json=body).json()

        for out in carry_state(post, token_chunks(split(ids), "g"), prompt_token_ids=[1, 733]):
            state = out["stream_state"]
            delta = out["chunk"]["choices"][0]["delta"]
            roles.append(delta["role"])
            text.append(delta["content"] or "")
            assert "\ufffd" not in (delta["content"] or "")
        assert roles == ["assistant"] + [None] * (len(ids) - 1)
        assert "".join(text) == " Parrots 🦜 and 日本語"
        assert len(state["prev_tokens"]) <= 8  # bounded window, not the history

    def test_output_mode_text_is_rejected(self, plain):
        gen = {"request_id": "g", "output_mode": "text", "choices": [{"index": 0, "token_ids": [1], "text": "x"}]}
        r = plain.post("/v1/chat/completions/derender", json={"generate_response": gen})
        assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"

    @pytest.mark.parametrize(
        ("state", "message"),
        [
            ({"prev_tokens": ["▁a"], "read_offset": 5}, "invalid stream_state: offsets do not fit prev_tokens"),
            ({"prev_tokens": ["not-a-piece"], "read_offset": 1}, "invalid stream_state: prev_tokens holds pieces outside the vocabulary"),
            ({"prev_tokens": ["▁a"] * 1025}, "prev_tokens length (1025) exceeds maximum (1024)"),
            ({"output_token_ids": [1, 2], "output_chunk_lens": [1]}, "output_chunk_lens must sum to len(output_token_ids)"),
        ],
    )
    def test_tampered_state_is_400(self, plain, state, message):
        chunk = {"request_id": "g", "choices": [{"index": 0, "token_ids": [415]}]}
        r = plain.post("/v1/chat/completions/derender", json={"stream": True, "generate_chunk": chunk, "stream_state": state})
        assert r.status_code == 400
        assert message in r.json()["error"]["message"]

    def test_two_choices_in_one_stream_chunk_is_400(self, plain):
        chunk = {"request_id": "g", "choices": [{"index": 0, "token_ids": [415]}, {"index": 1, "token_ids": [415]}]}
        r = plain.post("/v1/chat/completions/derender", json={"stream": True, "generate_chunk": chunk})
        assert r.json()["error"]["message"] == "derender_chat_stream expects at most one choice per chunk (got 2)."

    def test_oversized_payloads_are_400_before_decoding(self, plain):
        gen = {"request_id": "g", "choices": [{"index": 0, "token_ids": [415] * 2049}]}
        r = plain.post("/v1/chat/completions/derender", json={"generate_response": gen})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "token_ids length (2049) in choice 0 exceeds max_model_len (2048)."
        lp = {"content": [{"token_id": 415, "logprob": -1.0, "top_logprobs": [{"token_id": 1, "logprob": -1.0}] * 21}]}
        chunk = {"request_id": "g", "choices": [{"index": 0, "token_ids": [415], "logprobs": lp}]}
        r = plain.post("/v1/chat/completions/derender", json={"stream": True, "generate_chunk": chunk})
        assert r.json()["error"]["message"] == "top_logprobs count (21) in choice 0 exceeds max_logprobs (20)."


class TestPlainCompletions:
    def test_responses_flatten_and_renumber(self, plain):
        gens = [
            {"request_id": "a", "choices": [{"index": 0, "token_ids": [415]}, {"index": 1, "token_ids": [22557]}]},
            {"request_id": "b", "choices": [{"index": 0, "token_ids": [1526]}]},
        ]
        out = plain.post("/v1/completions/derender", json={"generate_responses": gens, "prompt_tokens": [5, 10]}).json()
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert [c["text"] for c in out["choices"]] == ["The", "Hello", "world"]
        assert out["usage"]["prompt_tokens"] == 15 and out["usage"]["completion_tokens"] == 3

    def test_empty_list_and_length_mismatch_are_400(self, plain):
        assert plain.post("/v1/completions/derender", json={"generate_responses": []}).json()["error"]["message"] == (
            "generate_responses must not be empty"
        )
        gens = [{"request_id": "a", "choices": [{"index": 0, "token_ids": [415]}]}]
        r = plain.post("/v1/completions/derender", json={"generate_responses": gens, "prompt_tokens": [1, 2]})
        assert r.status_code == 400 and "prompt_tokens length (2) must equal generate_responses length (1)" in r.text


def test_plain_derender_replica_stays_light(plain_app_url):
    from ray import serve

    stats = serve.get_deployment_handle("PlainDerender", app_name="plain").stats.remote().result()
    assert stats["heavy_modules"] == []
    print(f"PlainDerender replica peak RSS: {stats['max_rss_bytes'] / 2**20:.0f} MiB")


class TestParserChatDerender:
    """The default app has hermes + qwen3 parsers: chat derender goes through vLLM's parsers."""

    def test_reasoning_and_tool_call_are_split(self, app_url, model_dirs):
        tok = AutoTokenizer.from_pretrained(model_dirs["qwen3-tiny"])
        tools = [
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
            }
        ]
        chat_request = {"messages": MESSAGES, "tools": tools}
        with httpx.Client(base_url=app_url, timeout=60) as c:
            rendered = c.post("/v1/chat/completions/render", json=chat_request).json()
            text = '<think>\nweather time\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            ids = tok.encode(text) + [tok.convert_tokens_to_ids("<|im_end|>")]
            body = {
                "generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": ids}]},
                "prompt_token_ids": rendered["token_ids"],
                "chat_request": chat_request,
            }
            message = c.post("/v1/chat/completions/derender", json=body).json()["choices"][0]["message"]
            assert message["reasoning"].strip() == "weather time"
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == "get_weather" and '"Paris"' in call["function"]["arguments"]
            r = c.post("/v1/chat/completions/derender", json={**body, "chat_request": None})
            assert r.status_code == 400 and "chat_request is required" in r.json()["error"]["message"]

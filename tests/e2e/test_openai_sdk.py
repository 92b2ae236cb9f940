"""The ``openai`` SDK, unchanged, against the composed endpoints: tool calls (streamed too),
reasoning, completions, models and errors."""

from __future__ import annotations

import json

import openai
import pytest

from serve_app.testing.scripted import SCRIPT_KEY
from tests.e2e.test_composed_parity import TOOLS, script_ids


@pytest.fixture(scope="module")
def client(engine_app_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_app_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _scripted(name: str) -> dict:
    return {"vllm_xargs": {SCRIPT_KEY: script_ids(name)}}


def test_models(client):
    assert [m.id for m in client.models.list()] == ["qwen3-tiny"]


def test_tool_call(client):
    resp = client.chat.completions.create(
        model="qwen3-tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        temperature=0,
        extra_body=_scripted("reasoning_then_tool_call"),
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None or choice.message.content.strip() == ""
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert choice.message.reasoning == "\nI should call get_weather for Paris.\n"
    assert resp.id.startswith("chatcmpl-")
    assert resp.usage.completion_tokens == len(script_ids("reasoning_then_tool_call"))


def test_streamed_tool_calls(client):
    stream = client.chat.completions.create(
        model="qwen3-tiny",
        messages=[{"role": "user", "content": "Weather and time in Paris?"}],
        tools=TOOLS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=_scripted("two_tool_calls"),
    )
    calls: dict[int, dict] = {}
    finish, usage, ids = None, None, set()
    for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                slot["name"] += (tc.function and tc.function.name) or ""
                slot["arguments"] += (tc.function and tc.function.arguments) or ""
    assert finish == "tool_calls"
    assert len(ids) == 1
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"city": "Paris"}),
    ]
    assert all(c["id"] for c in calls.values())
    assert usage.completion_tokens == len(script_ids("two_tool_calls"))


def test_completion_stream(client):
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="qwen3-tiny", prompt="Say hi:", max_tokens=10, stream=True,
            extra_body={"vllm_xargs": {SCRIPT_KEY: [9707, 1879, 151645]}},
        )
        if c.choices
    )
    assert text == "Hello world"


def test_errors_are_typed(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == 404 or info.value.status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="qwen3-tiny", messages=[], max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="qwen3-tiny", prompt="x", max_tokens=100000)


def test_structured_outputs_need_a_tokenizer_in_the_engine(client):
    """A tokens-only engine (the CPU demo setting, as `vllm serve --tokens-only`) cannot constrain decoding:
    a clean 400, not a hang or a 500. `engine.tokens_only: false` lifts this."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="qwen3-tiny", messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required"
        )
    assert "tokenizer" in str(info.value)


@pytest.fixture  # one test: deleted right after it, so the next engine app has room
def tokenizer_engine_url(serve_instance, model_dirs) -> str:
    """A second app whose engine loads the tokenizer (``engine.tokens_only: false``)."""
    from ray import serve

    from tests.conftest import CPU_ENGINE, QWEN3_PARSER_ARGS, SCRIPTED_LOGITS_PROCESSOR, deploy_app

    url = deploy_app(
        "engine_tok",
        "/engine-tok",
        model="qwen3-tiny",
        **QWEN3_PARSER_ARGS,
        colocate_in_ingress=["render", "plain_derender"],
        engine={"enabled": True, **CPU_ENGINE, "tokens_only": False, "logits_processors": [SCRIPTED_LOGITS_PROCESSOR]},
    )
    yield url
    serve.delete("engine_tok")


def test_structured_outputs_with_a_tokenizer_engine(tokenizer_engine_url):
    import httpx

    from tests.e2e.test_composed_parity import TOOLS as tools

    client = openai.OpenAI(base_url=tokenizer_engine_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    from transformers import AutoTokenizer

    from serve_app.models import ensure_model

    tok = AutoTokenizer.from_pretrained(str(ensure_model("qwen3-tiny")))
    # vLLM 0.32 constrains `required` with a structural tag in the hermes format; thinking is off so
    # the constraint applies from the first output token (the prompt already closes </think>).
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    script = tok.encode(call_text, add_special_tokens=False)
    resp = client.chat.completions.create(
        model="qwen3-tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_tokens=60,
        extra_body={"vllm_xargs": {SCRIPT_KEY: script}, "chat_template_kwargs": {"enable_thinking": False}},
    )
    (call,) = resp.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    # The engine knows EOS and stop strings now.
    body = {"token_ids": [151644, 872, 198], "sampling_params": {"temperature": 0, "max_tokens": 5, "stop": ["zz"]}}
    out = httpx.post(tokenizer_engine_url + "/inference/v1/generate", json=body, timeout=60)
    assert out.status_code == 200, out.text
    assert out.json()["output_mode"] == "tokens"


@pytest.fixture  # one test: deleted right after it
def no_parser_engine_url(serve_instance, model_dirs) -> str:
    """The engine with no tool or reasoning parser: composed chat derenders through PlainDerender's service."""
    from ray import serve

    from tests.conftest import CPU_ENGINE, SCRIPTED_LOGITS_PROCESSOR, deploy_app

    url = deploy_app(
        "engine_plain",
        "/engine-plain",
        model="qwen3-tiny",
        engine={"enabled": True, **CPU_ENGINE, "logits_processors": [SCRIPTED_LOGITS_PROCESSOR]},
    )
    yield url
    serve.delete("engine_plain")


def test_chat_without_parsers(no_parser_engine_url):
    client = openai.OpenAI(base_url=no_parser_engine_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ids = script_ids("reasoning_then_tool_call")
    kwargs = {
        "model": "qwen3-tiny",
        "messages": [{"role": "user", "content": "Weather?"}],
        "temperature": 0.7,  # n > 1 needs sampling; the script decides the tokens anyway
        "seed": 5,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 1,
        "extra_body": {"vllm_xargs": {SCRIPT_KEY: ids}},
    }
    whole = client.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content
    assert "<tool_call>" in text and whole.choices[0].message.tool_calls is None  # no parser: plain text
    assert [c.message.content for c in whole.choices] == [text, text]
    assert whole.usage.completion_tokens == 2 * len(ids)
    streamed: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            assert c.logprobs is None or all(lp.token is not None for lp in c.logprobs.content)
    assert streamed == {0: text, 1: text}
    assert usage.completion_tokens == whole.usage.completion_tokens

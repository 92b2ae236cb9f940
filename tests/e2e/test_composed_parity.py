"""Composed ``/v1/chat/completions`` and ``/v1/completions`` against coupled ``vllm serve`` (same model
directory, hermes + qwen3 parsers, auto tool choice), through the ``openai`` SDK on both sides.

Both engines load the scripted-output logits processor, so the model "says" realistic Qwen3 outputs
(``<think>`` blocks, hermes ``<tool_call>`` JSON, truncation mid call); unscripted requests compare
the random model's own greedy output. Compared: content, reasoning, tool calls (type, name,
arguments; ids are random on both sides), finish_reason, usage and logprobs, streaming and not.
"""

from __future__ import annotations

import json
from functools import cache

import openai
import pytest

from serve_app.testing.scripted import SCRIPT_KEY
from tests.harness.payloads import WEATHER_AND_TIME_TOOLS as TOOLS

MESSAGES = [{"role": "user", "content": "What's the weather in Paris? Answer briefly."}]

SCRIPTS = {
    "reasoning_then_answer": "<think>\nThe user asks about the weather in Paris. I cannot look it up, so I answer "
    "honestly.\n</think>\n\nI don't have live weather data, but Paris is usually mild in spring. ☀️<|im_end|>",
    "reasoning_then_tool_call": "<think>\nI should call get_weather for Paris.\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>',
    "two_tool_calls": "<think>\nTwo lookups.\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "tool_call_without_reasoning": '<tool_call>\n{"name": "get_time", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>',
    "answer_without_think": "Paris is 18 degrees and sunny today.<|im_end|>",
    "cut_mid_tool_call": "<think>\nok\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Par',
    # issue 10: the final token before EOS is text like any other
    "answer_ends_on_emoji": "<think>\nok\n</think>\n\n你好世界 😀<|im_end|>",
    "answer_past_a_period": "The answer is four. Then more text.<|im_end|>",
}


@cache
def _tokenizer():
    from transformers import AutoTokenizer

    from serve_app.models import ensure_model

    return AutoTokenizer.from_pretrained(str(ensure_model("qwen3-tiny")))


def script_ids(name: str) -> list[int]:
    return _tokenizer().encode(SCRIPTS[name], add_special_tokens=False)


@pytest.fixture(scope="module")
def clients(engine_app_url, vllm_coupled) -> tuple[openai.OpenAI, openai.OpenAI]:
    ours = openai.OpenAI(base_url=engine_app_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    theirs = openai.OpenAI(base_url=vllm_coupled.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return ours, theirs


def _tool_calls(calls) -> list[dict] | None:
    if not calls:
        return None
    return [{"type": c.type, "name": c.function.name, "arguments": c.function.arguments} for c in calls]


def _message_view(resp) -> dict:
    return {
        "choices": [
            {
                "index": c.index,
                "content": c.message.content,
                "reasoning": getattr(c.message, "reasoning", None),
                "tool_calls": _tool_calls(c.message.tool_calls),
                "finish_reason": c.finish_reason,
                "stop_reason": getattr(c, "stop_reason", "absent"),
                "logprobs": c.logprobs.model_dump() if c.logprobs else None,
            }
            for c in sorted(resp.choices, key=lambda c: c.index)
        ],
        "usage": (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens),
        "object": resp.object,
        "model": resp.model,
    }


def _stream_view(stream) -> dict:
    """Accumulate a chat stream per choice, the way an SDK user would."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens)
        for c in chunk.choices:
            acc = choices.setdefault(
                c.index, {"content": "", "reasoning": "", "tool_calls": {}, "finish_reason": None, "logprobs": []}
            )
            delta = c.delta
            acc["content"] += delta.content or ""
            acc["reasoning"] += getattr(delta, "reasoning", None) or ""
            for tc in delta.tool_calls or []:
                slot = acc["tool_calls"].setdefault(tc.index, {"type": None, "name": "", "arguments": "", "ids": set()})
                if tc.id:
                    slot["ids"].add(tc.id)
                if tc.type:
                    slot["type"] = tc.type
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            if c.finish_reason is not None:
                acc["finish_reason"] = c.finish_reason
            if c.logprobs and c.logprobs.content:
                acc["logprobs"] += [lp.model_dump() for lp in c.logprobs.content]
    for acc in choices.values():
        for slot in acc["tool_calls"].values():
            assert len(slot["ids"]) == 1, "one id per streamed tool call"
            slot.pop("ids")
    return {"choices": dict(sorted(choices.items())), "usage": usage}


CHAT_CASES = [
    pytest.param(None, {}, id="unscripted"),
    pytest.param(None, {"logprobs": True, "top_logprobs": 2, "max_tokens": 12}, id="unscripted_logprobs"),
    *(pytest.param(name, {}, id=name) for name in SCRIPTS),
    pytest.param("reasoning_then_tool_call", {"tool_choice": "none"}, id="tool_choice_none"),
    pytest.param("reasoning_then_answer", {"n": 2, "temperature": 0.7, "seed": 3}, id="n2"),
    pytest.param("reasoning_then_tool_call", {"max_tokens": 9}, id="length_in_reasoning"),
    pytest.param("reasoning_then_answer", {"extra_body_kwargs": {"chat_template_kwargs": {"enable_thinking": False}}}, id="thinking_off"),
    pytest.param("answer_without_think", {"extra_body_kwargs": {"skip_special_tokens": False}}, id="eos_with_special_tokens_shown"),
    pytest.param(
        "answer_without_think",
        {"extra_body_kwargs": {"skip_special_tokens": False, "include_stop_str_in_output": True}},
        id="include_stop_str_in_output",
    ),
    # the engine stops on "." from stop_token_ids: stop_reason names it and its text is left out
    pytest.param("answer_past_a_period", {"extra_body_kwargs": {"stop_token_ids": "<the period's id>"}}, id="stop_token_ids_hit"),
]


def _chat_kwargs(script: str | None, extra: dict) -> dict:
    extra = dict(extra)
    extra_body = dict(extra.pop("extra_body_kwargs", {}))
    if "stop_token_ids" in extra_body:
        extra_body["stop_token_ids"] = _tokenizer().encode(".", add_special_tokens=False)
    kwargs = {"model": "qwen3-tiny", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 120, **extra}
    if script is not None:
        extra_body = {**extra_body, "vllm_xargs": {SCRIPT_KEY: script_ids(script)}}
    if extra_body:
        kwargs["extra_body"] = extra_body
    return kwargs


@pytest.mark.parametrize(("script", "extra"), CHAT_CASES)
def test_chat_non_streaming_equals_vllm(clients, script, extra):
    ours, theirs = clients
    kwargs = _chat_kwargs(script, extra)
    a = _message_view(ours.chat.completions.create(**kwargs))
    b = _message_view(theirs.chat.completions.create(**kwargs))
    assert a == b


@pytest.mark.parametrize(("script", "extra"), CHAT_CASES)
def test_chat_streaming_equals_vllm(clients, script, extra):
    ours, theirs = clients
    kwargs = {**_chat_kwargs(script, extra), "stream": True, "stream_options": {"include_usage": True}}
    a = _stream_view(ours.chat.completions.create(**kwargs))
    b = _stream_view(theirs.chat.completions.create(**kwargs))
    assert a == b
    assert a["usage"] is not None


def test_streaming_concatenates_to_non_streaming(clients):
    ours, _ = clients
    kwargs = _chat_kwargs("two_tool_calls", {})
    whole = ours.chat.completions.create(**kwargs).choices[0]
    streamed = _stream_view(ours.chat.completions.create(**kwargs, stream=True))["choices"][0]
    assert streamed["finish_reason"] == whole.finish_reason == "tool_calls"
    assert [
        {"type": "function", **t} for t in ([{k: v for k, v in s.items() if k != "type"} for s in streamed["tool_calls"].values()])
    ] == _tool_calls(whole.message.tool_calls)
    assert [json.loads(c.function.arguments) for c in whole.message.tool_calls] == [{"city": "Paris"}, {"city": "Paris"}]
    assert streamed["reasoning"] == whole.message.reasoning == "\nTwo lookups.\n"


def _completion_view(resp) -> dict:
    return {
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": c.logprobs.model_dump() if c.logprobs else None,
            }
            for c in sorted(resp.choices, key=lambda c: c.index)
        ],
        "usage": (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens),
    }


def _completion_stream_view(stream) -> dict:
    choices: dict[int, dict] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens)
        for c in chunk.choices:
            acc = choices.setdefault(c.index, {"text": "", "finish_reason": None, "tokens": []})
            acc["text"] += c.text
            if c.finish_reason is not None:
                acc["finish_reason"] = c.finish_reason
            if c.logprobs and c.logprobs.tokens:
                acc["tokens"] += c.logprobs.tokens
    return {"choices": dict(sorted(choices.items())), "usage": usage}


COMPLETION_CASES = [
    pytest.param({"prompt": "The capital of France is"}, id="unscripted"),
    pytest.param({"prompt": "Say hi:", "extra_body": {"vllm_xargs": {SCRIPT_KEY: [9707, 0, 1879, 151645]}}}, id="scripted"),
    pytest.param(
        {"prompt": "Say hi:", "extra_body": {"vllm_xargs": {SCRIPT_KEY: [9707, 0, 1879, 151645]}, "skip_special_tokens": False}},
        id="scripted_eos_with_special_tokens_shown",
    ),
    pytest.param(  # "Hello" "!" " world": the engine stops on "!" (id 0) from stop_token_ids
        {"prompt": "Say hi:", "extra_body": {"vllm_xargs": {SCRIPT_KEY: [9707, 0, 1879, 151645]}, "stop_token_ids": [0]}},
        id="scripted_stop_token_ids_hit",
    ),
    pytest.param({"prompt": ["One", "Two three"]}, id="two_prompts"),
    pytest.param({"prompt": "Count:", "logprobs": 2}, id="logprobs"),
    pytest.param({"prompt": "Count:", "n": 2, "temperature": 0.8, "seed": 11}, id="n2"),
]


@pytest.mark.parametrize("extra", COMPLETION_CASES)
@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_vllm(clients, extra, stream):
    ours, theirs = clients
    kwargs = {"model": "qwen3-tiny", "temperature": 0, "max_tokens": 10, **extra}
    if stream:
        kwargs |= {"stream": True, "stream_options": {"include_usage": True}}
        view = _completion_stream_view
    else:
        view = _completion_view
    assert view(ours.completions.create(**kwargs)) == view(theirs.completions.create(**kwargs))

"""``serve_app.client``: render, generate and derender by handle, from the driver and from the
documented example deployment (``examples/by_handle.py``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_app.testing.scripted import SCRIPT_KEY

TOOL_SCRIPT = (
    '<think>\nweather lookup\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    "<|im_end|>"
)


@pytest.fixture(scope="module")
def tool_script() -> list[int]:
    from transformers import AutoTokenizer

    from serve_app.models import ensure_model

    return AutoTokenizer.from_pretrained(str(ensure_model("qwen3-tiny"))).encode(TOOL_SCRIPT, add_special_tokens=False)


def test_stages_by_handle(engine_app_url):
    from serve_app.client import ServeAppClient

    async def run() -> tuple:
        client = ServeAppClient("engine_app")
        request = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}
        gen = await client.render_chat(request)
        out = await client.generate(gen)
        chunks = [c async for c in client.generate_stream(gen)]
        chat = await client.derender_chat(out, chat_request=request, prompt_token_ids=gen["token_ids"])
        composed = await client.chat(request)
        streamed = [c async for c in client.chat_stream(request)]
        completion_gens = await client.render_completion({"prompt": ["a", "b c"], "max_tokens": 3, "temperature": 0})
        outs = [await client.generate(g) for g in completion_gens]
        completion = await client.derender_completion(
            outs, completion_request={"prompt": ["a", "b c"]}, prompt_token_ids=[g["token_ids"] for g in completion_gens]
        )
        return gen, out, chunks, chat, composed, streamed, completion

    gen, out, chunks, chat, composed, streamed, completion = asyncio.run(run())
    assert gen["token_ids"][-3:] == [151644, 77091, 198]
    assert len(out.choices[0].token_ids) == 6
    assert [t for c in chunks for ch in c.choices for t in ch.token_ids or []] == out.choices[0].token_ids
    assert chat["object"] == composed["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == composed["choices"][0]["message"]  # greedy: same tokens
    assert composed["id"] == gen["request_id"] or composed["id"].startswith("chatcmpl-")
    text = "".join((c["choices"][0]["delta"].get("content") or "") + (c["choices"][0]["delta"].get("reasoning") or "")
                   for c in streamed if c["choices"])
    message = composed["choices"][0]["message"]
    assert text == (message["content"] or "") + (message["reasoning"] or "")
    assert [c["index"] for c in completion["choices"]] == [0, 1]
    assert completion["usage"]["completion_tokens"] == 6


def test_errors_by_handle_are_api_errors(engine_app_url):
    from serve_app.client import ServeAppClient
    from serve_app.errors import ApiError

    async def run() -> None:
        await ServeAppClient("engine_app").generate({"token_ids": [], "sampling_params": {}})

    with pytest.raises(ApiError) as info:
        asyncio.run(run())
    assert info.value.status_code == 400


def test_example_deployment(engine_app_url, tool_script):
    from ray import serve

    from examples.by_handle import Assistant

    handle = serve.run(Assistant.bind("engine_app"), name="assistant", route_prefix=None)
    try:
        answer = handle.ask.remote("Weather in Paris?", temperature=0, vllm_xargs={SCRIPT_KEY: tool_script}).result(timeout_s=120)
        assert answer["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
        assert answer["finish_reason"] == "tool_calls"
        assert answer["reasoning"] == "\nweather lookup\n"
        assert answer["usage"]["completion_tokens"] == len(tool_script)
        hello_ids = [151667, 198, 151668, 271, 9707, 1879, 151645]  # "<think>\n</think>\n\nHello world<|im_end|>"
        hello = handle.ask_stream.remote("Hi", temperature=0, vllm_xargs={SCRIPT_KEY: hello_ids}).result(timeout_s=120)
        assert hello.lstrip("\n") == "Hello world"  # vLLM's qwen3 parser keeps the "\n\n" after </think>
    finally:
        serve.delete("assistant")


def _without_volatile(obj):
    """A response or chunk without what differs between two runs: ``id`` and ``created``."""
    if isinstance(obj, dict):
        return {k: _without_volatile(v) for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(obj, list):
        return [_without_volatile(v) for v in obj]
    return obj


def _chat_stream_view(chunks: list[dict]) -> dict:
    """A chat stream as a client reads it, whatever its chunking: text and token ids concatenated per
    choice, each other field's values that are set, the last usage. (The engine's output collector
    merges the tokens that are ready when its consumer lags, so two runs may chunk differently.)"""
    view: dict = {"top": set(), "choices": {}, "usage": None}
    for chunk in chunks:
        view["top"] |= {(k, json.dumps(v)) for k, v in chunk.items() if k not in ("id", "created", "choices", "usage")}
        view["usage"] = chunk.get("usage") or view["usage"]
        for choice in chunk["choices"]:
            slot = view["choices"].setdefault(choice["index"], {"content": "", "reasoning": "", "token_ids": []})
            delta = choice["delta"]
            slot["content"] += delta.get("content") or ""
            slot["reasoning"] += delta.get("reasoning") or ""
            slot["token_ids"] += choice.get("token_ids") or []
            for key, value in [*delta.items(), *choice.items()]:
                if key not in ("content", "reasoning", "delta", "index", "token_ids") and value is not None:
                    slot.setdefault(key, []).append(value)
    return view


@pytest.mark.parametrize(
    ("script", "extra"),
    [
        ("<think>\nok\n</think>\n\nThe answer is four.<|im_end|>", {}),  # EOS: dropped, "." kept
        ("<think>\nok\n</think>\n\n你好世界 😀<|im_end|>", {"skip_special_tokens": False}),
        ("<think>\nok\n</think>\n\nThe answer is four. And more.<|im_end|>", {"stop_token_ids": "period"}),  # the engine stops on "."
    ],
    ids=["eos", "emoji_then_eos_special_shown", "stop_token_ids_hit"],
)
def test_client_chat_equals_the_http_route(engine_app_url, script, extra):
    """``ServeAppClient.chat`` / ``chat_stream`` answer exactly what ``/v1/chat/completions`` does."""
    import httpx
    from transformers import AutoTokenizer

    from serve_app.client import ServeAppClient
    from serve_app.models import ensure_model

    tok = AutoTokenizer.from_pretrained(str(ensure_model("qwen3-tiny")))
    if extra.get("stop_token_ids"):
        extra = {**extra, "stop_token_ids": tok.encode(".", add_special_tokens=False)}
    request = {
        "model": "qwen3-tiny",
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "temperature": 0,
        "vllm_xargs": {SCRIPT_KEY: tok.encode(script, add_special_tokens=False)},
        **extra,
    }
    streamed_request = {**request, "stream": True, "stream_options": {"include_usage": True}}

    async def by_handle() -> tuple:
        client = ServeAppClient("engine_app")
        return await client.chat(request), [c async for c in client.chat_stream(streamed_request)]

    whole, chunks = asyncio.run(by_handle())
    with httpx.Client(timeout=120) as http:
        http_whole = http.post(f"{engine_app_url}/v1/chat/completions", json=request).json()
        with http.stream("POST", f"{engine_app_url}/v1/chat/completions", json=streamed_request) as response:
            lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert _without_volatile(whole) == _without_volatile(http_whole)
    assert _chat_stream_view(chunks) == _chat_stream_view([json.loads(line) for line in lines[:-1]])

    (choice,) = whole["choices"]
    answer = script.split("</think>\n\n")[-1]
    if extra.get("stop_token_ids"):
        assert choice["message"]["content"].lstrip("\n") == "The answer is four"  # the stop token's text only
        assert choice["stop_reason"] == extra["stop_token_ids"][0]
    else:
        assert choice["message"]["content"].lstrip("\n") == answer.removesuffix("<|im_end|>")
        assert choice["stop_reason"] is None  # EOS, as coupled vllm serve reports it
    assert choice["finish_reason"] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == choice["message"]["content"]

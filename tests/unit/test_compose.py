"""``serve_app.compose``: the composition core, with the real plain derender (qwen3-tiny's tokenizer)
and stand-in render / engine stages (the real ones run in tests/integration and tests/e2e)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serve_app.compose import ComposedService, Stages, merge
from serve_app.config import AppArgs
from serve_app.derender.plain import build_plain_service
from serve_app.errors import ApiError, BadRequestError
from serve_app.stages import InProcess

HELLO = [9707, 0, 1879]  # "Hello" "!" " world"
EOS = 151645


@pytest.fixture(scope="module")
def plain():
    args = AppArgs(model="qwen3-tiny")
    return build_plain_service(args, args.resolve())


class FakeEngine:
    """Scripted engine streams per prompt; records which streams were closed and which calls cancelled."""

    def __init__(self, outputs: dict[int, list[Any]]) -> None:
        self.outputs = outputs  # prompt's first token id -> chunks (dicts) or an exception to raise
        self.closed: list[int] = []
        self.cancelled: list[int] = []

    async def stream(self, gen: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        key = gen["token_ids"][0]
        try:
            for item in self.outputs[key]:
                await asyncio.sleep(0)
                if isinstance(item, Exception):
                    raise item
                yield json.loads(json.dumps(item))
        finally:
            self.closed.append(key)

    async def generate(self, gen: dict[str, Any]) -> bytes:
        key = gen["token_ids"][0]
        try:
            await asyncio.sleep(0.01 * key)
            item = self.outputs[key]
            if isinstance(item, Exception):
                raise item
            return json.dumps(item).encode()
        except asyncio.CancelledError:
            self.cancelled.append(key)
            raise


def _service(
    plain, engine: FakeEngine, prompts: list[list[int]], n: int = 1, first_chunk_timeout_s: float | None = None
) -> ComposedService:
    def gen(i: int, ids: list[int], body: dict) -> dict[str, Any]:
        rid = "cmpl-r" + (f"-{i}" if len(prompts) > 1 else "")
        # as vLLM's render: stream_options (parsed) only on a stream
        options = body.get("stream_options") if body.get("stream") else None
        return {"request_id": rid, "token_ids": ids, "sampling_params": {"n": n, "stop_token_ids": None}, "stream_options": options}

    async def render_chat(body: dict, rid: str | None) -> bytes:
        return json.dumps(gen(0, prompts[0], body)).encode()

    async def render_completion(body: dict, rid: str | None) -> bytes:
        return json.dumps([gen(i, p, body) for i, p in enumerate(prompts)]).encode()

    stages = Stages(render_chat, render_completion, engine.generate, engine.stream)
    return ComposedService(stages, plain, plain, EOS, first_chunk_timeout_s=first_chunk_timeout_s)


def _chunk(ids: list[int], finish: str | None = None, index: int = 0, stop_reason: Any = None) -> dict[str, Any]:
    return {"request_id": "engine-id", "choices": [{"index": index, "token_ids": ids, "finish_reason": finish, "stop_reason": stop_reason}]}


async def _collect(out: Any) -> list[dict[str, Any]]:
    return [c async for c in out]


def test_chat_stream_maps_ids_and_the_eos_stop_reason(plain):
    engine = FakeEngine({1: [_chunk(HELLO[:2]), _chunk([HELLO[2], EOS], "stop", stop_reason=EOS)]})
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    chunks = asyncio.run(_stream(_service(plain, engine, [[1]]).chat(body)))
    assert [c["id"] for c in chunks] == ["cmpl-r", "cmpl-r"]  # render's id, not the engine's
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks) == "Hello! world"  # EOS text left out
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] is None  # as coupled vllm serve reports EOS
    assert engine.closed == [1]


async def _stream(call: Any) -> list[dict[str, Any]]:
    return await _collect(await call)


def test_a_stream_that_fails_after_it_started_ends_with_the_in_band_error(plain):
    engine = FakeEngine({1: [_chunk(HELLO[:1]), RuntimeError("engine died")]})
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    chunks = asyncio.run(_stream(_service(plain, engine, [[1]]).chat(body)))
    assert chunks[0]["choices"][0]["delta"]["content"] == "Hello"
    assert chunks[-1]["error"]["code"] == 500 and "engine died" in chunks[-1]["error"]["message"]
    assert engine.closed == [1]


def test_an_error_before_the_first_chunk_is_raised_not_streamed(plain):
    engine = FakeEngine({1: [BadRequestError("too long")]})
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    with pytest.raises(BadRequestError):
        asyncio.run(_service(plain, engine, [[1]]).chat(body))
    assert engine.closed == [1]


def test_multi_prompt_stream_merges_indices_ids_and_usage(plain):
    engine = FakeEngine(
        {
            1: [
                _chunk(HELLO[:1], index=0),
                _chunk(HELLO[:1], index=1),
                _chunk(HELLO[1:], "length", index=0),
                _chunk(HELLO[1:], "length", index=1),
            ],
            2: [_chunk(HELLO, "length", index=0), _chunk(HELLO, "length", index=1)],
        }
    )
    body = {"prompt": ["a", "b"], "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    chunks = asyncio.run(_stream(_service(plain, engine, [[1], [2]], n=2).completion(body)))
    text: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
    assert text == {0: "Hello! world", 1: "Hello! world", 2: "Hello! world", 3: "Hello! world"}
    assert {c["id"] for c in chunks} == {"cmpl-r"}  # "<id>-<i>" per prompt becomes the request's id
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4 * 3
    assert sorted(engine.closed) == [1, 2]


def test_multi_prompt_stream_failure_closes_every_stream_and_reports_in_band(plain):
    forever = [_chunk(HELLO[:1])] * 50
    engine = FakeEngine({1: [_chunk(HELLO[:1]), RuntimeError("prompt 1 failed")], 2: forever})
    body = {"prompt": ["a", "b"], "stream": True}
    chunks = asyncio.run(_stream(_service(plain, engine, [[1], [2]]).completion(body)))
    assert "prompt 1 failed" in chunks[-1]["error"]["message"]
    assert len(chunks) < 50  # the other prompt stopped, not drained
    assert sorted(engine.closed) == [1, 2]


def test_multi_prompt_failure_without_streaming_cancels_the_other_prompts(plain):
    engine = FakeEngine({1: BadRequestError("prompt 1 refused"), 5: {"request_id": "x", "choices": [{"index": 0, "token_ids": HELLO}]}})
    with pytest.raises(ApiError) as info:
        asyncio.run(_service(plain, engine, [[1], [5]]).completion({"prompt": ["a", "b"]}))
    assert info.value.status_code == 400
    assert engine.cancelled == [5]  # still generating when prompt 1 failed: cancelled, not left running


def test_a_stream_flag_that_is_not_a_boolean_is_a_400_before_render(plain):
    engine = FakeEngine({})
    with pytest.raises(ApiError) as info:
        asyncio.run(_service(plain, engine, [[1]]).chat({"messages": [], "stream": "false"}))
    assert info.value.status_code == 400


def test_merge_interleaves_and_tags_streams():
    async def stream(tag: str, n: int) -> AsyncIterator[dict[str, Any]]:
        for i in range(n):
            await asyncio.sleep(0)
            yield {"tag": tag, "i": i}

    async def run() -> list:
        return [(i, c["tag"], c["i"]) async for i, c in merge([stream("a", 3), stream("b", 2)])]

    out = asyncio.run(run())
    assert sorted(out) == [(0, "a", 0), (0, "a", 1), (0, "a", 2), (1, "b", 0), (1, "b", 1)]
    assert [x for x in out if x[0] == 0] == [(0, "a", 0), (0, "a", 1), (0, "a", 2)]  # each stream's order kept


def test_an_engine_without_a_first_chunk_in_time_is_a_504_and_its_stream_is_closed(plain):
    class Stuck(FakeEngine):
        async def stream(self, gen):
            try:
                await asyncio.sleep(3600)
                yield {}
            finally:
                self.closed.append(gen["token_ids"][0])

    engine = Stuck({})
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    with pytest.raises(ApiError) as info:
        asyncio.run(_service(plain, engine, [[1]], first_chunk_timeout_s=0.05).chat(body))
    assert info.value.status_code == 504
    assert engine.closed == [1]  # the engine request is cancelled, not left generating


def test_a_colocated_plain_derender_is_awaited_through_its_async_twin(plain):
    """InProcess (the Ingress's colocated stages) calls ``chat_async`` for ``chat``: a big request
    decodes off the Ingress's event loop (tests/unit/test_plain_service.py shows the ordering)."""
    stage = InProcess(plain)
    assert stage.chat.remote == plain.chat_async and stage.completion.remote == plain.completion_async
    body = {"generate_response": {"request_id": "r", "choices": [{"index": 0, "token_ids": HELLO}]}}
    assert json.loads(asyncio.run(stage.chat.remote(body)))["choices"][0]["message"]["content"] == "Hello! world"


def test_composed_chat_awaits_the_chat_derenders_async_twin(plain):
    """Non-streaming composed chat awaits ``chat_async`` (plain derender's, or the parser service's),
    which decodes and parses a big response off the Ingress's event loop; never the sync ``chat``."""

    class Derender:
        def __init__(self) -> None:
            self.calls = 0

        def chat(self, body: dict) -> bytes:
            raise AssertionError("the sync chat, on the event loop")

        async def chat_async(self, body: dict) -> bytes:
            self.calls += 1
            return await plain.chat_async(body)

    engine = FakeEngine({1: {"request_id": "e", "choices": [{"index": 0, "token_ids": HELLO, "finish_reason": "length"}]}})
    service = _service(plain, engine, [[1]])
    service.chat_derender = derender = Derender()  # type: ignore[assignment]
    out = asyncio.run(service.chat({"messages": [{"role": "user", "content": "x"}]}))
    assert json.loads(out)["choices"][0]["message"]["content"] == "Hello! world" and derender.calls == 1


def test_render_gets_the_raw_body_when_the_caller_has_it(plain):
    """The HTTP routes hand render the request's JSON bytes (its size lets a small chat's template run
    on the event loop, tests/unit/test_render.py); a caller by handle, with a dict only, hands the dict."""
    engine = FakeEngine({1: {"request_id": "e", "choices": [{"index": 0, "token_ids": HELLO, "finish_reason": "length"}]}})
    service = _service(plain, engine, [[1]])
    seen: list[object] = []

    def recording(render):
        async def call(body, rid):
            seen.append(body)
            return await render(body if isinstance(body, dict) else json.loads(body), rid)
        return call

    service.stages.render_chat = recording(service.stages.render_chat)
    service.stages.render_completion = recording(service.stages.render_completion)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    raw = json.dumps(chat).encode()
    for out in (asyncio.run(service.chat(chat, None, raw)), asyncio.run(service.chat(chat))):
        assert json.loads(out)["choices"][0]["message"]["content"] == "Hello! world"
    completion = {"prompt": "x"}
    asyncio.run(service.completion(completion, "r", json.dumps(completion).encode()))
    assert seen == [raw, chat, json.dumps(completion).encode()]


def test_each_composed_request_reports_its_stages_before_the_response(plain):
    """``observe`` (the Ingress's serve_app_composed_stage_seconds) hears each request's render, then
    its engine time: to the first chunk for a stream, the whole generation otherwise; a request the
    engine refused before any chunk has its render only."""
    heard: list[tuple[str, str]] = []

    def service(engine: FakeEngine, prompts: list[list[int]]) -> ComposedService:
        svc = _service(plain, engine, prompts)
        svc.observe = lambda endpoint, stage, seconds: heard.append((endpoint, stage)) if seconds >= 0 else None
        return svc

    chat = {"messages": [{"role": "user", "content": "x"}]}
    streamed = FakeEngine({1: [_chunk(HELLO, "length")]})
    asyncio.run(_stream(service(streamed, [[1]]).chat({**chat, "stream": True})))
    assert heard == [("chat", "render"), ("chat", "engine_first_chunk")]

    heard.clear()
    whole = FakeEngine({1: {"request_id": "e", "choices": [{"index": 0, "token_ids": HELLO, "finish_reason": "length"}]}})
    asyncio.run(service(whole, [[1]]).chat(chat))
    assert heard == [("chat", "render"), ("chat", "engine")]

    heard.clear()
    two = FakeEngine({1: [_chunk(HELLO, "length")], 2: [_chunk(HELLO, "length")]})
    asyncio.run(_stream(service(two, [[1], [2]]).completion({"prompt": ["a", "b"], "stream": True})))
    assert heard == [("completion", "render"), ("completion", "engine_first_chunk")]  # once for the request

    heard.clear()
    refused = FakeEngine({1: [BadRequestError("too long")]})
    with pytest.raises(BadRequestError):
        asyncio.run(service(refused, [[1]]).chat({**chat, "stream": True}))
    assert heard == [("chat", "render")]

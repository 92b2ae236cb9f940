"""``RenderService`` with the prompt-piece cache against the same service without it (vLLM's own
tokenizer call, unchanged), in-process over vLLM's render stack (qwen3-tiny, no Ray).

The answers must be byte-identical, turn by turn over agent conversations (cold pieces go to vLLM's
thread pool, warm ones are encoded on the event loop), for completions that ask for no special tokens,
and for the requests the cache hands back to vLLM (special tokens added, a prompt past the context,
whose 400 must be vLLM's own).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from serve_app._vllm import INLINE_NEW_CHARS
from serve_app.config import AppArgs
from serve_app.errors import ApiError
from serve_app.render import RenderService

ARGS = {"model": "qwen3-tiny", "tool_call_parser": "hermes", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}.", "parameters": {
    "type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}} for i in range(8)]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def services(loop, tmp_path_factory: pytest.TempPathFactory) -> dict[str, RenderService]:
    """``cached`` and ``other_replica``: two render processes' caches (each its own LRU) over one
    machine-wide store in a fresh directory; ``vllm``: vLLM's own tokenizer call."""
    node = {"render_cache_dir": str(tmp_path_factory.mktemp("render-node-cache"))}
    out = {}
    for name, extra in (("cached", node), ("other_replica", node), ("vllm", {"render_cache_bytes": 0})):
        args = AppArgs(**ARGS, **extra)
        out[name] = loop.run_until_complete(RenderService.create(args, args.resolve()))
    assert out["cached"].prompt_cache is not None, out["cached"].prompt_cache_status
    assert out["cached"].prompt_cache.node is not None, out["cached"].prompt_cache_status
    assert out["vllm"].prompt_cache is None
    return out


def _both(loop, services: dict[str, RenderService], method: str, body: dict[str, Any], rid: str, cached: str = "cached") -> Any:
    raw = json.dumps(body).encode()
    answers = []
    for service in (services[cached], services["vllm"]):
        try:
            answers.append(loop.run_until_complete(getattr(service, method)(raw, rid)))
        except ApiError as exc:
            answers.append((exc.status_code, exc.message, exc.param))
    assert answers[0] == answers[1]
    return answers[0]


def _conversation(k: int, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 40},
                                      {"role": "user", "content": f"Task {k}: fix the build."}]
    for t in range(turns):
        call = {"id": f"c{k}{t}", "type": "function", "function": {"name": f"tool_{t % 8}", "arguments": json.dumps({"arg": f"{k}/{t}"})}}
        messages.append({"role": "assistant", "content": f"Step {t}.", "reasoning_content": f"Thinking {t} é\u0301 🦜",
                         "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"result {t} of task {k} <|im_end|>\n" * (t + 1)})
        if t == 2:
            messages += [{"role": "assistant", "content": "Done so far."},
                         {"role": "user", "content": "Go on (earlier reasoning drops now)."}]
    return messages


def test_agent_turns_equal_vllm_cold_and_warm(loop, services: dict[str, RenderService]) -> None:
    encoder = services["cached"].prompt_cache
    for k in range(3):
        messages = _conversation(k, 6)
        for end in range(2, len(messages) + 1):
            if messages[end - 1]["role"] in ("user", "tool"):
                body = {"model": "qwen3-tiny", "messages": messages[:end], "tools": TOOLS, "tool_choice": "auto", "max_tokens": 32}
                out = json.loads(_both(loop, services, "chat", body, f"agent-{k}-{end}"))
                assert out["token_ids"]
    stats = encoder.cache.stats
    assert stats.hit_chars > 5 * stats.miss_chars  # the turns shared most of their text


def test_turns_alternating_between_replicas_equal_vllm_and_share_the_machine_store(loop, services: dict[str, RenderService]) -> None:
    # A front door that spreads turns: each process tokenizes only what neither has seen.
    caches = [services[name].prompt_cache for name in ("cached", "other_replica")]
    before = [c.cache.stats.node_hits for c in caches]
    turn = 0
    for k in range(10, 13):
        messages = _conversation(k, 6)
        for end in range(2, len(messages) + 1):
            if messages[end - 1]["role"] in ("user", "tool"):
                body = {"model": "qwen3-tiny", "messages": messages[:end], "tools": TOOLS, "tool_choice": "auto", "max_tokens": 32}
                _both(loop, services, "chat", body, f"spread-{k}-{end}", ("cached", "other_replica")[turn % 2])
                turn += 1
    node_hits = [c.cache.stats.node_hits - b for c, b in zip(caches, before, strict=True)]
    assert all(n > 0 for n in node_hits), node_hits  # each found pieces the other had tokenized


def test_a_cold_prompt_past_the_inline_budget_still_equals_vllm(loop, services: dict[str, RenderService]) -> None:
    text = " ".join(f"word{i}" for i in range(INLINE_NEW_CHARS // 3))  # all new, beyond the event loop's budget
    body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    before = services["cached"].prompt_cache.cache.stats.miss_chars
    _both(loop, services, "chat", body, "cold")
    assert services["cached"].prompt_cache.cache.stats.miss_chars - before > INLINE_NEW_CHARS


def test_requests_the_cache_hands_back_to_vllm(loop, services: dict[str, RenderService]) -> None:
    chat = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi <|im_end|>"}]}
    _both(loop, services, "chat", {**chat, "add_special_tokens": True}, "special")
    long_chat = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "lorem ipsum " * 3000}]}
    too_long = _both(loop, services, "chat", long_chat, "long")
    assert too_long[0] == 400
    _both(loop, services, "completion", {"model": "qwen3-tiny", "prompt": "a <|im_start|> b", "add_special_tokens": False}, "cmpl")
    _both(loop, services, "completion", {"model": "qwen3-tiny", "prompt": "a <|im_start|> b"}, "cmpl-special")
    _both(loop, services, "tokenize", {"model": "qwen3-tiny", "messages": chat["messages"]}, "tok")

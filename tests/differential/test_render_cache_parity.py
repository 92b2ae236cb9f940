"""Render with a warm prompt-piece cache against vLLM 0.32's own renderer, turn by turn.

An agent sends its whole conversation again at every turn, so serve_app's render (the shared
``app_url`` / ``deepseek_url`` / ``mistral_url`` apps, cache on by default) answers most of each
prompt from pieces it tokenized for earlier requests (``serve_app/render_cache.py``). Each turn goes,
as the same bytes with the same ``X-Request-Id``, to serve_app over HTTP and to vLLM's ``vllm launch
render`` app (the oracle, no cache); the token ids and every other field must be equal, for:

* hand-written multi-turn conversations with tools, reasoning, tool calls and tool results, including
  the turns where a template rewrites earlier messages (qwen3 drops the reasoning of assistant turns
  before the last user query; deepseek's template drops it too), and special-token text in content;
* generated conversations (hypothesis), each sent turn by turn after the ones before, so the cache is
  warm with many prefixes that share pieces, on every builtin tokenizer family.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.differential.conftest import ORACLE_FIXTURE, OUR_URL_FIXTURE
from tests.differential.corpus import CHAT, MODELS, ModelSpec
from tests.differential.test_render_parity import differences, expected_from_vllm

TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} <|im_end|> tool", "parameters": {
        "type": "object", "properties": {"arg": {"type": "string"}, "n": {"type": "integer"}}, "required": ["arg"]}}}
    for name in ("read_file", "run_shell", "search_code", "list_dir", "web_search", "fetch_url", "edit_file", "write_file")
]
SYSTEM = "You are a careful coding agent. Think first, then call tools. " * 12


def _turns(spec: ModelSpec, messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The conversation as an agent sends it: every prefix that ends with a user or tool message."""
    if spec.alternating_only:  # Mistral's template: [system] user assistant user ..., plain text only
        plain = [{"role": m["role"], "content": m.get("content") or "ok"} for m in messages
                 if m["role"] in ("user", "assistant") and "tool_calls" not in m]
        messages = []
        for m in plain:  # keep a message only when its role is the one due next
            if m["role"] == ("user", "assistant")[len(messages) % 2]:
                messages.append(m)
    return [messages[:end] for end in range(1, len(messages) + 1) if messages[end - 1]["role"] in ("user", "tool")]


def _body(spec: ModelSpec, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": spec.name, "messages": messages, "max_tokens": 64}
    if not spec.alternating_only:
        body["tools"] = TOOLS
        body["tool_choice"] = "auto" if spec.has_tool_parser else "none"
    return body


def _same_render(request: pytest.FixtureRequest, http: httpx.Client, model: str, body: dict[str, Any], rid: str) -> None:
    base_url = request.getfixturevalue(OUR_URL_FIXTURE[model])
    oracle = request.getfixturevalue(ORACLE_FIXTURE[model])
    content = json.dumps(body, ensure_ascii=False).encode()
    headers = {"content-type": "application/json", "X-Request-Id": rid}
    ref = oracle.post(CHAT, content=content, headers=headers)
    ours = http.post(base_url + CHAT, content=content, headers=headers)
    assert ref.status_code == 200, ref.text[:2000]
    assert ours.status_code == 200, ours.text[:2000]
    our_body = ours.json()
    assert our_body["token_ids"] == ref.json()["token_ids"]
    expected = expected_from_vllm(_Case(), ref.json(), our_body)
    assert our_body == expected, "\n".join(differences(our_body, expected)[:20])


class _Case:
    """What ``expected_from_vllm`` reads of a corpus case: a chat render with an X-Request-Id."""

    path = CHAT
    request_id = True
    body: dict[str, Any] = {}


def agent_conversation(k: int) -> list[dict[str, Any]]:
    """A fixed agent run: reasoning on every assistant turn, tool calls and results, follow-up questions."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Task {k}: find why test_{k} fails and fix it."}]
    for turn in range(4):
        call = {"id": f"call_{k}_{turn}", "type": "function",
                "function": {"name": TOOLS[turn % 8]["function"]["name"], "arguments": json.dumps({"arg": f"path/{k}/{turn}.py"})}}
        messages.append({"role": "assistant", "content": "" if turn % 2 else f"Looking at step {turn}.",
                         "reasoning_content": f"Step {turn} of task {k}: I should look at the file first.", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": f"def test_{k}():\n    assert f({turn}) == {turn * k}  # <|im_end|> in a file\n"})
        if turn == 1:
            messages.append({"role": "assistant", "content": "Found it: an off-by-one.",
                             "reasoning_content": "The reasoning of this turn is dropped once the user speaks again."})
            messages.append({"role": "user", "content": f"Good. Now also check test_{k + 1}, and é\u0301 東京 🦜."})
    return messages


@pytest.mark.parametrize("model", list(MODELS))
def test_agent_conversations_turn_by_turn(request: pytest.FixtureRequest, http: httpx.Client, model: str) -> None:
    spec = MODELS[model]
    sent = 0
    for k in range(3):  # three conversations sharing the system prompt and tools: the cache warms across them
        for i, messages in enumerate(_turns(spec, agent_conversation(k))):
            _same_render(request, http, model, _body(spec, messages), f"cache-agent-{model}-{k}-{i}")
            sent += 1
    assert sent >= 9 if not spec.alternating_only else sent >= 3


_TEXT = st.lists(st.one_of(
    st.sampled_from(["a", "b ", " ", "\n", "\n\n", "  ", "é", "e\u0301", "東京", "🦜", "{\"k\": 1}", "."]),
    st.sampled_from(["<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>", "<｜User｜>", "</s>", "[INST]"]),
), min_size=1, max_size=25).map("".join)


@st.composite
def conversations(draw: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM[: draw(st.integers(0, len(SYSTEM)))] or "hi"}]
    for i in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(_TEXT)})
        reply: dict[str, Any] = {"role": "assistant", "content": draw(_TEXT), "reasoning_content": draw(_TEXT)}
        if draw(st.booleans()):
            call = {"id": f"call_{i}", "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"arg": draw(_TEXT)})}}
            messages += [{**reply, "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": draw(_TEXT)}]
        else:
            messages.append(reply)
    return messages


@pytest.mark.parametrize("model", list(MODELS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
def test_generated_conversations_turn_by_turn(request: pytest.FixtureRequest, http: httpx.Client, model: str,
                                              messages: list[dict[str, Any]]) -> None:
    spec = MODELS[model]
    for i, turn in enumerate(_turns(spec, messages)):
        _same_render(request, http, model, _body(spec, turn), f"cache-gen-{model}-{i}")

"""``serve_app._vllm.memoize_template_sandbox``: chat templates rendered in Jinja's immutable sandbox
with its attribute verdicts kept per (type, name) give the same prompt text as Jinja's own sandbox,
over every builtin model's template, and refuse the same unsafe reads and writes, the second time
(served from the memo) as the first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2.sandbox
import pytest
import transformers.utils.chat_template_utils as chat_templates
from transformers import AutoTokenizer

from serve_app._vllm import memoize_template_sandbox

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool {i}.", "parameters": {
    "type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}} for i in range(3)]


def _conversations() -> list[list[dict[str, Any]]]:
    out = []
    for k in range(3):
        messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {k}."},
                                          {"role": "user", "content": f"  Task {k}: fix the build.\n"}]
        for t in range(4):
            call = {"id": f"c{k}{t}", "type": "function", "function": {"name": f"tool_{t % 3}", "arguments": json.dumps({"arg": str(t)})}}
            messages.append({"role": "assistant", "content": f"\nStep {t}. ", "reasoning_content": f"Thinking {t} 🦜",
                             "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"<tool_response>result {t}</tool_response>"})
            if t == 1:
                messages += [{"role": "assistant", "content": "<think>old</think>Done so far."}, {"role": "user", "content": "Go on."}]
        out.append(messages)
    return out


def _render(tokenizer: Any, env_class: type, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    chat_templates.ImmutableSandboxedEnvironment = env_class
    chat_templates._compile_jinja_template.cache_clear()
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.fixture(scope="module")
def memoized() -> Any:
    jinjas = jinja2.sandbox.ImmutableSandboxedEnvironment
    memoize_template_sandbox()
    ours = chat_templates.ImmutableSandboxedEnvironment
    assert ours is not jinjas and issubclass(ours, jinjas)
    yield ours
    chat_templates.ImmutableSandboxedEnvironment = ours  # as the app leaves it
    chat_templates._compile_jinja_template.cache_clear()


def test_every_builtin_template_renders_the_same_text(model_dirs: dict[str, Path], memoized: Any) -> None:
    rendered = 0
    for name, path in model_dirs.items():
        tokenizer = AutoTokenizer.from_pretrained(path)
        if not getattr(tokenizer, "chat_template", None):
            continue
        for messages in _conversations():
            for end in range(2, len(messages) + 1):
                kwargs = {"tools": TOOLS, "add_generation_prompt": messages[end - 1]["role"] != "assistant"}
                try:
                    want = _render(tokenizer, jinja2.sandbox.ImmutableSandboxedEnvironment, messages[:end], **kwargs)
                except Exception as exc:  # a template that refuses this shape refuses it under both
                    with pytest.raises(type(exc)):
                        _render(tokenizer, memoized, messages[:end], **kwargs)
                    continue
                assert _render(tokenizer, memoized, messages[:end], **kwargs) == want, (name, end)
                rendered += 1
    assert rendered >= 20


UNSAFE = {
    "a write to a message": "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",
    "a write to the list": "{{ messages.append(1) }}",
    "a private attribute of a str": "{{ 'a'.__class__.__mro__ }}",
    "a private attribute of the loop": "{% for m in messages %}{{ loop.__class__ }}{% endfor %}",
    "a namespace's internals": "{% set ns = namespace(a=1) %}{{ ns._Namespace__attrs }}",
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_reads_and_writes_are_refused_as_by_jinja(case: str, memoized: Any) -> None:
    template = UNSAFE[case]
    outcomes = []
    for env_class in (jinja2.sandbox.ImmutableSandboxedEnvironment, memoized, memoized):
        env = env_class()
        try:
            outcomes.append(("ok", env.from_string(template).render(messages=[{"role": "user", "content": "hi"}])))
        except Exception as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1] == outcomes[2], outcomes
    assert outcomes[0][0] != "ok" or outcomes[0][1] == "", outcomes  # refused (raised, or nothing written)

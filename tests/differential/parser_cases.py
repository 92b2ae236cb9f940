"""Model variants and realistic model outputs for the parser parity tests.

* :func:`mistral_tools_model` - ``mistral-sp`` with ``[TOOL_CALLS]`` added as a special token (the
  v1 SentencePiece vocabulary has no tool tokens; vLLM's ``mistral`` tool parser refuses a
  tokenizer without it). Without ``[ARGS]`` in the vocabulary the parser takes its pre-v11 path:
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``.
* :func:`qwen3_preopen_template` - Qwen3's template whose generation prompt already opens
  ``<think>`` (as Qwen3-Thinking-2507 / QwQ do), so outputs start inside reasoning.
* :class:`OutputFormat` - the text a model in each family writes: reasoning, content, tool calls
  in the configured tool parser's markup, as ``tool_choice`` constrains it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness.payloads import WEATHER_AND_DOCS_TOOLS as TOOLS

__all__ = ["CALLS", "CONTENTS", "REASONINGS", "TOOLS", "CallSpec", "OutputFormat", "mistral_tools_model", "qwen3_preopen_template"]

HERE = Path(__file__).resolve().parent


# (name, arguments): unicode, escapes, nesting, numbers.
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("get_weather", {"city": "São Paulo", "unit": "celsius"}),
    ("search_docs", {"query": "東京の天気 🌦 \"quoted\" \\ back", "limit": 3}),
    ("get_weather", {"city": "Zürich 🇨🇭"}),
    ("search_docs", {"query": "naïve café", "limit": 10, "filters": {"lang": ["fr", "de"], "since": 2024}}),
]

REASONINGS = [
    "The user wants the weather. I should call get_weather — maybe twice, for «both» cities. 🤔",
    "Let me think step by step:\n1. parse the request\n2. choose a tool {not JSON}\n3. answer in 日本語.",
    "Short thought.",
]
CONTENTS = [
    "Sure, let me check that for you. ",
    "Voilà: the answer is 42 — ½ of 84. 😀",
    "Here is some code: `{\"a\": [1, 2]}` and <b>html</b>.",
    "",
]

CallSpec = tuple[str, dict[str, Any]]


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


@dataclass(frozen=True)
class OutputFormat:
    """How one parser family writes reasoning and tool calls."""

    tool_markup: str  # "hermes" | "qwen3_coder" | "deepseek_v31" | "mistral_pre_v11"
    think_start: str | None  # what opens reasoning in the output (None: no reasoning parser)
    think_end: str | None
    reasoning_sep: str  # written after think_end before content

    def reasoning(self, text: str, prompt_opened: bool) -> str:
        """Reasoning as the model writes it; the opener is omitted when the prompt already opened it."""
        assert self.think_end is not None
        opener = "" if prompt_opened else (self.think_start or "")
        return f"{opener}{text}{self.think_end}{self.reasoning_sep}"

    def tool_calls(self, calls: list[CallSpec]) -> str:
        """Auto tool calls in the parser's native markup."""
        m = self.tool_markup
        if m == "hermes":
            return "\n".join(f"<tool_call>\n{_json({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
        if m == "qwen3_coder":
            parts = []
            for n, a in calls:
                params = "".join(
                    f"<parameter={k}>\n{v if isinstance(v, str) else _json(v)}\n</parameter>\n" for k, v in a.items()
                )
                parts.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
            return "\n".join(parts)
        if m == "deepseek_v31":
            inner = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{_json(a)}<｜tool▁call▁end｜>" for n, a in calls)
            return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"
        if m == "mistral_pre_v11":
            return "[TOOL_CALLS]" + _json([{"name": n, "arguments": a} for n, a in calls])
        raise AssertionError(m)

    @staticmethod
    def required_json(calls: list[CallSpec]) -> str:
        """What structured outputs make a model write for ``tool_choice: required`` (JSON-format parsers)."""
        return _json([{"name": n, "parameters": a} for n, a in calls])

    @staticmethod
    def named_json(call: CallSpec) -> str:
        """What structured outputs make a model write for a named tool choice: the bare arguments."""
        return _json(call[1])


def qwen3_preopen_template(target_dir: Path) -> Path:
    """Qwen3's template with ``<think>\\n`` appended to the generation prompt (thinking-only models)."""
    from importlib.resources import files

    src = files("serve_app.models").joinpath("templates", "qwen3.jinja").read_text(encoding="utf-8")
    needle = "    {{- '<|im_start|>assistant\\n' }}\n"
    assert needle in src, "qwen3.jinja changed: update the pre-open patch"
    patched = src.replace(needle, needle.replace("assistant\\n", "assistant\\n<think>\\n"), 1)
    path = Path(target_dir) / "qwen3_preopen_think.jinja"
    path.write_text(patched, encoding="utf-8")
    return path


def mistral_tools_model(target_dir: Path) -> Path:
    """A copy of ``mistral-sp`` whose tokenizer knows ``[TOOL_CALLS]`` (id 32000, special)."""
    from tokenizers import AddedToken, Tokenizer

    from serve_app.models import resolve_model

    src = resolve_model("mistral-sp")
    dst = Path(target_dir) / "mistral-sp-tools"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    assert tok.token_to_id("[TOOL_CALLS]") == 32000
    tok.save(str(dst / "tokenizer.json"))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["extra_special_tokens"] = ["[TOOL_CALLS]"]
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    mcfg = json.loads((dst / "config.json").read_text())
    mcfg["vocab_size"] = 32768
    (dst / "config.json").write_text(json.dumps(mcfg, indent=2))
    return dst

"""Issue 19's hostile inputs, in-process (no Ray, no engine): what they cost, and what the fixes do.

- vLLM's ``sanitize_message`` against ours on a ``"/a" * n`` model name (vLLM's is quadratic: its
  path regexes backtrack); ours is what every vLLM module now calls (``serve_app._vllm``).
- vLLM parsers' regexes that run over derender output text (client-sent token ids), left as they are:
  qwen3-coder's ``_PARAM_RE`` and mistral's tool-call regex, on their own markers repeated.
- The derender work the size bounds did not count: one-token choices (plain, and parser: a fresh vLLM
  parser each) and ``prompt_logprobs`` entries, behind ``CHOICE_WORK`` / ``_PARSER_CHOICE_WORK``.

    python -m bench.hostile_bench      # writes bench/results/hostile.{json,md}
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from bench.common.paths import RESULTS


def _best_of(fn: Any, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def sanitize() -> list[dict[str, Any]]:
    from serve_app._vllm import vllm_sanitize_message
    from serve_app.errors import sanitize_message

    vllm = vllm_sanitize_message()  # 8 KB already takes ~20 s: larger sizes are left out
    rows = []
    for n in (500, 1000, 2000, 4000):
        message = f"The model `{'/a' * n}` does not exist. Valid aliases: qwen3-tiny."
        theirs = _best_of(lambda m=message: vllm(m), 1)
        rows.append({"chars": len(message), "vllm_s": theirs, "ours_s": _best_of(lambda m=message: sanitize_message(m))})
    return rows


def parser_regexes() -> list[dict[str, Any]]:
    import regex
    from vllm.parser.mistral import MistralParser  # noqa: F401  (the class holds its regex per instance)
    from vllm.parser.qwen3 import _PARAM_RE

    mistral = regex.compile(r"\[{.*}\]", regex.DOTALL)  # vllm/parser/mistral.py: tool_call_regex
    rows = []
    for n in (1000, 2000, 4000):
        qwen = "<parameter=" * n
        brackets = "[{" * (3 * n)
        rows.append({
            "repeats": n,
            "qwen3_param_re_s": _best_of(lambda q=qwen: _PARAM_RE.findall(q), 1),
            "qwen3_chars": len(qwen),
            "mistral_re_s": _best_of(lambda b=brackets: mistral.findall(b), 1),
            "mistral_chars": len(brackets),
        })
    return rows


async def derender_work() -> dict[str, Any]:
    from serve_app.config import AppArgs
    from serve_app.derender.parser import build_parser_service
    from serve_app.derender.plain import build_plain_service

    args = AppArgs(model="qwen3-tiny", tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True)
    parser = await build_parser_service(args, args.resolve())
    plain = build_plain_service(args, args.resolve())
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    n = 2000
    choices = {"request_id": "x", "choices": [{"index": i, "token_ids": [9707]} for i in range(n)]}
    one = json.dumps({"generate_response": choices, "chat_request": chat}).encode()
    long_choice = {"request_id": "x", "choices": [{"index": 0, "token_ids": [9707] * 4000}]}
    tokens = json.dumps({"generate_response": long_choice, "chat_request": chat}).encode()
    candidates = {str(i): {"logprob": -1.0, "rank": i + 1, "decoded_token": "a"} for i in range(20)}
    prompt_lp = {"request_id": "x", "prompt_logprobs": [None] + [candidates] * 4000, "choices": [{"index": 0, "token_ids": [9707]}]}
    lp = json.dumps({"generate_response": prompt_lp}).encode()
    return {
        "one_token_choices": n,
        "plain_choices_s": _best_of(lambda: plain.chat(one)),
        "parser_choices_s": _best_of(lambda: parser.chat(one)),
        "plain_4000_tokens_s": _best_of(lambda: plain.chat(tokens)),
        "parser_4000_tokens_s": _best_of(lambda: parser.chat(tokens)),
        "prompt_logprob_entries": 4001 + 4000 * 20,
        "plain_prompt_logprobs_s": _best_of(lambda: plain.chat(lp)),
    }


def main() -> None:
    out = {"sanitize": sanitize(), "parser_regexes": parser_regexes(), "derender_work": asyncio.run(derender_work())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hostile.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = ["# Issue 19's hostile inputs, in-process (`python -m bench.hostile_bench`)", "",
             "## A `\"/a\" * n` model name through the error sanitiser", "",
             "| message chars | vLLM's `sanitize_message` | ours |", "|---|---|---|"]
    lines += [f"| {r['chars']} | {r['vllm_s'] * 1e3:.1f} ms | {r['ours_s'] * 1e3:.3f} ms |" for r in out["sanitize"]]
    lines += ["", "## vLLM parser regexes over derender output text (not changed)", "",
              "| repeats | qwen3-coder `_PARAM_RE` on `<parameter=` × n | mistral `\\[{.*}\\]` on `[{` × 3n |", "|---|---|---|"]
    lines += [f"| {r['repeats']} | {r['qwen3_param_re_s'] * 1e3:.1f} ms ({r['qwen3_chars']} chars) | "
              f"{r['mistral_re_s'] * 1e3:.1f} ms ({r['mistral_chars']} chars) |" for r in out["parser_regexes"]]
    w = out["derender_work"]
    lines += ["", "## Derender work the size bounds did not count (qwen3-tiny; parser: qwen3 + hermes)", "",
              f"- {w['one_token_choices']} one-token choices: plain {w['plain_choices_s'] * 1e3:.1f} ms, "
              f"parser {w['parser_choices_s'] * 1e3:.0f} ms",
              f"- one 4000-token choice: plain {w['plain_4000_tokens_s'] * 1e3:.1f} ms, parser {w['parser_4000_tokens_s'] * 1e3:.1f} ms",
              f"- {w['prompt_logprob_entries']} prompt_logprobs entries (4000 positions × 20): "
              f"plain {w['plain_prompt_logprobs_s'] * 1e3:.0f} ms", ""]
    (RESULTS / "hostile.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""The parser derender stream the parser benches drive (``parser_bench``, ``capacity_bench``, ``hop_bench``):
qwen3-tiny with hermes + qwen3, a tool-and-reasoning output one token per chunk, the client carrying
``stream_state``, ``chat_request`` and the full ``prompt_token_ids``."""

from __future__ import annotations

import os
import statistics
from typing import Any

import orjson

from bench.common.workloads import CHAT_REQUEST, chat_prompt, tokenizer, tool_reasoning_output
from tests.harness.derender_stream import chunk, stream_body

MAX_MODEL_LEN = 16384
PARSER_APP = dict(  # AppArgs of our side (vLLM's side: the same flags)
    model="qwen3-tiny",
    tool_call_parser="hermes",
    reasoning_parser="qwen3",
    enable_auto_tool_choice=True,
    max_model_len=MAX_MODEL_LEN,
)
WINDOWS = [0, 250, 500, 1000, 2000, 4000, 6000, 7900]  # first positions of the 100-chunk windows reported


def set_parser_env() -> None:
    """The environment of a parser bench's process, set before vLLM or Ray is imported: vLLM accepts
    ``MAX_MODEL_LEN`` above the model's 4096 (no model runs, only tokenizer and parser work), and
    Serve's flags as ``make run`` (a worker's own ``env`` still overrides them)."""
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    for key, value in (("RAY_AUTH_MODE", "disabled"), ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1"), ("RAY_SERVE_ENABLE_HA_PROXY", "1"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)


def parser_workload(tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids): ``tokens`` output ids of reasoning, answer and two tool calls, then EOS."""
    tok = tokenizer(str(PARSER_APP["model"]))
    return chat_prompt(tok, CHAT_REQUEST), tool_reasoning_output(tok, tokens)


def chunk_body(i: int, output: list[int], state: Any, prompt: list[int], request_id: str, *, prompt_tokens: bool = False) -> bytes:
    """The call for position ``i`` (its one token; ``finish_reason`` on the last), carrying ``state``
    (``prompt_tokens``: with the prompt's length as well, as ``parser_bench`` sends it)."""
    # orjson: at 8000 positions the carried state is ~70 KB each way, and a stdlib-json client would
    # spend ~1 ms per chunk on it (for vLLM and for us alike).
    last = i == len(output) - 1
    generate_chunk = chunk([output[i]], request_id, finish_reason="stop" if last else None)
    extra = {"prompt_tokens": len(prompt)} if prompt_tokens else {}
    return orjson.dumps(stream_body(generate_chunk, state, model="qwen3-tiny", **extra, prompt_token_ids=prompt,
                                    chat_request=CHAT_REQUEST))


def windows(lat: list[float]) -> list[dict[str, Any]]:
    """p50 / p99 (ms) of the per-chunk seconds ``lat`` in each 100-chunk window from ``WINDOWS``."""
    rows = []
    for start in WINDOWS:
        part = sorted(lat[start : start + 100])
        if part:
            rows.append({"positions": f"{start}-{start + len(part) - 1}", "p50_ms": 1000 * statistics.median(part),
                         "p99_ms": 1000 * part[min(len(part) - 1, int(0.99 * len(part)))]})
    return rows

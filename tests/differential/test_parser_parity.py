"""ParserDerender against COUPLED ``vllm serve`` chat serving, for the same prompt and output ids.

The oracle (:mod:`tests.differential.coupled_oracle`) runs vLLM's real ``OpenAIServingChat`` over
a scripted engine whose text comes from vLLM's own engine detokenizer. For each case:

* non-streaming: our ``message`` (role, content, reasoning, tool calls' types, names and
  arguments), ``finish_reason``, ``stop_reason``, ``token_ids`` and ``logprobs`` equal vLLM's;
* streaming: the concatenation of our deltas per choice equals the concatenation of vLLM's SSE
  deltas (content, reasoning, tool calls merged by index, role, finish reason, stop reason, token
  ids, logprobs entries); exactly one chunk per choice carries the finish reason;
* tool-call ids follow vLLM's scheme (``chatcmpl-tool-<16 hex>``; Mistral's 9 alphanumerics), one
  id per call, stable across a stream; not compared for equality (random on both sides);
* the session cache: on one service every chunk after the first is a hit; moving a stream to a
  fresh service (another replica) after k chunks, or alternating replicas, gives the same chunks
  and states as staying.

Logprobs come from vLLM's own ``LogprobsProcessor`` over synthetic sampler rows; ours receives
them as ``/inference/v1/generate`` would send them (``ServingTokens._create_tokens_logprobs``).
Server flags per configuration are in :data:`CONFIGS`; ``PARITY_EXAMPLES`` raises the number of
hypothesis examples per configuration (default 12).

Ours is ``ParserDerenderService`` in process (no Ray). Outputs are realistic: reasoning then the
end-of-reasoning marker, content, tool calls in the parser's markup with unicode JSON arguments,
then the EOS (``finish_reason: stop``), or cut short (``length``). Chunkings: one token per
chunk, random 1-4 token chunks (speculative decoding), chunks cut at markup tokens, and one chunk.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.config import AppArgs
from tests.differential.coupled_oracle import CoupledOracle, ScriptedChoice
from tests.differential.parser_cases import (
    CALLS,
    CONTENTS,
    REASONINGS,
    TOOLS,
    OutputFormat,
    mistral_tools_model,
    qwen3_preopen_template,
)

# --- configurations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    app: Callable[[Path], dict[str, Any]]  # AppArgs fields, given a scratch directory
    fmt: OutputFormat
    # How the prompt leaves reasoning for a request: "open" (the model writes the opener),
    # "preopened" (the prompt opened it), None (no reasoning in the output).
    reasoning_mode: Callable[[dict[str, Any]], str | None]
    thinking_kwargs: list[dict[str, Any] | None] = field(default_factory=lambda: [None])


def _kwargs(request: dict[str, Any]) -> dict[str, Any]:
    return request.get("chat_template_kwargs") or {}


def _qwen3_mode(request: dict[str, Any]) -> str | None:
    return None if _kwargs(request).get("enable_thinking") is False else "open"


def _qwen3_default_off_mode(request: dict[str, Any]) -> str | None:
    # --default-chat-template-kwargs '{"enable_thinking": false}'; reasoning_effort turns it back on
    on = _kwargs(request).get("enable_thinking", True if request.get("reasoning_effort") else False)
    return "open" if on else None


def _deepseek_mode(request: dict[str, Any]) -> str | None:
    kw = _kwargs(request)
    on = kw.get("thinking") or kw.get("enable_thinking", True if request.get("reasoning_effort") else False)
    return "preopened" if on else None


QWEN_FLAGS = {"model": "qwen3-tiny", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}
CONFIGS: dict[str, Config] = {
    # (a) hermes + qwen3, Qwen3's own template; thinking on, and off via chat_template_kwargs.
    "qwen3-hermes": Config(
        app=lambda d: {**QWEN_FLAGS, "tool_call_parser": "hermes"},
        fmt=OutputFormat("hermes", "<think>", "</think>", "\n\n"),
        reasoning_mode=_qwen3_mode,
        thinking_kwargs=[None, {"enable_thinking": False}],
    ),
    # (a') the same flags with a template whose generation prompt pre-opens <think>.
    "qwen3-hermes-preopen": Config(
        app=lambda d: {**QWEN_FLAGS, "tool_call_parser": "hermes", "chat_template": str(qwen3_preopen_template(d))},
        fmt=OutputFormat("hermes", "<think>", "</think>", "\n\n"),
        reasoning_mode=lambda request: "preopened",
    ),
    # (a'') thinking off by server default (--default-chat-template-kwargs), back on per request.
    "qwen3-hermes-nothink-default": Config(
        app=lambda d: {**QWEN_FLAGS, "tool_call_parser": "hermes", "default_chat_template_kwargs": {"enable_thinking": False}},
        fmt=OutputFormat("hermes", "<think>", "</think>", "\n\n"),
        reasoning_mode=_qwen3_default_off_mode,
        thinking_kwargs=[None, {"enable_thinking": True}],
    ),
    # (b) deepseek-v4's V3.1-format template: deepseek_v31 tools + deepseek_v3 reasoning (thinking kwarg).
    "deepseek-v31": Config(
        app=lambda d: {
            "model": "deepseek-v4",
            "tool_call_parser": "deepseek_v31",
            "reasoning_parser": "deepseek_v3",
            "enable_auto_tool_choice": True,
        },
        fmt=OutputFormat("deepseek_v31", "<think>", "</think>", ""),
        reasoning_mode=_deepseek_mode,
        thinking_kwargs=[None, {"thinking": True}],
    ),
    # (c) mistral tool parser on mistral-sp with [TOOL_CALLS] added (pre-v11 JSON-list format).
    "mistral": Config(
        app=lambda d: {
            "model": str(mistral_tools_model(d)),
            "served_model_name": ["mistral-sp"],
            "tool_call_parser": "mistral",
            "enable_auto_tool_choice": True,
        },
        fmt=OutputFormat("mistral_pre_v11", None, None, ""),
        reasoning_mode=lambda request: None,
    ),
    # (d) qwen3_coder (XML parameters, engine-based parser) + qwen3 reasoning on qwen3-tiny.
    "qwen3-coder": Config(
        app=lambda d: {**QWEN_FLAGS, "tool_call_parser": "qwen3_coder"},
        fmt=OutputFormat("qwen3_coder", "<think>", "</think>", "\n\n"),
        reasoning_mode=_qwen3_mode,
        thinking_kwargs=[None, {"enable_thinking": False}],
    ),
}


class Harness:
    """One configuration: the coupled oracle and our service, built from the same AppArgs."""

    def __init__(self, name: str, scratch: Path) -> None:
        from serve_app.derender.parser import build_parser_service

        self.name = name
        self.config = CONFIGS[name]
        self.args = AppArgs(**self.config.app(scratch))
        self.model = self.args.resolve()
        self.oracle = CoupledOracle(self.args, self.model)
        # Our service reuses the oracle's vLLM render stack (read-only), as a colocated Ingress does.
        self.svc = self.oracle.loop.run_until_complete(build_parser_service(self.args, self.model, self.oracle.state))
        self.tok = self.oracle.tokenizer
        self.model_name = self.model.name
        self.eos = self.tok.eos_token_id
        # A special token that is neither EOS nor parser markup, for "a stray special token" outputs.
        bos = self.tok.bos_token_id
        self.stray_special = bos if bos is not None and bos != self.eos else self.model.special_token_ids[3]
        self.stray_text = self.tok.convert_ids_to_tokens(self.stray_special)
        tool_parser = self.oracle.serving.parser_cls.tool_parser_cls
        self.json_forced = bool(tool_parser is not None and tool_parser.supports_required_and_named)
        ids = [self.tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")]
        self.markers = {
            i
            for i, piece in enumerate(self.tok.convert_ids_to_tokens(list(range(len(self.tok)))))
            if piece and any(ch in piece for ch in "{}[]<>\"｜")
        } | {i for i in ids if isinstance(i, int) and i >= 0}

    def fresh_service(self) -> Any:
        """Another replica: same parser kit and tokenizer, empty session cache."""
        from serve_app.derender.parser_service import ParserDerenderService
        from serve_app.derender.sessions import SessionCache

        s = self.svc
        c = self.args.parser_sessions
        return ParserDerenderService(s.model, s.kit, SessionCache(c.max_sessions, c.ttl_s, c.max_tokens))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))


# One harness per configuration at a time (pytest groups the tests by param): each holds vLLM's
# render stack, so it is freed before the next is built.
@pytest.fixture(scope="module", params=list(CONFIGS))
def h(request, tmp_path_factory) -> Iterator[Harness]:
    harness = Harness(request.param, tmp_path_factory.mktemp(request.param))
    yield harness
    harness.oracle.close()


# --- cases ------------------------------------------------------------------------------------------


@dataclass
class Output:
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | None = None


@dataclass
class Case:
    chat_request: dict[str, Any]
    outputs: list[Output]


def make_output(
    h: Harness,
    request: dict[str, Any],
    *,
    reasoning: str | None,
    content: str,
    calls: list[tuple[str, dict[str, Any]]],
    finish: str = "stop",
    cut: float = 0.6,
    markup_anyway: bool = False,
) -> Output:
    """The ids a model in this family would write for ``request``."""
    fmt = h.config.fmt
    mode = h.config.reasoning_mode(request)
    text = ""
    if mode is not None and reasoning is not None:
        text += fmt.reasoning(reasoning, prompt_opened=mode == "preopened")
    elif mode == "preopened":  # the prompt opened reasoning: the model must close it
        text += fmt.reasoning("", prompt_opened=True)
    choice = request.get("tool_choice")
    tools = request.get("tools")
    forced = isinstance(choice, dict) or choice == "required"
    if forced and h.config.fmt.tool_markup == "mistral_pre_v11":
        # pre-v11 mistral (HF tokenizer): adjust_request guides required/named to a bare JSON array
        if isinstance(choice, dict):
            calls = [c for c in (calls or CALLS) if c[0] == choice["function"]["name"]][:1] or [CALLS[0]]
        text += fmt.tool_calls(calls or CALLS[:1]).removeprefix("[TOOL_CALLS]")
    elif isinstance(choice, dict) and h.json_forced:
        text += OutputFormat.named_json(calls[0] if calls else CALLS[0])
    elif choice == "required" and h.json_forced:
        text += OutputFormat.required_json(calls or CALLS[:1])
    else:
        text += content
        if calls and tools and (choice != "none" or markup_anyway):
            text += fmt.tool_calls(calls)
    ids = h.encode(text)
    if finish == "stop" or not ids:  # an empty text can only end with the EOS
        return Output(ids + [h.eos], "stop")
    return Output(ids[: max(1, int(len(ids) * cut))], "length")


def request_for(h: Harness, *, tools: bool = True, tool_choice: Any = None, kwargs: dict | None = None, **extra: Any) -> dict:
    req: dict[str, Any] = {
        "model": h.model_name,
        "messages": [{"role": "user", "content": "What's the weather in São Paulo and Zürich? Also search the docs."}],
    }
    if tools:
        req["tools"] = TOOLS
    if tool_choice is not None:
        req["tool_choice"] = tool_choice
    if kwargs:
        req["chat_template_kwargs"] = kwargs
    req.update(extra)
    return req


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def scenarios(h: Harness) -> dict[str, Case]:
    """The named, deterministic cases for one configuration."""
    out: dict[str, Case] = {}
    for kw in h.config.thinking_kwargs:
        tag = "" if kw is None else "+" + ",".join(f"{k}={v}" for k, v in kw.items())

        def add(name: str, req: dict, *outs: dict, tag: str = tag) -> None:
            out[name + tag] = Case(req, [make_output(h, req, **o) for o in outs])

        r_auto = request_for(h, kwargs=kw)
        add("content_only", request_for(h, tools=False, kwargs=kw), dict(reasoning=REASONINGS[0], content=CONTENTS[1], calls=[]))
        add("one_call", r_auto, dict(reasoning=REASONINGS[0], content=CONTENTS[0], calls=CALLS[:1]))
        add("three_calls", r_auto, dict(reasoning=REASONINGS[1], content=CONTENTS[3], calls=CALLS[1:4]))
        add("content_no_call", r_auto, dict(reasoning=REASONINGS[2], content=CONTENTS[2], calls=[]))
        add("length_in_reasoning", r_auto, dict(reasoning=REASONINGS[1], content=CONTENTS[0], calls=CALLS[:2], finish="length", cut=0.15))
        add("length_in_call", r_auto, dict(reasoning=REASONINGS[2], content=CONTENTS[0], calls=CALLS[:2], finish="length", cut=0.8))
        r_none = request_for(h, tool_choice="none", kwargs=kw)
        add("tool_choice_none", r_none, dict(reasoning=REASONINGS[0], content=CONTENTS[1], calls=[]))
        add("tool_choice_none_markup", r_none, dict(reasoning=REASONINGS[2], content=CONTENTS[0], calls=CALLS[:1], markup_anyway=True))
        add("tool_choice_auto", request_for(h, tool_choice="auto", kwargs=kw), dict(reasoning=REASONINGS[2], content="", calls=CALLS[:2]))
        add(
            "tool_choice_required",
            request_for(h, tool_choice="required", kwargs=kw),
            dict(reasoning=REASONINGS[0], content="", calls=CALLS[:2]),
        )
        add("tool_choice_named", request_for(h, tool_choice=NAMED, kwargs=kw), dict(reasoning=REASONINGS[2], content="", calls=CALLS[2:3]))
        add(
            "include_reasoning_false",
            request_for(h, kwargs=kw, include_reasoning=False, return_token_ids=True),
            dict(reasoning=REASONINGS[0], content=CONTENTS[0], calls=CALLS[:1]),
        )
        add(
            "return_token_ids",
            request_for(h, kwargs=kw, return_token_ids=True),
            dict(reasoning=REASONINGS[2], content=CONTENTS[1], calls=CALLS[:1]),
        )
        add(
            "parallel_tool_calls_false",
            request_for(h, kwargs=kw, parallel_tool_calls=False),
            dict(reasoning=REASONINGS[2], content=CONTENTS[0], calls=CALLS[:3]),
        )
        add(
            "reasoning_effort",
            request_for(h, kwargs=kw, reasoning_effort="low"),
            dict(reasoning=REASONINGS[0], content=CONTENTS[0], calls=CALLS[:1]),
        )
        add(
            "logprobs",
            request_for(h, kwargs=kw, logprobs=True, top_logprobs=2),
            dict(reasoning=REASONINGS[0], content=CONTENTS[1], calls=CALLS[1:2]),
        )
        add(
            "logprobs_default_top_logprobs",
            request_for(h, kwargs=kw, logprobs=True),
            dict(reasoning=REASONINGS[2], content=CONTENTS[0], calls=CALLS[:1]),
        )
        add(
            "logprobs_include_reasoning_false",
            request_for(h, kwargs=kw, logprobs=True, top_logprobs=1, include_reasoning=False, return_token_ids=True),
            dict(reasoning=REASONINGS[1], content=CONTENTS[0], calls=CALLS[:1]),
        )
        # an engine stop on a regular token from `stop_token_ids`: stop_reason is that id, its text is dropped
        period = h.encode("Done.")[-1]
        req = request_for(h, kwargs=kw, stop_token_ids=[period])
        body = make_output(h, req, reasoning=REASONINGS[2], content=CONTENTS[1] + " Done", calls=[], finish="length", cut=1.0)
        out["stop_token_id" + tag] = Case(req, [Output(body.token_ids + [period], "stop", period)])
        add(
            "include_stop_str_in_output",
            request_for(h, kwargs=kw, include_stop_str_in_output=True),
            dict(reasoning=REASONINGS[2], content=CONTENTS[1], calls=CALLS[:1]),
        )
        req = request_for(h, kwargs=kw, add_generation_prompt=False, continue_final_message=True)
        req["messages"] = [*req["messages"], {"role": "assistant", "content": "Sure, the weather in São Paulo"}]
        out["continue_final_message" + tag] = Case(req, [Output(h.encode(" is sunny ☀️, 28°C.") + [h.eos], "stop")])
        out["echo" + tag] = Case(dict(req, echo=True), [Output(h.encode(" is sunny ☀️, 28°C.") + [h.eos], "stop")])
        if h.name != "mistral":  # mistral_instruct.jinja has no tool roles
            req = request_for(h, kwargs=kw)
            req["messages"] = [
                *req["messages"],
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning": "I need the weather first.",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(CALLS[0][1])}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 28, "sky": "☀️"}'},
                {"role": "user", "content": "Thanks! Now search the docs for 東京."},
            ]
            add("multi_turn", req, dict(reasoning=REASONINGS[1], content=CONTENTS[0], calls=CALLS[1:2]))
        stray = f"Before {h.stray_text} after."
        add("stray_special_token", request_for(h, tools=False, kwargs=kw), dict(reasoning=REASONINGS[2], content=stray, calls=[]))
        add(
            "stray_special_token_kept",
            request_for(h, tools=False, kwargs=kw, skip_special_tokens=False),
            dict(reasoning=REASONINGS[2], content=stray, calls=[]),
        )
        add(
            "n2",
            request_for(h, kwargs=kw, n=2),
            dict(reasoning=REASONINGS[0], content=CONTENTS[0], calls=CALLS[:2]),
            dict(reasoning=REASONINGS[1], content=CONTENTS[1], calls=[], finish="length", cut=0.9),
        )
    return out


# --- chunkings --------------------------------------------------------------------------------------


def chunk_by_sizes(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


def chunk_at_markers(ids: list[int], markers: set[int], where: str, width: int = 4) -> list[list[int]]:
    """Cut ``before`` (a marker opens a chunk), ``after`` (a marker ends it) or ``around`` (a marker in
    the middle of a 3-token chunk); other chunks are at most ``width`` tokens."""
    cuts: set[int] = set()  # a cut at p: a chunk starts at p
    for p, t in enumerate(ids):
        if t in markers:
            if where == "before":
                cuts.add(p)
            elif where == "after":
                cuts.add(p + 1)
            else:
                cuts.update((p - 1, p + 2))
    out: list[list[int]] = []
    cur: list[int] = []
    for p, t in enumerate(ids):
        if cur and (p in cuts or len(cur) >= width):
            out.append(cur)
            cur = []
        cur.append(t)
    if cur:
        out.append(cur)
    return out


CHUNKINGS: dict[str, Callable[[Harness, list[int]], list[list[int]]]] = {
    "1tok": lambda h, ids: [[t] for t in ids],
    "rand1to4": lambda h, ids: chunk_by_sizes(ids, [random.Random(len(ids)).randint(1, 4) for _ in range(64)]),
    "cut_before_markers": lambda h, ids: chunk_at_markers(ids, h.markers, "before"),
    "cut_after_markers": lambda h, ids: chunk_at_markers(ids, h.markers, "after"),
    "markers_mid_chunk": lambda h, ids: chunk_at_markers(ids, h.markers, "around", width=3),
    "one_chunk": lambda h, ids: [list(ids)],
}


# --- driving both sides -----------------------------------------------------------------------------


def coupled(h: Harness, case: Case, chunkings: list[list[list[int]]], stream: bool) -> Any:
    req = dict(case.chat_request, stream=stream)
    choices = [
        ScriptedChoice(o.token_ids, o.finish_reason, o.stop_reason, chunks)
        for o, chunks in zip(case.outputs, chunkings, strict=True)
    ]
    return h.oracle.run(req, choices)


def _lp(logprobs: dict[int, list[dict]] | None, index: int, start: int = 0, end: int | None = None) -> dict | None:
    if not logprobs:
        return None
    return {"content": logprobs[index][start:end]}


def ours_whole(svc: Any, h: Harness, case: Case, prompt_ids: list[int], logprobs: dict[int, list[dict]] | None = None) -> dict:
    gen = {
        "request_id": "r",
        "choices": [
            {
                "index": i,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
                "logprobs": _lp(logprobs, i),
            }
            for i, o in enumerate(case.outputs)
        ],
        "prompt_token_ids": prompt_ids,
    }
    body = {"model": h.model_name, "generate_response": gen, "chat_request": case.chat_request, "prompt_token_ids": prompt_ids}
    return json.loads(svc.chat(json.dumps(body).encode()))


def stream_body(
    h: Harness,
    req: dict,
    prompt_ids: list[int],
    index: int,
    ids: list[int],
    finish: str | None,
    stop_reason: Any,
    state: Any,
    logprobs: Any = None,
) -> bytes:
    choice = {"index": index, "token_ids": ids, "finish_reason": finish, "stop_reason": stop_reason, "logprobs": logprobs}
    chunk = {"request_id": "r", "choices": [choice]}
    body = {
        "stream": True,
        "model": h.model_name,
        "generate_chunk": chunk,
        "stream_state": state,
        "chat_request": req,
        "prompt_token_ids": prompt_ids,
    }
    return json.dumps(body).encode()


def ours_stream(
    svc: Any, h: Harness, case: Case, prompt_ids: list[int], chunkings: list[list[list[int]]], logprobs: dict[int, list[dict]] | None = None
) -> tuple[list[dict], list[str]]:
    """Interleaved like generate (round robin over indices), one stream_state per index."""
    req = dict(case.chat_request, stream=True)
    states: dict[int, Any] = {}
    pos: dict[int, int] = {}
    chunks_out: list[dict] = []
    outcomes: list[str] = []
    longest = max(len(c) for c in chunkings)
    for k in range(longest):
        for i, (o, chunks) in enumerate(zip(case.outputs, chunkings, strict=True)):
            if k >= len(chunks):
                continue
            last = k == len(chunks) - 1
            start = pos.get(i, 0)
            pos[i] = start + len(chunks[k])
            lp = _lp(logprobs, i, start, pos[i])
            body = stream_body(
                h, req, prompt_ids, i, chunks[k], o.finish_reason if last else None, o.stop_reason if last else None, states.get(i), lp
            )
            raw, outcome = svc.chat_with_outcome(body)
            resp = json.loads(raw)
            states[i] = resp["stream_state"]
            chunks_out.append(resp["chunk"])
            outcomes.append(outcome)
    return chunks_out, outcomes


# --- comparing --------------------------------------------------------------------------------------

TOOL_ID_SCHEMES = [re.compile(r"chatcmpl-tool-[0-9a-f]{16}"), re.compile(r"[A-Za-z0-9]{9}")]


def id_scheme(tool_id: str) -> int:
    for n, rx in enumerate(TOOL_ID_SCHEMES):
        if rx.fullmatch(tool_id):
            return n
    raise AssertionError(f"unknown tool-call id scheme: {tool_id!r}")


def aggregate_stream(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: the concatenated deltas, as a client accumulates them."""
    agg: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            a = agg.setdefault(
                c["index"],
                {
                    "role": None,
                    "content": "",
                    "reasoning": "",
                    "tool_calls": {},
                    "finish_reason": None,
                    "stop_reason": None,
                    "token_ids": [],
                    "logprobs": [],
                    "finishes": 0,
                },
            )
            d = c.get("delta") or {}
            if d.get("role"):
                assert a["role"] is None, f"role sent twice: {chunk}"
                a["role"] = d["role"]
            a["content"] += d.get("content") or ""
            a["reasoning"] += d.get("reasoning") or ""
            for tc in d.get("tool_calls") or []:
                t = a["tool_calls"].setdefault(tc["index"], {"ids": [], "type": None, "name": "", "arguments": ""})
                if tc.get("id"):
                    t["ids"].append(tc["id"])
                if tc.get("type"):
                    t["type"] = tc["type"]
                fn = tc.get("function") or {}
                t["name"] += fn.get("name") or ""
                t["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason") is not None:
                a["finishes"] += 1
                a["finish_reason"] = c["finish_reason"]
                a["stop_reason"] = c.get("stop_reason")
            a["token_ids"] += c.get("token_ids") or []
            a["logprobs"] += (c.get("logprobs") or {}).get("content") or []
    return agg


def check_stream_ids(agg: dict[int, dict]) -> tuple[dict[int, dict], list[str]]:
    """Every call has exactly one id (sent once or repeated identically); returns the view without ids."""
    ids = []
    view = {}
    for index, a in agg.items():
        calls = {}
        for n, t in sorted(a["tool_calls"].items()):
            assert len(set(t["ids"])) == 1, f"choice {index} call {n}: ids {t['ids']}"
            ids.append(t["ids"][0])
            calls[n] = {"type": t["type"], "name": t["name"], "arguments": t["arguments"]}
        view[index] = {**a, "tool_calls": calls}
    assert len(set(ids)) == len(ids), f"tool-call ids repeat across calls: {ids}"
    return view, ids


def whole_view(resp: dict) -> tuple[list[dict], list[str]]:
    out, ids = [], []
    for c in resp["choices"]:
        m = c["message"]
        calls = []
        for tc in m.get("tool_calls") or []:
            ids.append(tc["id"])
            calls.append({"type": tc["type"], "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]})
        out.append(
            {
                "index": c["index"],
                "role": m["role"],
                "content": m.get("content"),
                "reasoning": m.get("reasoning"),
                "tool_calls": calls,
                "finish_reason": c["finish_reason"],
                "stop_reason": c.get("stop_reason"),
                "token_ids": c.get("token_ids"),
                "logprobs": c.get("logprobs"),
            }
        )
    assert len(set(ids)) == len(ids), f"tool-call ids repeat: {ids}"
    return out, ids


def assert_parity(h: Harness, case: Case, chunkings: list[list[list[int]]], svc: Any | None = None) -> None:
    svc = svc or h.svc
    # non-streaming
    theirs = coupled(h, case, chunkings, stream=False)
    prompt_ids = theirs.prompt_token_ids
    ours = ours_whole(svc, h, case, prompt_ids, theirs.generate_logprobs)
    ours_v, ours_ids = whole_view(ours)
    theirs_v, theirs_ids = whole_view(theirs.response)
    assert ours_v == theirs_v, f"non-streaming differs\nours:   {ours_v}\ncoupled: {theirs_v}"
    assert [id_scheme(i) for i in ours_ids] == [id_scheme(i) for i in theirs_ids], (ours_ids, theirs_ids)

    # streaming
    theirs_s = coupled(h, case, chunkings, stream=True)
    assert theirs_s.prompt_token_ids == prompt_ids
    ours_chunks, outcomes = ours_stream(svc, h, case, prompt_ids, chunkings, theirs_s.generate_logprobs)
    ours_agg, ours_sids = check_stream_ids(aggregate_stream(ours_chunks))
    theirs_agg, theirs_sids = check_stream_ids(aggregate_stream(theirs_s.events))
    assert ours_agg == theirs_agg, f"streaming differs\nours:    {ours_agg}\ncoupled: {theirs_agg}"
    assert [id_scheme(i) for i in ours_sids] == [id_scheme(i) for i in theirs_sids], (ours_sids, theirs_sids)
    for a in ours_agg.values():
        assert a["finishes"] == 1
    check_outcomes(chunkings, outcomes)


def check_outcomes(chunkings: list[list[list[int]]], outcomes: list[str]) -> None:
    """The session cache: the first chunk of each index opens a session, every later one hits it.

    Choices whose first chunks are identical share a state digest (see
    ``test_n_greater_than_one_identical_prefixes_all_hit``), so for them only correctness is checked.
    """
    n_idx = len(chunkings)
    assert outcomes[:n_idx] == ["new"] * n_idx, outcomes
    firsts = [tuple(c[0]) for c in chunkings]
    if len(set(firsts)) == len(firsts):
        assert set(outcomes[n_idx:]) <= {"hit"}, outcomes


# --- tests ------------------------------------------------------------------------------------------

SCENARIO_NAMES = [
    "content_only",
    "one_call",
    "three_calls",
    "content_no_call",
    "length_in_reasoning",
    "length_in_call",
    "tool_choice_none",
    "tool_choice_none_markup",
    "tool_choice_auto",
    "tool_choice_required",
    "tool_choice_named",
    "include_reasoning_false",
    "return_token_ids",
    "parallel_tool_calls_false",
    "reasoning_effort",
    "logprobs",
    "logprobs_default_top_logprobs",
    "logprobs_include_reasoning_false",
    "stray_special_token",
    "stray_special_token_kept",
    "stop_token_id",
    "include_stop_str_in_output",
    "continue_final_message",
    "echo",
    "multi_turn",
    "n2",
]
# Every scenario runs under these chunkings; the markup-heavy ones under all of CHUNKINGS.
CORE_CHUNKINGS = ["1tok", "rand1to4", "cut_after_markers"]
MARKUP_SCENARIOS = {
    "one_call",
    "three_calls",
    "length_in_call",
    "tool_choice_required",
    "tool_choice_named",
    "parallel_tool_calls_false",
    "multi_turn",
    "n2",
}


def _cases(h: Harness) -> dict[str, Case]:
    if not hasattr(h, "_cases"):
        h._cases = scenarios(h)
    return h._cases


@pytest.mark.parametrize(
    "scenario,chunking",
    [(s, c) for s in SCENARIO_NAMES for c in (CHUNKINGS if s in MARKUP_SCENARIOS else CORE_CHUNKINGS)],
)
def test_scenarios_match_coupled_vllm(h: Harness, scenario: str, chunking: str):
    failures = []
    matching = [(name, case) for name, case in _cases(h).items() if name.split("+")[0] == scenario]
    if not matching:
        pytest.skip(f"{scenario} does not apply to {h.name}")
    for name, case in matching:
        chunkings = [CHUNKINGS[chunking](h, o.token_ids) for o in case.outputs]
        try:
            assert_parity(h, case, chunkings)
        except AssertionError as exc:
            failures.append(f"[{name}] {exc}")
    assert not failures, "\n\n".join(failures)


@st.composite
def random_case(draw, h: Harness) -> tuple[Case, list[list[list[int]]]]:
    kw = draw(st.sampled_from(h.config.thinking_kwargs))
    tools = draw(st.sampled_from([True, True, True, False]))
    choice = draw(st.sampled_from([None, "auto", "none", "required", NAMED])) if tools else None
    extra: dict[str, Any] = {}
    if draw(st.booleans()):
        extra["include_reasoning"] = draw(st.booleans())
    if draw(st.booleans()):
        extra["return_token_ids"] = True
    if draw(st.booleans()):
        extra["parallel_tool_calls"] = False
    if draw(st.booleans()):
        extra["logprobs"] = True
        # top_logprobs 0 (the default) is its own scenario, "logprobs_default_top_logprobs"
        extra["top_logprobs"] = draw(st.integers(1, 3))
    n = draw(st.sampled_from([1, 1, 2]))
    if n > 1:
        extra["n"] = n
    req = request_for(h, tools=tools, tool_choice=choice, kwargs=kw, **extra)
    outs = []
    for _ in range(n):
        calls = draw(st.lists(st.sampled_from(CALLS), min_size=0, max_size=3))
        finish = draw(st.sampled_from(["stop", "stop", "length"]))
        outs.append(
            make_output(
                h,
                req,
                reasoning=draw(st.sampled_from([None, *REASONINGS])),
                content=draw(st.sampled_from(CONTENTS)),
                calls=calls,
                finish=finish,
                cut=draw(st.floats(0.05, 0.95)),
            )
        )
    chunkings = []
    for o in outs:
        sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=12))
        chunkings.append(chunk_by_sizes(o.token_ids, sizes))
    return Case(req, outs), chunkings


@settings(
    max_examples=int(__import__("os").environ.get("PARITY_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_random_cases_match_coupled_vllm(h: Harness, data):
    case, chunkings = data.draw(random_case(h))
    assert_parity(h, case, chunkings)


def _normalize_ids(obj: Any) -> Any:
    """Tool-call ids and ``created`` replaced by first-appearance placeholders (random per run)."""
    seen: dict[str, str] = {}

    def walk(x: Any, key: str | None = None) -> Any:
        if isinstance(x, dict):
            return {k: ("<created>" if k == "created" else walk(v, k)) for k, v in x.items()}
        if isinstance(x, list):
            if key == "last_tool_call_ids":
                return [seen.setdefault(v, f"<id{len(seen)}>") for v in x]
            return [walk(v) for v in x]
        if key == "id" and isinstance(x, str) and x != "r":
            return seen.setdefault(x, f"<id{len(seen)}>")
        return x

    return walk(obj)


@pytest.mark.parametrize("scenario", ["three_calls", "one_call", "tool_choice_named", "length_in_call"])
@pytest.mark.parametrize("move", ["after1", "after3", "after9", "after20", "alternate"])
def test_moving_a_stream_to_another_replica_changes_nothing(h: Harness, scenario: str, move: str):
    """Chunks 1..k on replica A, the rest on a fresh replica B (which replays the carried state), or
    every chunk on the other replica (``alternate``): the same chunks and states, byte for byte
    (``created`` and the random tool-call ids aside), as staying on A."""
    case = _cases(h)[scenario]
    (o,) = case.outputs
    chunks = CHUNKINGS["rand1to4"](h, o.token_ids)
    req = dict(case.chat_request, stream=True)
    prompt_ids = coupled(h, case, [chunks], stream=False).prompt_token_ids

    def run(pick: Callable[[int], Any]) -> tuple[list[dict], list[str]]:
        state, out, outcomes = None, [], []
        for k, c in enumerate(chunks):
            last = k == len(chunks) - 1
            raw, oc = pick(k).chat_with_outcome(stream_body(h, req, prompt_ids, 0, c, o.finish_reason if last else None, None, state))
            resp = json.loads(raw)
            state = resp["stream_state"]
            out.append(resp)
            outcomes.append(oc)
        return out, outcomes

    a = h.fresh_service()
    stay, stay_outcomes = run(lambda k: a)
    a2, b = h.fresh_service(), h.fresh_service()
    if move == "alternate":
        moved, moved_outcomes = run(lambda k: (a2, b)[k % 2])
        assert moved_outcomes == ["new"] + ["miss"] * (len(chunks) - 1)
    else:
        k_move = int(move.removeprefix("after"))
        moved, moved_outcomes = run(lambda k: a2 if k < k_move else b)
        if k_move < len(chunks):
            assert moved_outcomes[k_move] == "miss"
            assert set(moved_outcomes[k_move + 1 :]) <= {"hit"}
    assert stay_outcomes == ["new"] + ["hit"] * (len(chunks) - 1)
    assert json.dumps(_normalize_ids(stay), ensure_ascii=False) == json.dumps(_normalize_ids(moved), ensure_ascii=False)
    # and the moved stream still matches coupled vLLM
    theirs = coupled(h, case, [chunks], stream=True)
    ours_agg, _ = check_stream_ids(aggregate_stream([r["chunk"] for r in moved]))
    theirs_agg, _ = check_stream_ids(aggregate_stream(theirs.events))
    assert ours_agg == theirs_agg


def test_n_greater_than_one_identical_prefixes_all_hit(h: Harness):
    """n=2 streams whose outputs start alike (common: both open with ``<think>``) each keep their session.

    The cache key is the digest of the carried state (prompt, output ids, chunk lengths, flags), which
    is the same for both indices until they diverge, so one index's ``put`` replaces the other's
    session and every chunk then misses and replays. Output stays correct (checked below); only the
    cache is defeated.
    """
    req = request_for(h, n=2)
    # a shared prefix (reasoning if any, then the same opening sentence), then different endings
    first = make_output(h, req, reasoning=REASONINGS[2], content=CONTENTS[0], calls=CALLS[:1])
    second = make_output(h, req, reasoning=REASONINGS[2], content=CONTENTS[0] + CONTENTS[1], calls=[])
    case = Case(req, [first, second])
    chunkings = [[[t] for t in o.token_ids] for o in case.outputs]
    theirs = coupled(h, case, chunkings, stream=True)
    svc = h.fresh_service()
    ours_chunks, outcomes = ours_stream(svc, h, case, theirs.prompt_token_ids, chunkings)
    ours_agg, _ = check_stream_ids(aggregate_stream(ours_chunks))
    theirs_agg, _ = check_stream_ids(aggregate_stream(theirs.events))
    assert ours_agg == theirs_agg
    assert outcomes[:2] == ["new", "new"]
    assert outcomes.count("miss") == 0, f"{outcomes.count('miss')} misses of {len(outcomes)} chunks: {outcomes[:12]}..."


def _usage_view(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    keys = ("prompt_tokens", "completion_tokens", "total_tokens", "completion_tokens_details")
    return {k: usage.get(k) for k in keys}


@pytest.mark.parametrize("scenario", ["one_call", "length_in_reasoning"])
def test_usage_matches_coupled_vllm(h: Harness, scenario: str):
    """``usage`` as ``vllm serve`` reports it, given the engine's counts: with a reasoning parser
    configured, ``completion_tokens_details.reasoning_tokens`` is the parser's count."""
    case = _cases(h)[scenario]
    (o,) = case.outputs
    chunks = CHUNKINGS["rand1to4"](h, o.token_ids)
    theirs = coupled(h, case, [chunks], stream=False)
    prompt_ids = theirs.prompt_token_ids
    n_prompt, n_out = len(prompt_ids), len(o.token_ids)
    engine_usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    gen = {
        "request_id": "r",
        "choices": [{"index": 0, "token_ids": o.token_ids, "finish_reason": o.finish_reason}],
        "usage": engine_usage,
        "prompt_token_ids": prompt_ids,
    }
    body = {
        "model": h.model_name,
        "generate_response": gen,
        "chat_request": case.chat_request,
        "prompt_token_ids": prompt_ids,
        "prompt_tokens": n_prompt,
    }
    ours = json.loads(h.svc.chat(json.dumps(body).encode()))
    assert _usage_view(ours["usage"]) == _usage_view(theirs.response["usage"])

    # streaming: the final usage-only chunk (stream_options.include_usage)
    req = dict(case.chat_request, stream=True, stream_options={"include_usage": True})
    theirs_s = h.oracle.run(req, [ScriptedChoice(o.token_ids, o.finish_reason, None, chunks)])
    state = None
    for k, c in enumerate(chunks):
        last = k == len(chunks) - 1
        resp = json.loads(h.svc.chat(stream_body(h, req, prompt_ids, 0, c, o.finish_reason if last else None, None, state)))
        state = resp["stream_state"]
    usage_chunk = {"request_id": "r", "choices": [], "usage": engine_usage}
    body = {
        "stream": True,
        "model": h.model_name,
        "generate_chunk": usage_chunk,
        "stream_state": state,
        "chat_request": req,
        "prompt_token_ids": prompt_ids,
        "prompt_tokens": n_prompt,
    }
    ours_final = json.loads(h.svc.chat(json.dumps(body).encode()))["chunk"]
    assert theirs_s.events[-1]["choices"] == [] and ours_final["choices"] == []
    assert _usage_view(ours_final["usage"]) == _usage_view(theirs_s.events[-1]["usage"])


@pytest.mark.parametrize("cut", [0.08, 0.15, 0.5, 0.9])
def test_finished_twin_stream_does_not_hand_its_session_over(h: Harness, cut: float):
    """n=2 where choice 1 is choice 0 cut short (``length``) — e.g. greedy sampling, or two
    identical requests. After choice 1's final chunk its finalized session is filed under the same
    state digest that choice 0 carries at that moment; choice 0 must not continue on it (with cuts
    inside the reasoning, a finalized reasoning parser turns the rest of choice 0's reasoning into
    content)."""
    failures = []
    for kw in h.config.thinking_kwargs:
        req = request_for(h, n=2, kwargs=kw)
        full = make_output(h, req, reasoning=REASONINGS[1], content=CONTENTS[0], calls=CALLS[:2])
        k = max(1, int(len(full.token_ids) * cut))
        case = Case(req, [full, Output(full.token_ids[:k], "length")])
        chunkings = [[[t] for t in o.token_ids] for o in case.outputs]
        theirs = coupled(h, case, chunkings, stream=True)
        ours_chunks, _ = ours_stream(h.fresh_service(), h, case, theirs.prompt_token_ids, chunkings)
        ours_agg, _ = check_stream_ids(aggregate_stream(ours_chunks))
        theirs_agg, _ = check_stream_ids(aggregate_stream(theirs.events))
        if ours_agg != theirs_agg:
            failures.append(f"kwargs={kw}, cut at token {k}:\n  ours:    {ours_agg}\n  coupled: {theirs_agg}")
    assert not failures, "\n".join(failures)

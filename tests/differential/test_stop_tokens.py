"""The stop-token rule (``serve_app/derender/stop.py``) against vLLM, on all three builtin tokenizer families.

Which final token's text is left out decides whether users lose text, so every case is compared
with vLLM where vLLM is right:

* coupled ``vllm serve`` (:class:`CoupledOracle`: vLLM's chat and completion serving over its engine
  detokenizer) wherever the engine can produce the case: a stop on an EOS id (the tokenizer's, or
  another of the generation config's), on a ``stop_token_ids`` hit, with
  ``include_stop_str_in_output``, with ``skip_special_tokens`` off, the stop token alone in the final
  chunk or inside a multi-token one;
* vLLM's derender (``ServingDerender``) where coupled serving cannot: a ``stop`` finish on an ordinary
  token (an orchestrator's stop string, a trimming engine, a replayed log) and ``length``. All text is
  kept there, and re-encoding the answer gives the output ids back.

Ours: the plain derender service (chat and completions) and, for chat, the parser derender service
(hermes + qwen3 on qwen3-tiny), non-streaming and streamed at one token and at random 1-4 tokens
per chunk.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from serve_app.config import AppArgs
from tests.differential.coupled_oracle import CoupledOracle, ScriptedChoice
from tests.harness.derender_stream import carry_state, token_chunks

FAMILIES = ("qwen3-tiny", "deepseek-v4", "mistral-sp")
# Markerless texts whose last token is ordinary punctuation, CJK, or an emoji (byte-level pieces in
# qwen3 / deepseek, byte-fallback pieces in mistral's sentencepiece).
TEXTS = ("The answer is four.", "Hello! How can I help?", "你好世界 😀")
CHUNKINGS = ("1tok", "rand1to4")
PARSER_FLAGS = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3", "enable_auto_tool_choice": True}


class Side:
    """One model (and parser flag set): our services, vLLM's coupled serving and vLLM's derender."""

    def __init__(self, name: str, **flags: Any) -> None:
        from serve_app.derender.parser import build_parser_service
        from serve_app.derender.plain import build_plain_service

        self.args = AppArgs(model=name, **flags)
        self.model = self.args.resolve()
        self.coupled = CoupledOracle(self.args, self.model)
        self.tok = self.coupled.tokenizer
        loop = self.coupled.loop
        # vLLM's derender and our parser service both over the oracle's render stack (read-only).
        self.vllm_derender = self.coupled.state.serving_derender
        self.plain = build_plain_service(self.args, self.model)
        self.chat_service = self.plain
        if flags:
            self.chat_service = loop.run_until_complete(build_parser_service(self.args, self.model, self.coupled.state))
        self.eos = self.model.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def reencode(self, answer: str) -> list[int]:
        """The ids of a derendered answer. A sentencepiece tokenizer prepends ``▁`` when encoding, and
        that piece opening the output shows as a space after a prompt (as in vLLM): drop it first."""
        prepends = self.tok.convert_ids_to_tokens(self.encode("a"))[0].startswith("▁")
        return self.encode(answer.removeprefix(" ") if prepends else answer)


# One side per model at a time (pytest groups the tests by param): each holds vLLM's render stack.
@pytest.fixture(scope="module", params=[*FAMILIES, "qwen3-tiny+parsers"])
def s(request, model_dirs) -> Iterator[Side]:
    name, _, parsers = request.param.partition("+")
    side = Side(name, **(PARSER_FLAGS if parsers else {}))
    yield side
    side.coupled.close()


@dataclass
class Finish:
    ids: list[int]
    finish_reason: str
    stop_reason: int | str | None


def chunks(ids: list[int], chunking: str) -> list[list[int]]:
    if chunking == "1tok":
        return [[t] for t in ids]
    rng, out, i = random.Random(len(ids)), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i : i + n])
        i += n
    return out


def chat_request(s: Side, **extra: Any) -> dict[str, Any]:
    req = {"model": s.model.name, "messages": [{"role": "user", "content": "Say something."}], **extra}
    if s.args.reasoning_parser:
        req["chat_template_kwargs"] = {"enable_thinking": False}  # the answer is content, not reasoning
    return req


# --- our side -----------------------------------------------------------------------------------


def our_chat(s: Side, req: dict, prompt: list[int], f: Finish, chunking: str | None) -> tuple[str, str | None, Any]:
    """(content, finish_reason, stop_reason) of our chat derender, whole (``chunking`` None) or streamed."""
    if chunking is None:
        body = {
            "generate_response": {
                "request_id": "r",
                "choices": [{"index": 0, "token_ids": f.ids, "finish_reason": f.finish_reason, "stop_reason": f.stop_reason}],
            },
            "chat_request": req,
            "prompt_token_ids": prompt,
        }
        (choice,) = json.loads(s.chat_service.chat(json.dumps(body).encode()))["choices"]
        return choice["message"]["content"] or "", choice["finish_reason"], choice["stop_reason"]
    text, last = [], None
    parts = token_chunks(chunks(f.ids, chunking), finish_reason=f.finish_reason, stop_reason=f.stop_reason)
    for out in carry_state(lambda body: json.loads(s.chat_service.chat(json.dumps(body).encode())), parts,
                           chat_request=req, prompt_token_ids=prompt):
        (last,) = out["chunk"]["choices"]
        text.append(last["delta"].get("content") or "")
    return "".join(text), last["finish_reason"], last["stop_reason"]


def our_completion(s: Side, req: dict, prompt: list[int], f: Finish, chunking: str | None) -> str:
    if chunking is None:
        gen = {"request_id": "r", "choices": [{"index": 0, "token_ids": f.ids, "finish_reason": f.finish_reason,
                                               "stop_reason": f.stop_reason}]}
        body = {"generate_responses": [gen], "completion_request": req, "prompt_token_ids": [prompt]}
        return json.loads(s.plain.completion(json.dumps(body).encode()))["choices"][0]["text"]
    text = []
    parts = token_chunks(chunks(f.ids, chunking), finish_reason=f.finish_reason, stop_reason=f.stop_reason)
    for out in carry_state(lambda body: json.loads(s.plain.completion(json.dumps(body).encode())), parts,
                           completion_request=req, prompt_token_ids=prompt):
        text.append(out["chunk"]["choices"][0]["text"])
    return "".join(text)


# --- vLLM's side --------------------------------------------------------------------------------


def coupled_chat(s: Side, req: dict, f: Finish, chunking: str | None) -> tuple[list[int], str, str | None, Any]:
    """(prompt ids, content, finish_reason, stop_reason) from coupled ``vllm serve``."""
    steps = chunks(f.ids, chunking) if chunking else None
    result = s.coupled.run({**req, "stream": chunking is not None}, [ScriptedChoice(f.ids, f.finish_reason, f.stop_reason, steps)])
    if chunking is None:
        (choice,) = result.response["choices"]
        return result.prompt_token_ids, choice["message"]["content"] or "", choice["finish_reason"], choice["stop_reason"]
    deltas = [e["choices"][0] for e in result.events if e["choices"]]
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    last = next(d for d in reversed(deltas) if d["finish_reason"] is not None)
    return result.prompt_token_ids, text, last["finish_reason"], last["stop_reason"]


def coupled_completion(s: Side, req: dict, f: Finish, chunking: str | None) -> tuple[list[int], str]:
    steps = chunks(f.ids, chunking) if chunking else None
    result = s.coupled.run_completion(
        {**req, "stream": chunking is not None}, [ScriptedChoice(f.ids, f.finish_reason, f.stop_reason, steps)]
    )
    if chunking is None:
        return result.prompt_token_ids, result.response["choices"][0]["text"]
    return result.prompt_token_ids, "".join(e["choices"][0]["text"] for e in result.events if e["choices"])


def vllm_derender_chat(s: Side, req: dict, prompt: list[int], f: Finish) -> str:
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as P

    body = {
        "generate_response": {"request_id": "r", "choices": [{"index": 0, "token_ids": f.ids, "finish_reason": f.finish_reason,
                                                              "stop_reason": f.stop_reason}]},
        "chat_request": req,
        "prompt_token_ids": prompt,
    }
    out = s.coupled.loop.run_until_complete(s.vllm_derender.derender_chat_response(P.DerenderChatRequest.model_validate(body)))
    return out.choices[0].message.content or ""


def vllm_derender_completion(s: Side, req: dict, prompt: list[int], f: Finish) -> str:
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as P

    gen = {"request_id": "r", "choices": [{"index": 0, "token_ids": f.ids, "finish_reason": f.finish_reason, "stop_reason": f.stop_reason}]}
    body = {"generate_responses": [gen], "completion_request": req, "prompt_token_ids": [prompt]}
    out = s.coupled.loop.run_until_complete(
        s.vllm_derender.derender_completion_response(P.DerenderCompletionRequest.model_validate(body))
    )
    return out.choices[0].text


# --- cases the engine produces: coupled vllm serve decides ------------------------------------


def engine_stops(s: Side, text: str) -> dict[str, tuple[dict, Finish]]:
    """Named engine-side stops for ``text``: (extra request fields, the output)."""
    ids = s.encode(text)
    cases = {
        "eos": ({}, Finish(ids + [s.eos], "stop", None)),
        "eos_special_kept": ({"skip_special_tokens": False}, Finish(ids + [s.eos], "stop", None)),
        "eos_include_stop_str": ({"include_stop_str_in_output": True, "skip_special_tokens": False},
                                 Finish(ids + [s.eos], "stop", None)),
        # an ordinary token in stop_token_ids: the engine names it in stop_reason, its text is dropped
        "stop_token_ids_hit": ({"stop_token_ids": [ids[-1]]}, Finish(ids, "stop", ids[-1])),
    }
    for extra in (i for i in s.model.eos_token_ids if i != s.eos):  # qwen3: <|endoftext|> from generation_config
        cases["generation_config_eos"] = ({"skip_special_tokens": False}, Finish(ids + [extra], "stop", extra))
    return cases


@pytest.mark.parametrize("chunking", [None, *CHUNKINGS])
@pytest.mark.parametrize("text", TEXTS)
def test_engine_stops_match_coupled_vllm(s: Side, text: str, chunking: str | None):
    for name, (extra, f) in engine_stops(s, text).items():
        req = chat_request(s, **extra)
        prompt, want, want_finish, want_stop = coupled_chat(s, req, f, chunking)
        got = our_chat(s, req, prompt, f, chunking)
        assert got == (want, want_finish, want_stop), (name, got, want)
        if name in ("eos", "eos_special_kept", "generation_config_eos"):
            assert s.reencode(want) == f.ids[:-1], name  # the stop token's text is left out, nothing else
        if s.args.has_parser:
            continue  # completions never parse
        completion_req = {"model": s.model.name, "prompt": "Say something.", **extra}
        prompt, want = coupled_completion(s, completion_req, f, chunking)
        assert our_completion(s, completion_req, prompt, f, chunking) == want, name


# --- cases the engine cannot produce: vLLM's derender decides ----------------------------------


@pytest.mark.parametrize("chunking", [None, *CHUNKINGS])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", ["stop_on_ordinary_token", "stop_string", "length"])
def test_ordinary_last_token_is_kept_as_vllm_derender(s: Side, text: str, chunking: str | None, finish: str):
    ids = s.encode(text)
    f = {
        "stop_on_ordinary_token": Finish(ids, "stop", None),
        "stop_string": Finish(ids, "stop", "STOP"),
        "length": Finish(ids, "length", None),
    }[finish]
    req = chat_request(s)
    prompt = s.encode("Say something.")
    got, got_finish, _ = our_chat(s, req, prompt, f, chunking)
    assert got == vllm_derender_chat(s, req, prompt, f)
    assert s.reencode(got) == ids  # the round trip: no token's text is lost
    assert got_finish == f.finish_reason
    if not s.args.has_parser:
        completion_req = {"model": s.model.name, "prompt": "Say something."}
        got = our_completion(s, completion_req, prompt, f, chunking)
        assert got == vllm_derender_completion(s, completion_req, prompt, f)
        assert s.reencode(got) == ids


def test_stop_token_alone_in_the_final_chunk_and_inside_it(s: Side):
    """The same EOS stop, its stop token alone in the last chunk and as the tail of a 3-token chunk."""
    ids = s.encode("Hello! How can I help?")
    f = Finish(ids + [s.eos], "stop", None)
    req = chat_request(s, skip_special_tokens=False)
    for steps in ([*([t] for t in ids), [s.eos]], [*([t] for t in ids[:-2]), [*ids[-2:], s.eos]]):
        result = s.coupled.run({**req, "stream": True}, [ScriptedChoice(f.ids, "stop", None, steps)])
        want = "".join(e["choices"][0]["delta"].get("content") or "" for e in result.events if e["choices"])
        got = []
        for out in carry_state(lambda body: json.loads(s.chat_service.chat(json.dumps(body).encode())), token_chunks(steps),
                               chat_request=req, prompt_token_ids=result.prompt_token_ids):
            got.append(out["chunk"]["choices"][0]["delta"].get("content") or "")
        assert "".join(got) == want
        assert s.reencode(want) == ids


def test_stop_reason_naming_another_token_keeps_the_text(s: Side):
    """``stop_reason`` names the token that stopped generation: a last token it does not name is text."""
    ids = s.encode("The answer is four.")
    f = Finish(ids, "stop", s.eos)  # the engine claims EOS, but the output does not end on it
    got, _, stop_reason = our_chat(s, chat_request(s), s.encode("x"), f, None)
    assert s.reencode(got) == ids and stop_reason == s.eos


def test_n_greater_than_one_applies_the_rule_per_choice(s: Side):
    a, b = s.encode("The answer is four."), s.encode("你好世界 😀")
    req = chat_request(s, n=2)
    choices = [ScriptedChoice(a + [s.eos], "stop"), ScriptedChoice(b, "length")]
    result = s.coupled.run({**req, "stream": False}, choices)
    body = {
        "generate_response": {"request_id": "r", "choices": [
            {"index": 0, "token_ids": a + [s.eos], "finish_reason": "stop"},
            {"index": 1, "token_ids": b, "finish_reason": "length"},
        ]},
        "chat_request": req,
        "prompt_token_ids": result.prompt_token_ids,
    }
    ours = json.loads(s.chat_service.chat(json.dumps(body).encode()))["choices"]
    want = [(c["message"]["content"], c["finish_reason"]) for c in result.response["choices"]]
    assert [(c["message"]["content"], c["finish_reason"]) for c in ours] == want
    assert [s.reencode(c[0]) for c in want] == [a, b]

"""PlainDerender against vLLM's own ``ServingDerender`` (no parser) on the same inputs.

Property-based: random token sequences (special tokens, byte-fallback pieces, emoji / CJK, ids
past the tokenizer), random chunkings (one token per chunk and multi-token chunks), with and
without logprobs and prompt seeds. Non-streaming output, every streamed chunk and every carried
state must equal vLLM's (``created`` aside), and the streamed text must concatenate to the
non-streaming text.

The outputs end on ``length`` or on a stop string (``stop`` with a string ``stop_reason``), where
vLLM's derender keeps every token's text, as it should. An output ending on a stop token is where
vLLM's derender is wrong (it shows the stop token's text): ``test_stop_tokens.py`` compares those
with coupled ``vllm serve``.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from serve_app.config import AppArgs
from serve_app.derender.detokenize import _MAX_PENDING
from serve_app.derender.model import DerenderLimits, DerenderModel
from serve_app.derender.plain_service import PlainDerenderService
from serve_app.derender.tokenizer import DetokTokenizer
from serve_app.errors import ApiError

MODELS = ("qwen3-tiny", "deepseek-v4", "mistral-sp")
TEXTS = [
    "Hello world",
    "héllo 😀 世界",
    "🦜𝄞🧬 ꙮ",
    "日本語のテキストと emoji 🫠",
    "code(x) {\n\treturn 42;\n}",
    " leading",
    "The answer is four.",
]


class Pair:
    """Our service and vLLM's, for one model."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        from serve_app._vllm import build_render_state

        args = AppArgs(model=name)
        model = args.resolve()
        self.loop = asyncio.new_event_loop()
        self.vllm = self.loop.run_until_complete(build_render_state(args, model)).serving_derender
        tok = DetokTokenizer(model.tokenizer_dir, model.special_token_ids)
        limits = DerenderLimits(model.max_model_len, 20, 16384)
        self.ours = PlainDerenderService(DerenderModel(tok, model.served_model_names, limits, model.eos_token_ids))
        self.vocab = tok.vocab_size
        hf = self.hf = AutoTokenizer.from_pretrained(model.tokenizer_dir)
        self.interesting = sorted(
            {*model.special_token_ids, *(i for t in TEXTS for i in hf.encode(t, add_special_tokens=False))}
        )

    def vllm_call(self, kind: str, body: dict) -> tuple[int, dict]:
        from pydantic import TypeAdapter, ValidationError
        from vllm.entrypoints.scale_out.token_in_token_out import protocol as P

        union = P.DerenderChatRequestUnion if kind == "chat" else P.DerenderCompletionRequestUnion
        try:
            request = TypeAdapter(union).validate_python(body)
        except ValidationError:
            return 400, {}
        except Exception as exc:  # VLLMValidationError from a request validator
            return 400, {"error": {"message": str(exc).split(" (parameter=")[0]}}
        sd = self.vllm
        if kind == "chat":
            coro = sd.derender_chat_stream_response(request) if request.stream else sd.derender_chat_response(request)
        else:
            coro = (
                sd.derender_completion_stream_response(request)
                if request.stream
                else sd.derender_completion_response(request)
            )
        try:
            out = self.loop.run_until_complete(coro)
        except ValueError as exc:
            return 400, {"error": {"message": str(exc)}}
        if hasattr(out, "error"):
            return out.error.code, out.model_dump()
        if isinstance(out, tuple):
            return 200, {"chunk": out[0].model_dump(), "stream_state": out[1].model_dump()}
        return 200, json.loads(json.dumps(out.model_dump()))

    def our_call(self, kind: str, body: dict) -> tuple[int, dict]:
        try:
            raw = (self.ours.chat if kind == "chat" else self.ours.completion)(json.dumps(body).encode())
        except ApiError as exc:
            return exc.status_code, {"error": {"message": exc.message}}
        return 200, json.loads(raw)


@pytest.fixture(scope="module", params=MODELS)
def pair(request, model_dirs) -> Pair:
    return Pair(request.param)


def _strip_created(obj: dict) -> dict:
    obj = json.loads(json.dumps(obj))
    for holder in (obj, obj.get("chunk", {})):
        holder.pop("created", None)
    return obj


def _assert_same(pair: Pair, kind: str, body: dict) -> dict:
    ours_status, ours = pair.our_call(kind, body)
    vllm_status, theirs = pair.vllm_call(kind, body)
    assert ours_status == vllm_status, (ours, theirs)
    if ours_status == 200:
        assert _strip_created(ours) == _strip_created(theirs)
    elif "message" in theirs.get("error", {}):
        assert ours["error"]["message"] == theirs["error"]["message"]
    return ours


def _logprobs(rng: random.Random, ids: list[int], vocab: int) -> dict:
    return {
        "content": [
            {
                "token_id": t,
                "logprob": -rng.random() * 5,
                "rank": rng.randint(1, 5),
                "top_logprobs": [{"token_id": t, "logprob": -0.5, "rank": 1}]
                + [{"token_id": rng.randrange(vocab), "logprob": -1.5 - k, "rank": 2 + k} for k in range(rng.randint(0, 3))],
            }
            for t in ids
        ]
    }


@st.composite
def cases(draw, pair: Pair):
    pool = st.one_of(
        st.sampled_from(pair.interesting),
        st.integers(min_value=0, max_value=pair.vocab - 1),
        st.integers(min_value=pair.vocab, max_value=pair.vocab + 5),  # past the tokenizer's vocab
    )
    ids = draw(st.lists(pool, min_size=1, max_size=40))
    prompt = draw(st.one_of(st.none(), st.lists(st.sampled_from(pair.interesting), min_size=1, max_size=10)))
    seed = draw(st.integers(0, 2**32))
    skip = draw(st.booleans())
    with_logprobs = draw(st.booleans())
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=len(ids)))
    finish = draw(st.sampled_from([("length", None), ("stop", "</stop>")]))
    return ids, prompt, seed, skip, with_logprobs, sizes, finish


def _held_run(pair: Pair, ids: list[int]) -> int:
    """The longest run of tokens after each of which the text ends in U+FFFD: vLLM holds such a run back
    without bound, we emit it past ``_MAX_PENDING`` pieces (the documented difference in detokenize.py,
    tested against its own expectation in tests/unit/test_detokenize.py)."""
    longest = run = 0
    for k in range(len(ids)):
        text = pair.hf.decode([i for i in ids[: k + 1] if i < pair.vocab])
        run = run + 1 if text.endswith("\ufffd") else 0
        longest = max(longest, run)
    return longest


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_chat_and_completions_match_vllm_streaming_and_not(pair: Pair, data):
    ids, prompt, seed, skip, with_logprobs, sizes, (finish_reason, stop_reason) = data.draw(cases(pair))
    assume(_held_run(pair, ids) <= _MAX_PENDING)
    rng = random.Random(seed)
    logprobs = _logprobs(rng, ids, pair.vocab) if with_logprobs else None
    chat_request = {"messages": [{"role": "user", "content": "x"}], "skip_special_tokens": skip, "return_token_ids": True}
    end = {"finish_reason": finish_reason, "stop_reason": stop_reason}
    gen = {"request_id": "r", "choices": [{"index": 0, "token_ids": ids, "logprobs": logprobs, **end}]}

    whole = _assert_same(
        pair, "chat", {"generate_response": gen, "prompt_token_ids": prompt, "chat_request": chat_request, "prompt_tokens": 3}
    )
    _assert_same(
        pair,
        "completion",
        {"generate_responses": [gen], "prompt_token_ids": [prompt], "completion_request": {"prompt": "p", "skip_special_tokens": skip}},
    )

    for kind, request_key, req in (
        ("chat", "chat_request", chat_request),
        ("completion", "completion_request", {"prompt": "p", "skip_special_tokens": skip}),
    ):
        state_ours = state_vllm = None
        text, pos = [], 0
        chunks = _chunks(ids, sizes)
        for n, chunk_ids in enumerate(chunks):
            lp = {"content": logprobs["content"][pos : pos + len(chunk_ids)]} if logprobs else None
            pos += len(chunk_ids)
            last = n == len(chunks) - 1
            chunk = {
                "request_id": "r",
                "choices": [
                    {
                        "index": 0,
                        "token_ids": chunk_ids,
                        "logprobs": lp,
                        "finish_reason": finish_reason if last else None,
                        "stop_reason": stop_reason if last else None,
                    }
                ],
            }
            body = {"stream": True, "generate_chunk": chunk, "prompt_token_ids": prompt, request_key: req}
            status_o, ours = pair.our_call(kind, {**body, "stream_state": state_ours})
            status_v, theirs = pair.vllm_call(kind, {**body, "stream_state": state_vllm})
            assert status_o == status_v == 200, (ours, theirs)
            assert _strip_created(ours) == _strip_created(theirs)
            state_ours, state_vllm = ours["stream_state"], theirs["stream_state"]
            (choice,) = ours["chunk"]["choices"]
            text.append((choice["delta"]["content"] or "") if kind == "chat" else choice["text"])
        usage_chunk = {
            "request_id": "r",
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(ids), "total_tokens": 1 + len(ids)},
        }
        body = {"stream": True, "generate_chunk": usage_chunk, "prompt_tokens": 7, request_key: req}
        assert _strip_created(pair.our_call(kind, {**body, "stream_state": state_ours})[1]) == _strip_created(
            pair.vllm_call(kind, {**body, "stream_state": state_vllm})[1]
        )
        if kind == "chat":
            assert "".join(text) == whole["choices"][0]["message"]["content"]


def test_n_greater_than_one_matches_vllm(pair: Pair):
    """n=3: one non-streaming response with three choices, and three interleaved streams (one state per index)."""
    rng = random.Random(7)
    outputs = [[rng.choice(pair.interesting) for _ in range(12)] for _ in range(3)]
    gen = {"request_id": "r", "choices": [{"index": i, "token_ids": ids, "finish_reason": "length"} for i, ids in enumerate(outputs)]}
    _assert_same(pair, "chat", {"generate_response": gen, "prompt_token_ids": pair.interesting[:5]})
    _assert_same(pair, "completion", {"generate_responses": [gen], "prompt_tokens": [4]})

    states: dict[tuple[str, int], tuple[dict | None, dict | None]] = {}
    roles: dict[int, list] = {0: [], 1: [], 2: []}
    for step in range(0, 12, 3):
        for index, ids in enumerate(outputs):  # generate interleaves the indices
            chunk = {"request_id": "r", "choices": [{"index": index, "token_ids": ids[step : step + 3]}]}
            for kind in ("chat", "completion"):
                ours_state, vllm_state = states.get((kind, index), (None, None))
                body = {"stream": True, "generate_chunk": chunk, "prompt_token_ids": pair.interesting[:5]}
                if kind == "completion":
                    body["completion_request"] = {"prompt": "p"}
                _, ours = pair.our_call(kind, {**body, "stream_state": ours_state})
                _, theirs = pair.vllm_call(kind, {**body, "stream_state": vllm_state})
                assert _strip_created(ours) == _strip_created(theirs)
                states[(kind, index)] = (ours["stream_state"], theirs["stream_state"])
                if kind == "chat":
                    roles[index].append(ours["chunk"]["choices"][0]["delta"]["role"])
    assert all(r == ["assistant", None, None, None] for r in roles.values())

"""Runs of byte tokens that never complete a UTF-8 character, against vLLM's own derender.

vLLM holds text back while the window decodes to a trailing U+FFFD, so such a run grows its window
by a piece per token (quadratic work; past 1024 pieces vLLM rejects its own ``stream_state``).
``serve_app.derender.detokenize`` emits what is settled once more than 8 pieces are held back, so:

* up to 8 held-back pieces, every streamed chunk and carried state equals vLLM's;
* past that, the streamed text, at any chunk size, concatenates to vLLM's non-streaming text (its
  U+FFFDs come out as the run goes instead of when it ends), our windows stay small, and a stream
  moves between vLLM and us mid-run in either direction with the same text.

Byte-level BPE (qwen3-tiny: single-byte pieces and the vocabulary's multi-byte pieces that are not
UTF-8 on their own) and SentencePiece byte fallback (mistral-sp: ``<0xNN>`` pieces).
"""

from __future__ import annotations

import random

import pytest

from tests.differential.test_plain_derender_parity import Pair
from tests.harness.derender_stream import carry_state, split, token_chunks

MAX_PENDING = 8  # serve_app.derender.detokenize._MAX_PENDING


@pytest.fixture(scope="module", params=["qwen3-tiny", "mistral-sp"])
def name(request, model_dirs) -> str:
    return request.param


@pytest.fixture(scope="module")
def pair(name: str) -> Pair:
    return Pair(name)


@pytest.fixture(scope="module")
def context(name: str, model_dirs) -> tuple[list[int], list[int]]:
    """A prompt, and text that ends each run (its first two ids also start it)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dirs[name])
    return hf.encode("Say it:", add_special_tokens=False), hf.encode(" then 你好 😀 and more", add_special_tokens=False)


@pytest.fixture(scope="module")
def byte_ids(pair: Pair) -> dict[int, int]:
    """byte -> the id of its single-byte piece."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = pair.ours.tok
    pieces = {p: i for i in range(tok.vocab_size) if (p := tok.piece(i)) is not None}
    if "<0x80>" in pieces:
        return {b: pieces[f"<0x{b:02X}>"] for b in range(256)}
    return {b: pieces[c] for b, c in bytes_to_unicode().items()}


@pytest.fixture(scope="module")
def non_utf8_pieces(pair: Pair, byte_ids: dict[int, int]) -> list[int]:
    """Ids whose piece is not UTF-8 on its own (byte-level: also multi-byte pieces)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = pair.ours.tok
    if tok.piece(byte_ids[0x80]) == "<0x80>":
        return [byte_ids[b] for b in range(0x80, 0x100)]
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    out = []
    for i in range(tok.vocab_size):
        piece = tok.piece(i)
        if piece and all(c in to_byte for c in piece):
            try:
                bytes(to_byte[c] for c in piece).decode("utf-8")
            except UnicodeDecodeError:
                out.append(i)
    return out


def _runs(byte_ids: dict[int, int], non_utf8: list[int], n: int, rng: random.Random) -> dict[str, list[int]]:
    """Runs of ``n`` tokens whose bytes never make a UTF-8 character (the last kind may, inside)."""
    b = byte_ids
    return {
        "continuation bytes": [b[rng.randrange(0x80, 0xC0)] for _ in range(n)],
        "bytes never in UTF-8": [b[rng.choice([0xC0, 0xC1, 0xF5, 0xF8, 0xFE, 0xFF])] for _ in range(n)],
        "lead bytes": [b[rng.choice([0xC3, 0xE4, 0xF0])] for _ in range(n)],
        "truncated characters": [b[(0xF0, 0x9F, 0x98)[k % 3]] for k in range(n)],
        "non-UTF-8 pieces": [rng.choice(non_utf8) for _ in range(n)],
    }


def _chunk(ids: list[int], last: bool) -> dict:
    return {"request_id": "r", "choices": [{"index": 0, "token_ids": ids, "finish_reason": "length" if last else None}]}


def _stream(call, ids: list[int], size: int, prompt: list[int], state: dict | None = None, start: int = 0):
    """Stream ``ids[start:]`` in chunks of ``size`` through ``call``; returns (texts, states)."""
    texts, states = [], []

    def post(body: dict) -> dict:
        status, out = call("completion", body)
        assert status == 200, out
        return out

    parts = token_chunks(split(ids[start:], size), finish_reason="length")
    for out in carry_state(post, parts, state, prompt_token_ids=prompt, completion_request={"prompt": "p"}):
        texts.append(out["chunk"]["choices"][0]["text"])
        states.append(out["stream_state"])
    return texts, states


def _whole(call, ids: list[int], prompt: list[int]) -> str:
    body = {"generate_responses": [_chunk(ids, True)], "prompt_token_ids": [prompt], "completion_request": {"prompt": "p"}}
    status, out = call("completion", body)
    assert status == 200, out
    return out["choices"][0]["text"]


@pytest.mark.parametrize("n", range(1, MAX_PENDING + 1))
def test_short_runs_match_vllm_chunk_for_chunk(pair, context, byte_ids, non_utf8_pieces, n):
    prompt, tail = context
    for kind, run in _runs(byte_ids, non_utf8_pieces, n, random.Random(n)).items():
        ids = tail[:2] + run + tail
        for size in (1, 2, 3, 7):
            ours = _stream(pair.our_call, ids, size, prompt)
            theirs = _stream(pair.vllm_call, ids, size, prompt)
            assert ours == theirs, (kind, size)


@pytest.mark.parametrize("n", [MAX_PENDING + 1, 40, 300, 1000])
def test_long_runs_give_vllms_text_with_small_windows(pair, context, byte_ids, non_utf8_pieces, n):
    prompt, tail = context
    for kind, run in _runs(byte_ids, non_utf8_pieces, n, random.Random(n)).items():
        ids = tail[:2] + run + tail
        expected = _whole(pair.vllm_call, ids, prompt)
        assert "\ufffd" in expected and expected.endswith(" and more")
        assert _whole(pair.our_call, ids, prompt) == expected, kind
        for size in (1, 3, 16, 64):
            texts, states = _stream(pair.our_call, ids, size, prompt)
            assert "".join(texts) == expected, (kind, size)
            assert max(len(s["prev_tokens"]) for s in states) <= 2 * MAX_PENDING + 2, (kind, size)


@pytest.mark.parametrize("n", [40, 300])
def test_a_stream_moves_between_vllm_and_us_mid_run(pair, context, byte_ids, non_utf8_pieces, n):
    prompt, tail = context
    rng = random.Random(n)
    for kind, run in _runs(byte_ids, non_utf8_pieces, n, rng).items():
        ids = tail[:2] + run + tail
        expected = _whole(pair.vllm_call, ids, prompt)
        size = rng.choice([1, 3, 16])
        cut = (2 + n // 2) // size * size  # mid-run, on a chunk boundary
        for first, then in ((pair.our_call, pair.vllm_call), (pair.vllm_call, pair.our_call)):
            head, states = _stream(first, ids[:cut], size, prompt)
            rest, _ = _stream(then, ids, size, prompt, state=states[-1], start=cut)
            assert "".join(head + rest) == expected, (kind, size)


def test_vllm_rejects_its_own_state_past_1024_held_pieces(pair, context, byte_ids):
    """Why the window must not grow: vLLM's stream over 1100 held-back tokens dies on its own state; ours goes on."""
    _, tail = context
    ids = tail[:2] + [byte_ids[0xFF]] * 1100 + tail
    state_o = state_v = None
    for i in range(0, len(ids), 100):
        body = {"stream": True, "generate_chunk": _chunk(ids[i : i + 100], i + 100 >= len(ids)), "completion_request": {"prompt": "p"}}
        status_o, ours = pair.our_call("completion", {**body, "stream_state": state_o})
        status_v, theirs = pair.vllm_call("completion", {**body, "stream_state": state_v})
        assert status_o == 200, ours
        state_o = ours["stream_state"]
        if status_v != 200:
            assert len(state_v["prev_tokens"]) > 1024
            break
        state_v = theirs["stream_state"]
    else:
        pytest.fail("vLLM accepted a stream_state past 1024 prev_tokens")

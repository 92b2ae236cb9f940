"""``serve_app.derender.detokenize``: work per token and the carried window stay bounded on runs of
byte tokens that never complete a UTF-8 character (vLLM re-decodes the whole run on every token).

Counted structurally: the pieces ``tokens_to_string`` is handed per token, not wall-clock time.
Text parity with vLLM on the same runs is ``tests/differential/test_detokenize_parity.py``.
"""

from __future__ import annotations

import pytest

from serve_app.config import AppArgs
from serve_app.derender.detokenize import DetokWindow, detokenize_delta, seed_window
from serve_app.derender.tokenizer import DetokTokenizer


def _byte_level_pieces() -> dict[int, str]:
    """GPT-2's byte -> vocab-character map (byte-level BPE tokenizers: Qwen, DeepSeek)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class Counting:
    """A tokenizer whose ``tokens_to_string`` counts the pieces it decodes."""

    def __init__(self, tok: DetokTokenizer) -> None:
        self.tok = tok
        self.pieces = 0

    def __getattr__(self, name: str):
        return getattr(self.tok, name)

    def tokens_to_string(self, pieces: list[str]) -> str:
        self.pieces += len(pieces)
        return self.tok.tokens_to_string(pieces)


@pytest.fixture(scope="module", params=["qwen3-tiny", "mistral-sp"])
def model(request) -> tuple[DetokTokenizer, dict[int, int], int]:
    """The tokenizer, its byte tokens (byte -> id: byte-level pieces, or SentencePiece's byte
    fallback ``<0xNN>``) and the id of " world"."""
    resolved = AppArgs(model=request.param).resolve()
    tok = DetokTokenizer(resolved.tokenizer_dir, resolved.special_token_ids)
    ids = {p: i for i in range(tok.vocab_size) if (p := tok.piece(i)) is not None}
    if request.param == "mistral-sp":
        return tok, {b: ids[f"<0x{b:02X}>"] for b in range(256)}, ids["▁world"]
    return tok, {b: ids[c] for b, c in _byte_level_pieces().items()}, ids["Ġworld"]


RUNS = {
    "continuation bytes": [0x80, 0xBF, 0x9F],
    "bytes never in UTF-8": [0xFF, 0xFE, 0xC0],
    "lead bytes": [0xE4, 0xF0],
    "truncated characters": [0xF0, 0x9F, 0x98],  # 😀 without its last byte, again and again
}


def _decode_cost(tok: DetokTokenizer, ids: list[int], chunk: int) -> tuple[str, float, int]:
    """Text, pieces decoded per token and the longest window carried between chunks."""
    counting = Counting(tok)
    window, text, longest = DetokWindow(), [], 0
    for i in range(0, len(ids), chunk):
        part, window = detokenize_delta(counting, ids[i : i + chunk], window, True)  # type: ignore[arg-type]
        text.append(part)
        longest = max(longest, len(window.prev_tokens))
    return "".join(text), counting.pieces / len(ids), longest


@pytest.mark.parametrize("run", RUNS)
def test_a_run_that_never_completes_a_character_costs_constant_work_per_token(model, run):
    tok, byte_id, world = model
    costs = []
    for n in (1000, 4000):
        ids = [world] + [byte_id[RUNS[run][k % len(RUNS[run])]] for k in range(n)] + [world]
        for chunk in (1, 7, len(ids)):
            text, per_token, longest = _decode_cost(tok, ids, chunk)
            assert longest <= 16  # vLLM carries the whole run (and rejects its own state past 1024)
            assert text.count("\ufffd") >= n // 3 and text.endswith(" world")  # the run's U+FFFDs came out
            costs.append(per_token)
    # Bounded per token, whatever the run's length: vLLM decodes ~n/2 pieces per token here.
    assert max(costs) <= 40
    assert max(costs[3:]) <= max(costs[:3]) * 1.1


def test_a_long_run_of_valid_bytes_after_an_invalid_one_is_bounded_too(model):
    """SentencePiece's byte fallback turns a whole run of byte tokens into U+FFFD when any byte of it is
    invalid; past 64 tokens the window moves on anyway (see the module docstring), so work stays bounded."""
    tok, byte_id, world = model
    ids = [byte_id[0xFF]] + [byte_id[b] for b in "你好".encode() * 700] + [world]
    _, per_token, longest = _decode_cost(tok, ids, 1)
    assert per_token <= 300 and longest <= 2 * 64 + 8


def test_short_runs_keep_vllm_windows(model):
    """Up to 8 held-back pieces nothing changes: the window holds the last emitted token and the run."""
    tok, byte_id, world = model
    ids = [world] + [byte_id[0x80]] * 8
    _, window = detokenize_delta(tok, ids, DetokWindow(), True)
    assert (len(window.prev_tokens), window.read_offset) == (9, 1)
    text, window = detokenize_delta(tok, [byte_id[0x80]], window, True)  # the 9th: all but the last 4 are settled
    assert text == "\ufffd" * 5 and window.prev_tokens[window.read_offset :] == [tok.piece(byte_id[0x80])] * 4


def test_a_long_run_of_ids_past_the_vocabulary_stops_growing_the_window(model):
    """Their pieces are empty: after an unfinished character they add nothing, and held back past 64
    of them, one more stands for all (vLLM's window grows a piece each)."""
    tok, byte_id, world = model
    ids = [byte_id[0xF0]] + [tok.vocab_size + 1] * 1000 + [byte_id[b] for b in (0x9F, 0x98, 0x80)] + [world]
    text, per_token, longest = _decode_cost(tok, ids, 1)
    assert longest <= 64 + 8 and per_token <= 200
    # As vLLM: byte-level pieces join across the empty ones; SentencePiece's byte fallback breaks the run there.
    byte_fallback = tok.piece(byte_id[0xF0]) == "<0xF0>"
    assert text == ("\ufffd" * 4 if byte_fallback else "😀") + " world"


def _slow_twin(tok: DetokTokenizer) -> DetokTokenizer:
    """The same tokenizer without the byte-level fast path: every token decodes its window twice."""
    twin = DetokTokenizer.__new__(DetokTokenizer)
    twin.__dict__.update(vars(tok))
    twin.byte_level = False
    return twin


def test_the_byte_level_fast_path_gives_the_texts_and_windows_of_the_full_algorithm(model):
    """Whole-character pieces skip the window's two decodes; mixed with byte runs, pieces that are not
    UTF-8 alone, special tokens (skipped or not), ids past the vocabulary and seeded windows, every
    chunk's text and carried window (vLLM's ``stream_state``) equal the full algorithm's."""
    import random

    tok, byte_id, world = model
    slow = _slow_twin(tok)
    assert tok.byte_level == (tok.piece(world) == "Ġworld") and not slow.byte_level
    rng = random.Random(7)
    specials = sorted(tok.special_ids)
    kinds = [
        lambda: rng.randrange(tok.vocab_size),  # any piece, whole or not
        lambda: world,
        lambda: byte_id[rng.choice([0x80, 0xE4, 0xF0, 0x9F, 0xBD, 0xFF, 0x41, 0x20])],
        lambda: rng.choice(specials),
        lambda: tok.vocab_size + rng.randrange(3),
    ]
    fast_tokens = 0
    for case in range(300):
        ids = [rng.choices(kinds, weights=[8, 4, 3, 1, 1])[0]() for _ in range(rng.randrange(1, 120))]
        skip = case % 2 == 0
        prompt = [rng.choices(kinds[:3], weights=[4, 1, 4])[0]() for _ in range(rng.randrange(0, 9))]  # may end mid-character
        windows = {"fast": seed_window(tok, prompt, skip), "slow": seed_window(slow, prompt, skip)}
        i = 0
        while i < len(ids):
            n = rng.choice([1, 1, 2, 3, 17, 200])
            got = {}
            for name, t in (("fast", tok), ("slow", slow)):
                got[name], windows[name] = detokenize_delta(t, ids[i : i + n], windows[name], skip)
            assert got["fast"] == got["slow"], (case, i)
            assert windows["fast"] == windows["slow"], (case, i)
            i += n
        fast_tokens += sum(tok.whole_text(t) is not None for t in ids)
    assert fast_tokens > 1000 if tok.byte_level else fast_tokens == 0
    # Ids past the vocabulary (a client's to choose) are not memoised: the memo stays within the vocabulary.
    detokenize_delta(tok, range(tok.vocab_size, tok.vocab_size + 5000), DetokWindow(), True)
    assert len(tok._whole) <= tok.vocab_size and all(0 <= i < tok.vocab_size for i in tok._whole)

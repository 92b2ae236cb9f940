"""Incremental detokenization, exactly vLLM 0.32's derender algorithm, as pure functions.

``detokenize_delta`` is vLLM's ``OnlineDerenderer._detokenize_delta`` over
``detokenize_incrementally``: the window ``prev_tokens[prefix_offset:]`` holds the last emitted
token plus any pending byte-fallback pieces, so chunked decoding equals one-shot decoding and the
carried state stays O(1) whatever the output length. The state strings are vocab pieces, identical
to vLLM's, so a stream can move between vLLM and this implementation mid-way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from serve_app.derender.tokenizer import DetokTokenizer

__all__ = ["INITIAL_OFFSET", "DetokWindow", "detokenize_delta", "seed_window"]

INITIAL_OFFSET = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
_SEED_IDS = INITIAL_OFFSET + 2  # "in case we have special tokens"
_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class DetokWindow:
    prev_tokens: list[str] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0


def seed_window(tok: DetokTokenizer, prompt_token_ids: list[int] | None, skip_special_tokens: bool) -> DetokWindow:
    """Prime the window from the prompt's last 7 ids, as the engine primes its detokenizer.

    Without it a SentencePiece tokenizer drops the first output token's leading space.
    """
    if not prompt_token_ids:
        return DetokWindow()
    pieces = tok.convert_ids_to_tokens(prompt_token_ids[-_SEED_IDS:], skip_special_tokens)
    prev = [p if p is not None else "" for p in pieces]
    read = len(prev)
    return DetokWindow(prev, max(read - INITIAL_OFFSET, 0), read)


def detokenize_delta(
    tok: DetokTokenizer, delta_ids: Sequence[int], window: DetokWindow, skip_special_tokens: bool
) -> tuple[str, DetokWindow]:
    """Decode ``delta_ids`` after ``window``; returns the new text and the new window (input untouched)."""
    prev = window.prev_tokens
    prefix = window.prefix_offset
    read = window.read_offset
    vocab_size = tok.vocab_size
    special = tok.special_ids if skip_special_tokens else ()
    to_string = tok.tokens_to_string
    parts: list[str] = []
    for tid in delta_ids:
        if 0 <= tid < vocab_size:
            if tid in special:
                new: list[str] = []
            else:
                piece = tok.piece(tid)
                new = [piece if piece is not None else ""]
        else:
            new = [""]
        count = len(prev) + len(new)
        start = min(prefix, read, len(prev))
        out = (prev[start:] if start else prev) + new
        prefix_text = to_string(out[prefix - start : read - start])
        full_text = to_string(out[prefix - start :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            parts.append(full_text[len(prefix_text) :])
            prefix, read = read, count
        # Trim to the tail still readable (nothing before prefix is read again) and rebase.
        prev = (prev + new)[prefix:]
        read -= prefix
        prefix = 0
    return "".join(parts), DetokWindow(prev, prefix, read)

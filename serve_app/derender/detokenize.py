"""Incremental detokenization, vLLM 0.32's derender algorithm, as pure functions.

``detokenize_delta`` is vLLM's ``OnlineDerenderer._detokenize_delta`` over
``detokenize_incrementally``: the window ``prev_tokens[prefix_offset:]`` holds the last emitted
token plus any pending byte-fallback pieces, so chunked decoding equals one-shot decoding. The
state strings are vocab pieces, identical to vLLM's, so a stream can move between vLLM and this
implementation mid-way.

One deliberate difference, for runs of byte tokens that keep the text ending in U+FFFD (bytes that
never complete a UTF-8 character). vLLM holds text back while it may be an unfinished character,
so such a run grows its window without bound: every token re-decodes the whole run (quadratic
work), its U+FFFDs come out only when a later token ends the run (never, if the output ends inside
it), and past 1024 pieces vLLM rejects its own ``stream_state``. A character is at most 4 bytes,
so once more than ``_MAX_PENDING`` pieces are held back, the text before the last ``_CHAR_BYTES``
of them can no longer change: it is emitted (the U+FFFDs, or characters, vLLM emits when the run
ends) and the window moves on, as after any emission. Work per token and the window stay bounded,
and the concatenated text is vLLM's whenever the run ends in text. The window is only moved where
vLLM's next emission from it would be the same as from the longer one, except past
``_MAX_HELD`` pieces: SentencePiece's byte fallback turns a whole run of byte tokens into U+FFFD
when any byte of it is invalid, so valid characters more than 64 tokens into such a run come out
as themselves here and as U+FFFD from vLLM.

With a byte-level decoder (Qwen, DeepSeek, Llama 3) the common token, a piece of whole characters
arriving with nothing held back, adds its own memoised text and becomes the window, without decoding
the window twice: the texts and windows are those of the full algorithm, which every other token
still takes (tests/unit/test_detokenize.py checks both against each other).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from serve_app.derender.tokenizer import DetokTokenizer

__all__ = ["INITIAL_OFFSET", "DetokWindow", "detokenize_delta", "seed_window"]

INITIAL_OFFSET = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
_SEED_IDS = INITIAL_OFFSET + 2  # "in case we have special tokens"
_REPLACEMENT = "\ufffd"
_CHAR_BYTES = 4  # the longest UTF-8 character
_MAX_PENDING = 2 * _CHAR_BYTES  # pieces held back (no text yet) before the settled part is emitted
_MAX_HELD = 64  # held back past this, settled text is emitted even where vLLM's longer window differs


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
    whole_text = tok.whole_text if tok.byte_level else None
    parts: list[str] = []
    for tid in delta_ids:
        # Byte-level fast path, the common token: a piece that is whole characters on its own starts
        # with no continuation byte, so with nothing held back vLLM's two window decodes differ by
        # exactly its text (even after an unfinished character), and the window becomes the piece alone.
        if whole_text is not None and read == len(prev) and tid not in special and (text := whole_text(tid)) is not None:
            parts.append(text)
            prev, prefix, read = [tok.piece(tid) or ""], 0, 1
            continue
        if 0 <= tid < vocab_size:
            if tid in special:
                new: list[str] = []
            else:
                piece = tok.piece(tid)
                new = [piece if piece is not None else ""]
        else:
            new = [""]
        if new == [""] and len(prev) - read > _MAX_HELD and prev[-1] == "":
            continue  # empty pieces in a row decode as one: a long held-back run of them stops growing
        count = len(prev) + len(new)
        start = min(prefix, read, len(prev))
        out = (prev[start:] if start else prev) + new
        prefix_text = to_string(out[prefix - start : read - start])
        full_text = to_string(out[prefix - start :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            parts.append(full_text[len(prefix_text) :])
            prefix, read = read, count
        elif count - read > _MAX_PENDING:
            force = count - read > _MAX_HELD
            settled = _settled_text(to_string, out[prefix - start :], read - prefix, prefix_text, full_text, force)
            if settled is not None:
                parts.append(settled)
                prefix, read = read, count - _CHAR_BYTES
        # Trim to the tail still readable (nothing before prefix is read again) and rebase.
        prev = (prev + new)[prefix:]
        read -= prefix
        prefix = 0
    return "".join(parts), DetokWindow(prev, prefix, read)


def _settled_text(
    to_string: Callable[[list[str]], str], window: list[str], read: int, prefix_text: str, full_text: str, force: bool
) -> str | None:
    """The new text of ``window`` (prefix offset 0) up to its last ``_CHAR_BYTES`` pieces, if it is
    settled and the window may move to start at ``read``; else ``None``.

    Settled: more bytes can only change a decode's last character (an unfinished UTF-8 character),
    so the text up to the cut, less its last character, must already be the window's. Movable
    (not checked when ``force``): from the moved window the text after the cut decodes the same,
    and vLLM would have held back each of the pieces after the cut too, so its next emission from
    the moved window is the one it makes from the longer window.
    """
    cut = len(window) - _CHAR_BYTES
    head = to_string(window[:cut])
    if not len(prefix_text) <= len(head) < len(full_text) or not full_text.startswith(head[:-1]):
        return None
    if not force:
        moved = [to_string(window[read:end]) for end in range(cut, len(window) + 1)]
        if moved[-1][len(moved[0]) :] != full_text[len(head) :] or not all(t.endswith(_REPLACEMENT) for t in moved[1:]):
            return None
    return full_text[len(prefix_text) : len(head)]

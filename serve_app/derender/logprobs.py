"""Generate's integer-id logprobs -> OpenAI logprobs, as vLLM 0.32's derender resolves them.

Token strings come from per-id decoding; a string ending in U+FFFD (one byte of a multi-byte
character) is repaired from up to 4 preceding sampled ids, which streaming carries across chunks
in ``logprob_context_token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serve_app.derender.tokenizer import DetokTokenizer
from serve_app.protocol import GenerateLogProbs

__all__ = ["CONTEXT_WINDOW", "context_tail", "resolve_logprobs", "to_completion_logprobs", "trim_top_logprobs"]

CONTEXT_WINDOW = 4
_REPLACEMENT = "\ufffd"


def context_tail(context: Sequence[int], delta_ids: Sequence[int]) -> list[int]:
    return [*context, *delta_ids][-CONTEXT_WINDOW:]


def _restore_leading_spaces(raw: str, text: str, marker: str) -> str:
    markers = len(raw) - len(raw.lstrip(marker))
    if markers == 0:
        return text
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def _decode_ids(tok: DetokTokenizer, ids: list[int]) -> list[tuple[str, list[int] | None]]:
    out: list[tuple[str, list[int] | None]] = []
    for tid in ids:
        raw = tok.piece(tid)
        if raw is None:
            out.append(("", None))
            continue
        text = tok.decode([tid]) or ""
        if tok.space_marker is not None:
            text = _restore_leading_spaces(raw, text, tok.space_marker)
        out.append((text, list(text.encode("utf-8", errors="replace"))))
    return out


def _correct(tok: DetokTokenizer, token_id: int, context: list[int]) -> str:
    for num_ctx in range(1, min(len(context), CONTEXT_WINDOW) + 1):
        ctx = context[-num_ctx:]
        full = tok.decode([*ctx, token_id])
        if full.endswith(_REPLACEMENT):
            continue
        clean_end = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if tok.decode([ctx[j]]).endswith(_REPLACEMENT):
                clean_end = j
            else:
                break
        prefix = tok.decode(ctx[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def resolve_logprobs(
    logprobs: GenerateLogProbs, tok: DetokTokenizer, initial_context: Sequence[int] = ()
) -> dict[str, Any]:
    """``GenerateLogProbs`` -> ``ChatCompletionLogProbs`` as a dict (vLLM's key order)."""
    if logprobs.content is None:
        return {"content": None}
    context = list(initial_context)
    content = []
    for entry in logprobs.content:
        (token, token_bytes), *tops = _decode_ids(tok, [entry.token_id, *(t.token_id for t in entry.top_logprobs)])
        if token.endswith(_REPLACEMENT):
            token = _correct(tok, entry.token_id, context)
            token_bytes = list(token.encode("utf-8"))
        resolved_top = []
        for top, (top_str, top_bytes) in zip(entry.top_logprobs, tops, strict=True):
            if top_str.endswith(_REPLACEMENT):
                top_str = _correct(tok, top.token_id, context)
                top_bytes = list(top_str.encode("utf-8"))
            resolved_top.append({"token": top_str, "logprob": top.logprob, "bytes": top_bytes})
        content.append({"token": token, "logprob": entry.logprob, "bytes": token_bytes, "top_logprobs": resolved_top})
        context.append(entry.token_id)
    return {"content": content}


def to_completion_logprobs(chat: dict[str, Any], initial_text_offset: int = 0) -> dict[str, Any]:
    """Chat-shaped logprobs -> ``CompletionLogProbs`` parallel lists; ``text_offset`` is absolute."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    if chat["content"] is None:
        return out
    offset = initial_text_offset
    for entry in chat["content"]:
        out["text_offset"].append(offset)
        out["tokens"].append(entry["token"])
        out["token_logprobs"].append(entry["logprob"])
        tops = entry["top_logprobs"]
        out["top_logprobs"].append({t["token"]: t["logprob"] for t in tops} if tops else None)
        offset += len(entry["token"])
    return out


def trim_top_logprobs(logprobs: dict[str, Any], keep: int) -> dict[str, Any]:
    """As ``vllm serve``: ``top_logprobs`` entries as the request asked (``/generate`` sends at least one)."""
    if keep >= 0:
        for entry in logprobs["content"] or ():
            del entry["top_logprobs"][keep:]
    return logprobs

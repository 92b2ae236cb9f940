"""The client side of a derender stream, as the tests and benches drive it: one ``generate_chunk`` per
call, each call carrying the ``stream_state`` the previous answer returned (the protocol of
``/v1/chat/completions/derender`` and ``/v1/completions/derender`` with ``"stream": true``).

``post`` is whatever sends one body and returns the parsed answer (an HTTP client, a service called in
process, a ``DeploymentHandle``); the caller keeps its own checks (status, timing) inside it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any

__all__ = ["acarry_state", "carry_state", "chunk", "split", "stream_body", "token_chunks"]


def chunk(token_ids: list[int], request_id: str = "r", index: int = 0, **choice: Any) -> dict[str, Any]:
    """A one-choice ``generate_chunk``; ``choice`` adds fields such as ``finish_reason``."""
    return {"request_id": request_id, "choices": [{"index": index, "token_ids": token_ids, **choice}]}


def split(ids: Sequence[int], step: int = 1) -> list[list[int]]:
    """``ids`` in parts of ``step`` ids (the last may be shorter)."""
    return [list(ids[i : i + step]) for i in range(0, len(ids), step)]


def token_chunks(
    parts: Sequence[list[int]], request_id: str = "r", finish_reason: str | None = "stop", **last: Any
) -> list[dict[str, Any]]:
    """One chunk per part. Every choice has ``finish_reason`` (None but on the last chunk) and likewise
    each field of ``last`` (e.g. ``stop_reason``)."""
    n = len(parts)
    out = []
    for k, part in enumerate(parts):
        final = k == n - 1
        choice: dict[str, Any] = {"finish_reason": finish_reason if final else None, **{f: v if final else None for f, v in last.items()}}
        out.append(chunk(part, request_id, **choice))
    return out


def stream_body(generate_chunk: dict[str, Any], state: Any, **fields: Any) -> dict[str, Any]:
    """One streamed derender call: the chunk, the carried state, and the stream's fixed ``fields``
    (``chat_request`` or ``completion_request``, ``prompt_token_ids``, ``model``...)."""
    return {"stream": True, "generate_chunk": generate_chunk, "stream_state": state, **fields}


def carry_state(post: Callable[[dict[str, Any]], dict[str, Any]], chunks: Iterable[dict[str, Any]], state: Any = None,
                **fields: Any) -> Iterator[dict[str, Any]]:
    """Post each chunk with the state the previous answer carried; yield each answer (``chunk``, ``stream_state``)."""
    for c in chunks:
        out = post(stream_body(c, state, **fields))
        state = out["stream_state"]
        yield out


async def acarry_state(post: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]], chunks: Iterable[dict[str, Any]],
                       state: Any = None, **fields: Any) -> AsyncIterator[dict[str, Any]]:
    """:func:`carry_state` for an async ``post``."""
    for c in chunks:
        out = await post(stream_body(c, state, **fields))
        state = out["stream_state"]
        yield out

"""Streaming plumbing shared by the ingress and the composition: SSE framing, peek-first, cancel-on-close.

* :func:`sse_frame` / :func:`sse_stream`: chunk dicts as vLLM's ``text/event-stream`` body.
* :func:`peek`: the first item of a stream, awaited before an HTTP response is committed, so an
  early error is still a real status code rather than an in-band frame.
* :func:`cancel_on_close`: a streaming handle call as an async iterator whose ``aclose()`` cancels
  the call downstream (a client disconnect aborts the engine request).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

from serve_app.wire import dump_json

__all__ = ["SSE_DONE", "cancel_on_close", "peek", "sse_frame", "sse_response", "sse_stream"]

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse_frame(obj: Any) -> bytes:
    """One server-sent event as vLLM writes it: ``data: <json>\\n\\n``."""
    return b"data: " + dump_json(obj) + b"\n\n"


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Chunk dicts as vLLM's SSE body: one frame each, then ``[DONE]``; closing it closes ``chunks``."""
    try:
        async for chunk in chunks:
            yield sse_frame(chunk)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


async def peek(stream: AsyncIterator[T]) -> tuple[T | None, AsyncIterator[T]]:
    """``(first item or None when empty, the whole stream again)``; a failing first item closes the
    stream and raises."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return None, stream
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise
    return first, _prepend(first, stream)


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def cancel_on_close(call: Any) -> AsyncIterator[Any]:
    """Iterate a streaming ``DeploymentResponseGenerator``; closing (or failing) cancels the call."""
    try:
        async for item in call:
            yield item
    finally:
        call.cancel()


async def sse_response(frames: AsyncIterator[bytes]) -> Any:
    """A ``text/event-stream`` response over ``frames``, its first frame awaited before the 200 is committed."""
    from fastapi.responses import StreamingResponse

    _, frames = await peek(frames)
    return StreamingResponse(frames, media_type="text/event-stream")

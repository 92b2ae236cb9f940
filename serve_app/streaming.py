"""Streaming plumbing shared by the ingress and the composition: SSE framing, peek-first, cancel-on-close.

* :func:`sse_frame` / :func:`sse_stream`: chunk dicts as vLLM's ``text/event-stream`` body.
* :func:`peek`: the first item of a stream, awaited before an HTTP response is committed, so an
  early error is still a real status code rather than an in-band frame.
* :func:`cancel_on_close`: a streaming handle call as an async iterator whose ``aclose()`` cancels
  the call downstream (a client disconnect aborts the engine request).
* :class:`StreamPacer`: caps the messages per second a replica's streams send together, so that
  past the cap each message carries the several tokens made meanwhile instead of one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from serve_app.wire import dump_json

__all__ = ["SSE_DONE", "StreamPacer", "cancel_on_close", "peek", "sse_frame", "sse_response", "sse_stream"]

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse_frame(obj: Any) -> bytes:
    """One server-sent event as vLLM writes it: ``data: <json>\\n\\n``."""
    return b"data: " + dump_json(obj) + b"\n\n"


_ERROR_FRAME = b'data: {"error"'


async def sse_stream(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[bytes, None]:
    """Chunk dicts as vLLM's SSE body: one frame each, then ``[DONE]``; closing it closes ``chunks``.

    ``chunks`` is read ahead in a task while the body is written: the frames made meanwhile (a busy
    replica, engine chunks arriving together) go out as one body write instead of one each, so each
    write's cost (ASGI middlewares, the socket, HAProxy) is paid per batch, not per token. The client
    reads the same events in the same order. An in-band error frame is written on its own, as the
    metrics middleware reads it at the start of a write.
    """
    frames: list[bytes] = []
    ready = asyncio.Event()
    failed: list[BaseException] = []
    finished = False

    async def read_ahead() -> None:
        nonlocal finished
        try:
            async for chunk in chunks:
                frames.append(sse_frame(chunk))
                ready.set()
        except Exception as exc:  # noqa: BLE001 - raised to the writer below
            failed.append(exc)
        finally:
            finished = True
            ready.set()

    reader = asyncio.create_task(read_ahead())
    try:
        while not (finished and not frames):
            await ready.wait()
            ready.clear()
            if not frames:
                continue
            batch = frames[:]
            frames.clear()
            if len(batch) > 1 and batch[-1].startswith(_ERROR_FRAME):
                yield b"".join(batch[:-1])
                batch = batch[-1:]
            yield batch[0] if len(batch) == 1 else b"".join(batch)
        if failed:
            raise failed[0]
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await chunks.aclose()
    yield SSE_DONE


async def peek(stream: AsyncGenerator[T, None]) -> tuple[T | None, AsyncGenerator[T, None]]:
    """``(first item or None when empty, the whole stream again)``; a failing first item closes the
    stream and raises."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return None, stream
    except BaseException:
        await stream.aclose()
        raise
    return first, _prepend(first, stream)


async def _prepend(first: T, rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def cancel_on_close(call: Any) -> AsyncGenerator[Any, None]:
    """Iterate a streaming ``DeploymentResponseGenerator``; closing (or failing) cancels the call."""
    try:
        async for item in call:
            yield item
    finally:
        call.cancel()


async def sse_response(frames: AsyncGenerator[bytes, None]) -> Any:
    """A ``text/event-stream`` response over ``frames``, its first frame awaited before the 200 is committed."""
    from fastapi.responses import StreamingResponse

    _, frames = await peek(frames)
    return StreamingResponse(frames, media_type="text/event-stream")


class StreamPacer:
    """Paces the streams of one replica to about ``rate`` messages per second in all.

    Each message a replica sends costs it the same CPU whatever it carries (a Serve streaming reply,
    framing, the consumer's wake-up), so a replica with many streams at one token per message can
    spend its core on messages. With ``n`` streams sending, each stream waits ``n / rate`` s (at most
    ``max_delay_s``) after a message before it asks its source for the next item; a source that
    merges what was made meanwhile (vLLM's ``RequestOutputCollector``) then hands several tokens in
    order in one item. Below the cap the waits are under the time the next token takes anyway and
    nothing merges. The first item is never held, nor the items after one that ends the output
    (``more(item)`` false: the finish, usage and ``[DONE]`` follow at once). ``rate <= 0`` is off.
    ``max_delay_s`` is Ray Serve LLM's ``stream_batching_interval_ms`` default, 50 ms.
    """

    def __init__(self, rate: float, max_delay_s: float = 0.05) -> None:
        self.rate = rate
        self.max_delay_s = max_delay_s
        self.sending = 0  # streams past their first item, on this replica

    async def pace(
        self, items: AsyncGenerator[T, None], more: Callable[[T], bool] | None = None
    ) -> AsyncGenerator[T, None]:
        """``items`` as they are, with the waits; closing this closes ``items`` (an engine request is aborted)."""
        counted = False
        try:
            async for item in items:
                sent = time.monotonic()
                yield item
                if self.rate <= 0 or (more is not None and not more(item)):
                    continue
                if not counted:
                    counted = True
                    self.sending += 1
                delay = min(self.max_delay_s, self.sending / self.rate) - (time.monotonic() - sent)
                if delay > 0.0005:
                    await asyncio.sleep(delay)
        finally:
            if counted:
                self.sending -= 1
            await items.aclose()

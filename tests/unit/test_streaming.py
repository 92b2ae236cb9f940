"""``serve_app.streaming.sse_stream``: chunks read ahead while the body is written, frames that piled up
written together; the bytes the client reads are the same as one write per chunk."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from serve_app.streaming import SSE_DONE, sse_frame, sse_stream

CHUNKS = [{"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]} for i in range(20)]
ERROR = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}


async def _source(items: list[dict[str, Any]], closed: list[bool], yield_every: int = 1) -> AsyncIterator[dict[str, Any]]:
    try:
        for i, item in enumerate(items):
            if i % yield_every == 0:
                await asyncio.sleep(0)
            yield item
    finally:
        closed.append(True)


async def _write_all(stream: AsyncIterator[bytes], slow_writer: bool) -> list[bytes]:
    writes = []
    async for body in stream:
        writes.append(body)
        if slow_writer:  # a busy replica: the reader runs ahead meanwhile
            for _ in range(5):
                await asyncio.sleep(0)
    return writes


def test_same_bytes_as_one_frame_per_chunk_and_fewer_writes_when_the_writer_lags():
    expected = b"".join(sse_frame(c) for c in CHUNKS) + SSE_DONE
    for slow in (False, True):
        closed: list[bool] = []
        writes = asyncio.run(_write_all(sse_stream(_source(CHUNKS, closed)), slow))
        assert b"".join(writes) == expected
        assert writes[-1] == SSE_DONE
        assert closed == [True]
        if slow:
            assert len(writes) < len(CHUNKS) + 1  # frames went out together


def test_an_in_band_error_frame_is_written_on_its_own():
    closed: list[bool] = []
    items = [*CHUNKS[:5], ERROR]
    writes = asyncio.run(_write_all(sse_stream(_source(items, closed, yield_every=100)), True))
    assert b"".join(writes) == b"".join(sse_frame(c) for c in items) + SSE_DONE
    assert writes[-2] == sse_frame(ERROR)


def test_closing_the_body_early_closes_the_chunks():
    closed: list[bool] = []

    async def endless() -> AsyncIterator[dict[str, Any]]:
        try:
            while True:
                await asyncio.sleep(0)
                yield CHUNKS[0]
        finally:
            closed.append(True)

    async def main() -> bytes:
        stream = sse_stream(endless())
        first = await stream.__anext__()
        await stream.aclose()  # type: ignore[attr-defined]
        return first

    assert asyncio.run(main()).startswith(sse_frame(CHUNKS[0]))
    assert closed == [True]


def test_a_failing_source_raises_after_the_frames_before_it():
    async def failing() -> AsyncIterator[dict[str, Any]]:
        yield CHUNKS[0]
        await asyncio.sleep(0)
        raise RuntimeError("engine gone")

    async def main() -> tuple[list[bytes], BaseException | None]:
        got: list[bytes] = []
        try:
            async for body in sse_stream(failing()):
                got.append(body)
        except RuntimeError as exc:
            return got, exc
        return got, None

    got, exc = asyncio.run(main())
    assert b"".join(got) == sse_frame(CHUNKS[0])
    assert isinstance(exc, RuntimeError)

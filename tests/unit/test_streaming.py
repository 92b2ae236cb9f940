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


# --- StreamPacer: fewer, fuller messages past the cap; tokens and their order unchanged ------------


class _Collector:
    """vLLM's ``RequestOutputCollector`` in small: a producer appends tokens; each read takes all made
    since the last one (merged, in order), or waits for the next."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.made: list[int] = []
        self.taken = 0
        self.closed = False

    async def produce(self) -> None:
        for token in range(self.total):
            self.made.append(token)
            await asyncio.sleep(0)

    async def outputs(self) -> AsyncIterator[list[int]]:
        try:
            while self.taken < self.total:
                if self.taken == len(self.made):
                    await asyncio.sleep(0)
                    continue
                batch, self.taken = self.made[self.taken :], len(self.made)
                yield batch
        finally:
            self.closed = True


async def _paced_run(rate: float, streams: int, total: int) -> list[list[list[int]]]:
    from contextlib import aclosing

    from serve_app.streaming import StreamPacer

    pacer = StreamPacer(rate)

    async def one() -> list[list[int]]:
        collector = _Collector(total)
        producer = asyncio.create_task(collector.produce())
        async with aclosing(pacer.pace(collector.outputs())) as paced:
            messages = [batch async for batch in paced]
        await producer
        assert collector.closed
        return messages

    results = await asyncio.gather(*(one() for _ in range(streams)))
    assert pacer.sending == 0  # every stream that counted itself has gone
    return list(results)


def test_paced_streams_carry_every_token_in_order_in_fewer_messages():
    total = 300
    for messages in asyncio.run(_paced_run(rate=400, streams=4, total=total)):  # 10 ms waits with 4 sending
        assert [t for batch in messages for t in batch] == list(range(total))
        assert len(messages) < total


def test_no_waits_when_off_or_after_the_last_output(monkeypatch):
    import sys

    from serve_app.streaming import StreamPacer

    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def counting_sleep(delay: float, *args: Any) -> Any:
        if sys._getframe(1).f_code.co_name == "pace":
            waits.append(delay)
        return await real_sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", counting_sleep)

    async def items(n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    async def drain(pacer: StreamPacer, more: Any = None) -> list[int]:
        return [i async for i in pacer.pace(items(5), more)]

    assert asyncio.run(drain(StreamPacer(0))) == [0, 1, 2, 3, 4] and waits == []
    # items 3 and 4 end the output (a finish, then usage): nothing is held after them
    assert asyncio.run(drain(StreamPacer(100), more=lambda i: i < 3)) == [0, 1, 2, 3, 4]
    assert len(waits) == 3 and all(0 < w <= 0.05 for w in waits)


def test_a_consumer_gone_during_a_wait_closes_the_source():
    from serve_app.streaming import StreamPacer

    closed: list[bool] = []

    async def endless() -> AsyncIterator[int]:
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.append(True)

    async def main() -> list[int]:
        got: list[int] = []

        async def consume() -> None:
            async for i in StreamPacer(1, max_delay_s=30).pace(endless()):
                got.append(i)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)  # now in its 30 s wait
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return got

    assert asyncio.run(main()) == [0]
    assert closed == [True]

"""``serve_app.timeouts.within``: a stage that does not answer is a 504 in the envelope, and is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.errors import ApiError, envelope
from serve_app.timeouts import within


class SlowCall:
    """A stand-in DeploymentResponse: awaitable, cancellable, never answering."""

    def __init__(self) -> None:
        self.cancelled = False

    def __await__(self):
        return asyncio.sleep(3600).__await__()

    def cancel(self) -> None:
        self.cancelled = True


async def first_of(call, sentinel_s: float = 30.0):
    """Await ``call`` against a sentinel that only wakes after ``sentinel_s``: the call must end first
    (the stand-in it waits on never answers, so ending at all is the deadline at work)."""
    task, sentinel = asyncio.ensure_future(call), asyncio.ensure_future(asyncio.sleep(sentinel_s))
    done, _ = await asyncio.wait({task, sentinel}, return_when=asyncio.FIRST_COMPLETED)
    sentinel.cancel()
    assert task in done, "the call outlived the sentinel: no deadline ended it"
    return task.result()


def test_a_call_past_its_deadline_is_a_504_and_is_cancelled():
    call = SlowCall()

    async def run() -> None:
        with pytest.raises(ApiError) as got:
            await first_of(within(call, 0.05, "Render"))
        status, body = envelope(got.value)
        assert status == 504 and body["error"]["type"] == "GatewayTimeoutError" and "Render" in body["error"]["message"]

    asyncio.run(run())
    assert call.cancelled


def test_an_answer_in_time_passes_through_and_none_means_no_deadline():
    async def answer() -> str:
        await asyncio.sleep(0.01)
        return "ok"

    async def run() -> tuple:
        return await within(answer(), 1, "x"), await within(answer(), None, "x")

    assert asyncio.run(run()) == ("ok", "ok")


def test_a_call_whose_stage_loses_its_last_replica_is_a_503_at_once_and_is_cancelled():
    """Serve's router would hold the call until a replacement runs; ``routable`` turning false ends it."""
    call = SlowCall()
    replicas = [1]

    async def run() -> None:
        asyncio.get_running_loop().call_later(0.1, replicas.clear)  # the replica dies while the call waits
        with pytest.raises(ApiError) as got:
            await first_of(within(call, None, "Engine", routable=lambda: bool(replicas)))
        status, body = envelope(got.value)
        assert status == 503 and body["error"]["type"] == "ServiceUnavailableError" and "Engine" in body["error"]["message"]

    asyncio.run(run())
    assert call.cancelled


def test_a_routable_call_runs_to_its_answer_and_a_cancelled_caller_cancels_it():
    async def answer() -> str:
        await asyncio.sleep(0.6)  # past a few routable polls
        return "ok"

    async def run() -> bool:
        assert await within(answer(), None, "x", routable=lambda: True) == "ok"
        slow = SlowCall()
        waiter = asyncio.ensure_future(within(slow, 60, "x", routable=lambda: True))
        await asyncio.sleep(0.05)
        waiter.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return slow.cancelled

    assert asyncio.run(run())


def test_a_deadline_only_call_keeps_its_own_errors_and_a_cancelled_caller_cancels_it():
    """The colocated stages' path (a deadline, no ``routable``): the call's own TimeoutError is not the
    deadline's 504, and a caller that goes away cancels the call."""

    async def own_timeout() -> str:
        raise TimeoutError("the stage's own")

    async def run() -> bool:
        with pytest.raises(TimeoutError, match="the stage's own"):
            await within(own_timeout(), 60, "x")
        slow = SlowCall()
        waiter = asyncio.ensure_future(within(slow, 60, "x"))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return slow.cancelled

    assert asyncio.run(run())

"""Deadlines on calls to other stages: a stage that does not answer becomes a 504, and a stage left
with no replica to route to a 503, never a hang.

A request queued at a stage with no live replica (crashed, restarting, not yet scheduled) would
otherwise wait for as long as the client does: Serve's router holds it until a replacement is
RUNNING, minutes for a replica importing vLLM. :func:`within` bounds the wait, watches whether the
stage can still be routed to, cancels the call downstream, and raises
:class:`~serve_app.errors.GatewayTimeoutError` (504) or
:class:`~serve_app.errors.ServiceUnavailableError` (503, with ``Retry-After`` at the edge).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from serve_app.errors import GatewayTimeoutError, ServiceUnavailableError

__all__ = ["ROUTABLE_POLL_S", "within"]

T = TypeVar("T")

ROUTABLE_POLL_S = 0.25  # how often a waiting call checks that its stage still has a replica


async def within(
    call: Awaitable[T], timeout_s: float | None, stage: str, routable: Callable[[], bool] | None = None
) -> T:
    """``await call``, for at most ``timeout_s`` seconds (``None``: no deadline), and only while
    ``routable()`` (when given) says the stage has a replica the call can reach."""
    if routable is None:
        return await (call if timeout_s is None else _by_deadline(call, timeout_s, stage))
    # Watched: the call runs in its own task, polled for the deadline and for a replica to reach.
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    task = asyncio.ensure_future(_awaited(call))
    try:
        while True:
            wait = ROUTABLE_POLL_S if deadline is None else min(ROUTABLE_POLL_S, deadline - loop.time())
            done, _ = await asyncio.wait((task,), timeout=max(wait, 0))
            if done:
                return task.result()
            if deadline is not None and loop.time() >= deadline:
                raise GatewayTimeoutError(f"{stage} did not answer within {timeout_s:g} s; retry later.")
            if not routable():
                raise ServiceUnavailableError(f"{stage} has no running replica; retry later.")
    finally:
        if not task.done():
            task.cancel()
            _cancel(call)


async def _by_deadline(call: Awaitable[T], timeout_s: float, stage: str) -> T:
    """``within`` with a deadline only (every colocated stage's call): awaited in the caller's task, without
    the second task and ``asyncio.wait`` of the watched path (half the overhead, one loop pass less)."""
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            return await call
    except TimeoutError:
        if not deadline.expired():  # the call's own TimeoutError, not this deadline
            raise
        _cancel(call)
        raise GatewayTimeoutError(f"{stage} did not answer within {timeout_s:g} s; retry later.") from None
    except asyncio.CancelledError:
        _cancel(call)
        raise


def _cancel(call: Awaitable[Any]) -> None:
    cancel = getattr(call, "cancel", None)
    if cancel is not None:  # a DeploymentResponse: cancel the request at the replica too
        cancel()


async def _awaited(call: Awaitable[Any]) -> Any:
    return await call

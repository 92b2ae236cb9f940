"""Deadlines on calls to other stages: a stage that does not answer becomes a 504, never a hang.

A request queued at a stage with no live replica (crashed, restarting, not yet scheduled) would
otherwise wait for as long as the client does. :func:`within` bounds the wait, cancels the call
downstream, and raises :class:`~serve_app.errors.GatewayTimeoutError` (504 in vLLM's envelope).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from serve_app.errors import GatewayTimeoutError

__all__ = ["within"]

T = TypeVar("T")


async def within(call: Awaitable[T], timeout_s: float | None, stage: str) -> T:
    """``await call``, for at most ``timeout_s`` seconds (``None``: no deadline)."""
    if timeout_s is None:
        return await call
    try:
        return await asyncio.wait_for(_awaited(call), timeout_s)
    except TimeoutError:
        cancel = getattr(call, "cancel", None)
        if cancel is not None:  # a DeploymentResponse: cancel the request at the replica too
            cancel()
        raise GatewayTimeoutError(f"{stage} did not answer within {timeout_s:g} s; retry later.") from None


async def _awaited(call: Awaitable[Any]) -> Any:
    return await call

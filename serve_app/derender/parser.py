"""``ParserDerender``: chat derender through vLLM's own tool and reasoning parsers.

A thin Serve shell over :class:`~serve_app.derender.parser_service.ParserDerenderService`. Replicas route
by session (``ConsistentHashRouter`` on the ``session_id`` the ingress sets per stream), so a
stream's chunks meet their live parser; any replica still answers any chunk, by replay.
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING, Any

from ray import serve

from serve_app.config import AppArgs, ResolvedModel
from serve_app.derender.parser_service import ParserDerenderService
from serve_app.heap import freeze_startup_heap

if TYPE_CHECKING:
    from serve_app._vllm import RenderState

__all__ = ["ParserDerender", "build_parser_service", "session_stats"]


async def build_parser_service(args: AppArgs, model: ResolvedModel, render_state: RenderState | None = None) -> ParserDerenderService:
    """The parser derender core (:meth:`ParserDerenderService.create`)."""
    return await ParserDerenderService.create(args, model, render_state)


@serve.deployment(name="ParserDerender")
class ParserDerender:
    """Serve shell: raw JSON (or a dict) in, vLLM's JSON bytes out."""

    @staticmethod
    def deployment_options(args: AppArgs) -> dict[str, Any]:
        return {
            "max_ongoing_requests": 32,
            "max_queued_requests": 64,
            "ray_actor_options": {"num_cpus": 0.5},
            # 2 chunk requests in flight: utilisation ~0.7 for a one-core replica (bench/results/capacity.md).
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2},
            "request_router_config": {
                "request_router_class": "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter",
                "request_router_kwargs": {"num_virtual_nodes": 100, "num_fallback_replicas": 2},
            },
        }

    async def __init__(self, args: AppArgs, model: ResolvedModel) -> None:  # type: ignore[misc]  # Serve awaits it
        self.service = await build_parser_service(args, model)
        self.replica = serve.get_replica_context().replica_id.unique_id
        freeze_startup_heap()

    # Async on purpose: a cache hit is well under a millisecond of work, less than a thread-pool hop,
    # and runs inline; the service's async twins move the heavy cases (a long non-streaming output,
    # a miss that replays a long history) to a worker thread so the replica's other streams go on.
    async def chat(self, body: bytes | dict) -> bytes:
        return await self.service.chat_async(body)

    async def chat_traced(self, body: bytes | dict) -> tuple[bytes, str, str]:
        """``chat`` plus what the ingress's metrics need: the session-cache outcome and this replica."""
        out, outcome = await self.service.chat_with_outcome_async(body)
        return out, outcome, self.replica

    async def stats(self) -> dict[str, Any]:
        """Session-cache counters and size, and this replica's peak RSS."""
        return session_stats(self.service, self.replica)


def session_stats(service: ParserDerenderService, replica: str) -> dict[str, Any]:
    """A parser service's session-cache counters and size, and its process's peak RSS, for /metrics."""
    cache = service.sessions
    s = cache.stats
    return {
        "replica": replica,
        "sessions": len(cache),
        "session_tokens": cache.tokens,
        "hits": s.hits,
        "misses": s.misses,
        "replayed_tokens": s.replayed_tokens,
        "evictions": s.evictions,
        "expirations": s.expirations,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }

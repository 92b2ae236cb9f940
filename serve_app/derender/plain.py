"""``PlainDerender``: detokenization-only derender (completions always; chat when no parser is configured).

Light replicas: ``tokenizers`` + pydantic, no vLLM, no torch (``tests/unit/test_imports.py``).
"""

from __future__ import annotations

import resource
import sys
from typing import Any

from ray import serve

from serve_app.config import AppArgs, ResolvedModel
from serve_app.derender.plain_service import PlainDerenderService
from serve_app.heap import freeze_startup_heap

__all__ = ["PlainDerender", "build_plain_service"]


def build_plain_service(args: AppArgs, model: ResolvedModel) -> PlainDerenderService:
    """The plain derender core (:meth:`PlainDerenderService.create`)."""
    return PlainDerenderService.create(args, model)


@serve.deployment(name="PlainDerender")
class PlainDerender:
    """Serve shell over :class:`PlainDerenderService`; raw JSON (or a dict) in, vLLM's JSON bytes out."""

    @staticmethod
    def deployment_options(args: AppArgs) -> dict[str, Any]:
        return {
            "max_ongoing_requests": 64,
            "max_queued_requests": 128,
            "ray_actor_options": {"num_cpus": 0.25},
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16},
        }

    def __init__(self, args: AppArgs, model: ResolvedModel) -> None:
        self.service = build_plain_service(args, model)
        freeze_startup_heap()

    # Async on purpose: a chunk is tens of microseconds of work, less than a thread-pool hop; the
    # service moves only big requests to its worker thread, so health checks keep being answered.
    async def chat(self, body: bytes | dict) -> bytes:
        return await self.service.chat_async(body)

    async def completion(self, body: bytes | dict) -> bytes:
        return await self.service.completion_async(body)

    async def stats(self) -> dict[str, Any]:
        """What this replica process holds: heavy modules imported (should be none) and peak RSS."""
        return {
            "heavy_modules": sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules),
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

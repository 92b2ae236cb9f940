"""``Engine``: vLLM's ``AsyncLLM`` as a token-in / token-out engine (``vllm serve --tokens-only``).

The work is vLLM's own: :func:`serve_app._vllm.build_engine_state` builds what ``vllm serve
--tokens-only`` builds, and :class:`EngineService` serves ``GenerateRequest`` bodies through vLLM's
``ServingTokens``, so responses, SSE frames, defaults (``max_tokens``) and errors are those of
``/inference/v1/generate``. What this module adds is the shell: raw JSON or dicts in, typed
:class:`~serve_app.errors.ApiError` out, three call shapes (JSON bytes, SSE frames, parsed chunk
dicts) and an abort.

Cancellation: a cancelled call (client disconnect, ``DeploymentResponseGenerator.cancel()``) raises
``CancelledError`` inside vLLM's result generator, and ``AsyncLLM.generate`` aborts the request.

On a GPU cluster one engine takes ``ray_actor_options: {num_gpus: 1}`` (``configs/``), or with
``tensor_parallel_size`` / ``pipeline_parallel_size`` a placement group of one GPU per worker
(:mod:`serve_app.placement`); here it runs on vLLM's CPU backend. Several replicas are data
parallel; the composed path moves a request whose replica died to another one (serve_app/compose.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from ray import serve

from serve_app._vllm import EngineState, RawRequest, call_vllm
from serve_app.config import AppArgs, ResolvedModel
from serve_app.errors import BadRequestError, EngineStreamError
from serve_app.heap import freeze_startup_heap
from serve_app.placement import placement_options
from serve_app.streaming import StreamPacer
from serve_app.wire import check_engine_ints, dump_json, load_body, validate_model

__all__ = ["Engine", "EngineService"]

_DONE = "data: [DONE]\n\n"


def parse_sse_frame(frame: str) -> dict[str, Any] | None:
    """One ``data: {...}\\n\\n`` frame -> its JSON object; ``None`` for ``[DONE]``.

    Raises:
        EngineStreamError: the frame is vLLM's mid-stream ``{"error": ...}``.
    """
    payload = frame[6:].strip() if frame.startswith("data: ") else frame.strip()
    if payload == "[DONE]":
        return None
    chunk = json.loads(payload)
    if "error" in chunk and "choices" not in chunk:
        err = chunk["error"]
        raise EngineStreamError(
            err.get("message", "engine error"),
            param=err.get("param"),
            status_code=int(err.get("code") or 500),
            err_type=err.get("type") or "InternalServerError",
        )
    return chunk


def engine_output_follows(frame: str) -> bool:
    """Whether more engine output follows this SSE frame: its choice is not finished (no wait after a
    finish, before the usage frame and ``[DONE]``, or after an error frame)."""
    return '"finish_reason":null' in frame


def check_token_ids(token_ids: list[int] | None, vocab_size: int) -> None:
    """vLLM's own out-of-vocabulary 400 (``BaseRenderer.validate_token_ids``), also without a tokenizer."""
    if token_ids and max(token_ids) >= vocab_size:
        raise BadRequestError(f"Token id {max(token_ids)} is out of vocabulary", param="token_ids")


class EngineService:
    """Ray-free core: ``GenerateRequest`` JSON in, vLLM's ``/inference/v1/generate`` output out."""

    def __init__(self, state: EngineState, stream_messages_per_s: float = 0.0) -> None:
        self.state = state
        self.pacer = StreamPacer(stream_messages_per_s)
        self.serving = state.serving_tokens
        self.engine = state.engine_client
        self._request = state.generate_request_model()
        self._error_cls = state.error_response_model()
        # The model's embedding rows. vLLM checks prompt ids against the vocabulary only when it has a
        # tokenizer; a tokens-only engine indexes an id past it and its EngineCore dies for good.
        self.vocab_size: int = state.vllm_config.model_config.get_vocab_size()

    @classmethod
    async def create(cls, args: AppArgs, model: ResolvedModel) -> EngineService:
        from serve_app._vllm import build_engine_state

        return cls(await build_engine_state(args, model), args.engine.stream_messages_per_s)

    async def _serve(self, body: bytes | dict, stream: bool | None, headers: Mapping[str, str] | None) -> Any:
        """Validate and start one request; returns vLLM's response model or its SSE generator."""

        async def start() -> Any:
            data = load_body(body)
            if stream is not None and isinstance(data, dict):
                data = {**data, "stream": stream}
            check_engine_ints(data)
            request = validate_model(self._request, data)
            check_token_ids(request.token_ids, self.vocab_size)
            return await self.serving.serve_tokens(request, RawRequest(headers))

        return await call_vllm(start(), self._error_cls)

    async def generate(self, body: bytes | dict, headers: Mapping[str, str] | None = None) -> bytes:
        """Non-streaming generate (``stream`` is forced off): the ``GenerateTokensResponse`` JSON bytes."""
        response = await self._serve(body, False, headers)
        return dump_json(response.model_dump())

    async def generate_sse(
        self, body: bytes | dict, headers: Mapping[str, str] | None = None
    ) -> AsyncGenerator[str, None]:
        """Streaming generate, vLLM's SSE frames as they are (``data: {...}\\n\\n`` ... ``data: [DONE]``).

        Errors before the first frame raise :class:`ApiError`; later ones arrive as vLLM's error frame.
        """
        frames = await self._serve(body, True, headers)
        async with aclosing(self.pacer.pace(frames, engine_output_follows)) as paced:
            async for frame in paced:
                yield frame

    async def generate_stream(
        self, body: bytes | dict, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Streaming generate as parsed chunk dicts (``GenerateTokensStreamResponse``); no ``[DONE]``.

        Raises:
            ApiError: before the first chunk (validation, model, admission).
            EngineStreamError: vLLM reported an error mid-stream.
        """
        async with aclosing(self.generate_sse(body, headers)) as frames:
            async for frame in frames:
                chunk = parse_sse_frame(frame)
                if chunk is not None:
                    yield chunk

    async def abort(self, request_ids: list[str]) -> None:
        """Abort running requests by engine request id (``generate-tokens-...``); unknown ids are ignored."""
        await self.engine.abort(request_ids)

    def num_unfinished_requests(self) -> int:
        return self.engine.output_processor.get_num_unfinished_requests()

    def metric_families(self) -> list[Any]:
        """vLLM's ``vllm:*`` families of this process (prometheus_client ``Metric``), as ``vllm serve`` exports them."""
        from serve_app._vllm import engine_metric_families

        return engine_metric_families()

    async def check_health(self) -> None:
        await self.engine.check_health()

    def shutdown(self) -> None:
        self.state.shutdown()


@serve.deployment(name="Engine")
class Engine:
    """Serve shell over :class:`EngineService`. By handle::

        engine = serve.get_deployment_handle("Engine", app_name="serve_app")
        response = json.loads(await engine.generate.remote({"token_ids": [...], "sampling_params": {...}}))
        async for chunk in engine.options(stream=True).generate_stream.remote(generate_request):
            ...  # GenerateTokensStreamResponse dicts, one choice each
    """

    @staticmethod
    def deployment_options(args: AppArgs) -> dict[str, Any]:
        return {
            # Above max_num_seqs so vLLM's scheduler, not Serve, queues: it batches what it holds.
            "max_ongoing_requests": max(64, 4 * args.engine.max_num_seqs),
            # Bounded per caller: past it the Ingress answers 503 + Retry-After instead of queueing forever.
            "max_queued_requests": max(64, 4 * args.engine.max_num_seqs),
            # One replica unless raised: `autoscaling_config: {max_replicas: N}` under deployments.engine
            # autoscales on requests in flight, a full running batch per replica; min = max for a fixed count.
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": args.engine.max_num_seqs},
            "ray_actor_options": {"num_cpus": 1},
            "health_check_period_s": 10,
            "health_check_timeout_s": 30,
            # Starting an engine (weights, KV cache, warm-up) takes far longer than a CPU stage.
            "graceful_shutdown_timeout_s": 30,
        }

    @staticmethod
    def with_placement(args: AppArgs, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` (defaults with the user's merged over them) plus the placement group the engine's
        tensor / pipeline parallel workers need (:mod:`serve_app.placement`); its bundle 0 holds the
        replica's own ``ray_actor_options``, so it is built from the merged options."""
        eng = args.engine
        return placement_options(options, eng.vllm_args(), eng.accelerator, eng.placement_group_strategy)

    async def __init__(self, args: AppArgs, model: ResolvedModel) -> None:  # type: ignore[misc]  # Serve awaits it
        self.service = await EngineService.create(args, model)
        freeze_startup_heap()

    async def generate(self, body: bytes | dict, headers: dict[str, str] | None = None) -> bytes:
        return await self.service.generate(body, headers)

    async def generate_sse(self, body: bytes | dict, headers: dict[str, str] | None = None) -> AsyncIterator[str]:
        async for frame in self.service.generate_sse(body, headers):
            yield frame

    async def generate_stream(
        self, body: bytes | dict, headers: dict[str, str] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.service.generate_stream(body, headers):
            yield chunk

    async def abort(self, request_ids: list[str]) -> None:
        await self.service.abort(request_ids)

    async def stats(self) -> dict[str, Any]:
        """Requests this replica's engine still holds (0 once every stream ended or was aborted)."""
        return {"num_unfinished_requests": self.service.num_unfinished_requests()}

    async def metric_families(self) -> tuple[str, list[Any]]:
        """By handle, for the Ingress answering ``/metrics``: this replica's id and its vLLM series."""
        return serve.get_replica_context().replica_id.unique_id, self.service.metric_families()

    async def check_health(self) -> None:
        await self.service.check_health()

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.shutdown()

"""``ParserDerender``: chat derender through vLLM's own tool and reasoning parsers.

Today this serves vLLM 0.32's ``ServingDerender`` as is, built from the same flags as ``vllm launch
render`` (:mod:`serve_app._vllm`), so the split into content / reasoning / tool_calls is vLLM's.
Known vLLM 0.32 gaps (``vllm-0.32-behaviour.md`` 1.13) and its per-chunk replay are inherited
until the parser-session work lands (issue 5).
"""

from __future__ import annotations

from typing import Any

from ray import serve

from serve_app.config import AppArgs, ResolvedModel
from serve_app._vllm import call_vllm
from serve_app.wire import dump_json, load_body, validate_model

__all__ = ["ParserDerender", "VllmDerenderService"]


class VllmDerenderService:
    """Ray-free shell over vLLM's ``ServingDerender``: raw JSON in, vLLM's JSON bytes out."""

    def __init__(self, state: Any) -> None:
        from pydantic import TypeAdapter
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderChatRequestUnion,
            DerenderChatStreamResponse,
            DerenderCompletionRequestUnion,
            DerenderCompletionStreamResponse,
        )
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        self.serving = state.serving_derender
        self._error_cls = ErrorResponse
        self._chat = TypeAdapter(DerenderChatRequestUnion)
        self._completion = TypeAdapter(DerenderCompletionRequestUnion)
        self._chat_stream_response = DerenderChatStreamResponse
        self._completion_stream_response = DerenderCompletionStreamResponse

    @classmethod
    async def create(cls, args: AppArgs, model: ResolvedModel) -> VllmDerenderService:
        from serve_app._vllm import build_render_state

        return cls(await build_render_state(args, model))

    async def _serve(self, validator: Any, body: bytes | dict, stream: Any, whole: Any, stream_response: Any) -> bytes:
        async def serve_one() -> bytes:
            data = load_body(body)
            request = validate_model(validator, data)
            if request.stream:
                result = await stream(request)
                if isinstance(result, self._error_cls):
                    return result
                chunk, state = result
                return dump_json(stream_response(chunk=chunk, stream_state=state).model_dump())
            result = await whole(request)
            return result if isinstance(result, self._error_cls) else dump_json(result.model_dump())

        return await call_vllm(serve_one(), self._error_cls)

    async def chat(self, body: bytes | dict) -> bytes:
        s = self.serving
        return await self._serve(
            self._chat, body, s.derender_chat_stream_response, s.derender_chat_response, self._chat_stream_response
        )

    async def completion(self, body: bytes | dict) -> bytes:
        s = self.serving
        return await self._serve(
            self._completion,
            body,
            s.derender_completion_stream_response,
            s.derender_completion_response,
            self._completion_stream_response,
        )


@serve.deployment(name="ParserDerender")
class ParserDerender:
    """Serve shell over :class:`VllmDerenderService` for parser-configured chat derender."""

    @staticmethod
    def deployment_options(args: AppArgs) -> dict[str, Any]:
        return {
            "max_ongoing_requests": 32,
            "ray_actor_options": {"num_cpus": 0.5},
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8},
        }

    async def __init__(self, args: AppArgs, model: ResolvedModel) -> None:
        self.service = await VllmDerenderService.create(args, model)

    async def chat(self, body: bytes | dict) -> bytes:
        return await self.service.chat(body)

    async def completion(self, body: bytes | dict) -> bytes:
        return await self.service.completion(body)

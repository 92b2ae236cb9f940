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
from serve_app.errors import ApiError
from serve_app.wire import dump_json, parse_json, validate_model

__all__ = ["ParserDerender", "VllmDerenderService"]


def _raise_error_response(err: Any) -> None:
    info = err.error
    raise ApiError(info.message, param=info.param, status_code=int(info.code), err_type=info.type)


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

    async def _run(self, coro: Any) -> Any:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        try:
            result = await coro
        except ApiError:
            raise
        except Exception as exc:  # mapped exactly as vLLM's exception handlers map it
            _raise_error_response(create_error_response(exc))
        if isinstance(result, self._error_cls):
            _raise_error_response(result)
        return result

    async def chat(self, body: bytes | dict) -> bytes:
        data = parse_json(body) if isinstance(body, (bytes, bytearray, str)) else body
        request = validate_model(self._chat, data)
        if request.stream:
            chunk, state = await self._run(self.serving.derender_chat_stream_response(request))
            return dump_json(self._chat_stream_response(chunk=chunk, stream_state=state).model_dump())
        return dump_json((await self._run(self.serving.derender_chat_response(request))).model_dump())

    async def completion(self, body: bytes | dict) -> bytes:
        data = parse_json(body) if isinstance(body, (bytes, bytearray, str)) else body
        request = validate_model(self._completion, data)
        if request.stream:
            chunk, state = await self._run(self.serving.derender_completion_stream_response(request))
            return dump_json(self._completion_stream_response(chunk=chunk, stream_state=state).model_dump())
        return dump_json((await self._run(self.serving.derender_completion_response(request))).model_dump())


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

"""A small typed client for the graph's stages by handle: render, generate, derender, and the three composed.

For another Ray deployment (or a driver) in the same cluster; nothing goes over HTTP. Every method
is async and takes / returns vLLM 0.32's wire shapes::

    client = ServeAppClient("serve_app")
    gen = await client.render_chat({"messages": [{"role": "user", "content": "Hi"}]})  # GenerateRequest dict
    out = await client.generate(gen)                                                    # GenerateTokensResponse
    chat = await client.derender_chat(out, chat_request=..., prompt_token_ids=gen["token_ids"])
    # or streamed, one generate chunk at a time (the carried stream_state is kept for you):
    stream = client.derender_chat_stream(chat_request=..., prompt_token_ids=gen["token_ids"])
    async for gen_chunk in client.generate_stream({**gen, "stream": True}):
        out = await stream.derender(gen_chunk)                                       # {"chunk", "stream_state"}
    # or all three:
    chat = await client.chat({"messages": [...]})
    async for chunk in client.chat_stream({"messages": [...]}):   # chat.completion.chunk dicts
        ...

``chat`` and ``chat_stream`` run the Ingress's composition, the code behind ``/v1/chat/completions``,
so they answer exactly what that route answers. Errors raised in a deployment arrive as
:class:`~serve_app.errors.ApiError` (unwrapped from Ray's wrapper).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import cached_property
from typing import Any, Literal

from serve_app.errors import ApiError
from serve_app.protocol import GenerateTokensResponse, GenerateTokensStreamResponse
from serve_app.wire import load_answer

__all__ = ["ChatDerenderStream", "ServeAppClient"]

GenerateRequestDict = dict[str, Any]
"""vLLM's ``GenerateRequest`` as JSON: ``token_ids``, ``sampling_params``, ``request_id``, ``stream``, ..."""


def _unwrap(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, ApiError) else exc


class ServeAppClient:
    """Handles to one ``serve_app`` application's deployments, looked up once.

    Args:
        app_name: the Serve application (``serve_app`` in ``serve_config.yaml``).
    """

    def __init__(self, app_name: str = "serve_app") -> None:
        self.app_name = app_name
        self._parser: Any = None
        self._has_parser: bool | None = None

    # Each handle is looked up at first use: an application without an Engine (render and derender
    # only) has no such deployment, and Serve refuses a handle to one that does not exist.
    def _get(self, name: str) -> Any:
        from ray import serve

        return serve.get_deployment_handle(name, app_name=self.app_name)

    @cached_property
    def render(self) -> Any:
        return self._get("Render")

    @cached_property
    def engine(self) -> Any:
        return self._get("Engine")

    @cached_property
    def plain_derender(self) -> Any:
        return self._get("PlainDerender")

    @cached_property
    def ingress(self) -> Any:
        return self._get("Ingress")

    @cached_property
    def _composed_stream(self) -> Any:
        return self.ingress.options(stream=True, method_name="composed_chat_stream")

    @cached_property
    def _engine_stream(self) -> Any:
        return self.engine.options(stream=True, method_name="generate_stream")

    def _chat_derender(self) -> tuple[Any, bool]:
        if self._has_parser is None:
            from ray import serve

            deployments = serve.status().applications[self.app_name].deployments
            self._has_parser = "ParserDerender" in deployments
            if self._has_parser:
                self._parser = self._get("ParserDerender")
        return (self._parser if self._has_parser else self.plain_derender), bool(self._has_parser)

    async def _call(self, response: Any) -> Any:
        try:
            return await response
        except Exception as exc:
            raise _unwrap(exc) from None

    # --- stages ---------------------------------------------------------------------------------

    async def render_chat(self, chat_request: dict[str, Any], request_id: str | None = None) -> GenerateRequestDict:
        """``/v1/chat/completions/render``: the request's prompt token ids and sampling params."""
        return load_answer(await self._call(self.render.chat.remote(chat_request, request_id)))

    async def render_completion(
        self, completion_request: dict[str, Any], request_id: str | None = None
    ) -> list[GenerateRequestDict]:
        """``/v1/completions/render``: one ``GenerateRequest`` per prompt."""
        return load_answer(await self._call(self.render.completion.remote(completion_request, request_id)))

    async def generate(self, generate_request: GenerateRequestDict) -> GenerateTokensResponse:
        """``/inference/v1/generate`` without streaming (``stream`` is ignored)."""
        raw = await self._call(self.engine.generate.remote(generate_request))
        return GenerateTokensResponse.model_validate_json(raw)

    async def generate_stream(self, generate_request: GenerateRequestDict) -> AsyncIterator[GenerateTokensStreamResponse]:
        """``/inference/v1/generate`` streaming: one chunk per engine step and choice, then the usage
        chunk when ``stream_options.include_usage``. Closing the iterator aborts the engine request."""
        gen = self._engine_stream.remote(generate_request)
        try:
            async for chunk in gen:
                yield GenerateTokensStreamResponse.model_validate(chunk)
        except Exception as exc:
            raise _unwrap(exc) from None
        finally:
            gen.cancel()

    async def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests (ids as the engine names them: ``generate-tokens-<id>``) on every replica."""
        await self.engine.broadcast("abort", request_ids).results_async()

    async def derender_chat(
        self,
        generate_response: GenerateTokensResponse | dict[str, Any],
        *,
        chat_request: dict[str, Any] | None,
        prompt_token_ids: list[int] | None,
    ) -> dict[str, Any]:
        """``/v1/chat/completions/derender`` (non-streaming): a ``chat.completion`` dict."""
        target, _ = self._chat_derender()
        body = {
            "generate_response": _as_dict(generate_response),
            "chat_request": chat_request,
            "prompt_token_ids": prompt_token_ids,
            "prompt_tokens": len(prompt_token_ids) if prompt_token_ids is not None else None,
        }
        return load_answer(await self._call(target.chat.remote(body)))

    def derender_chat_stream(
        self,
        *,
        chat_request: dict[str, Any] | None,
        prompt_token_ids: list[int] | None,
        model: str | None = None,
        session_id: str | None = None,
    ) -> ChatDerenderStream:
        """``/v1/chat/completions/derender`` streamed: a :class:`ChatDerenderStream` that takes one
        generate chunk at a time and returns ``{"chunk", "stream_state"}`` as the route does.

        Every chunk goes to the ParserDerender replica holding the stream's live parser (Serve's
        consistent-hash router keyed on ``session_id``: the first chunk's ``request_id`` unless given),
        so only a replica change replays the carried state."""
        target, has_parser = self._chat_derender()
        return ChatDerenderStream(self, target, has_parser, chat_request, prompt_token_ids, model, session_id)

    async def derender_completion(
        self,
        generate_responses: list[GenerateTokensResponse | dict[str, Any]],
        *,
        completion_request: dict[str, Any] | None,
        prompt_token_ids: list[list[int]] | None,
    ) -> dict[str, Any]:
        """``/v1/completions/derender`` (non-streaming): a ``text_completion`` dict."""
        body = {
            "generate_responses": [_as_dict(r) for r in generate_responses],
            "completion_request": completion_request,
            "prompt_token_ids": prompt_token_ids,
            "prompt_tokens": [len(p) for p in prompt_token_ids] if prompt_token_ids is not None else None,
        }
        return load_answer(await self._call(self.plain_derender.completion.remote(body)))

    # --- the three composed ---------------------------------------------------------------------
    # Served by the Ingress's own composition (serve_app/compose.py), the code behind
    # /v1/chat/completions: the same stop-reason mapping, engine request and derender, no copy here.

    async def chat(self, chat_request: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        """Render, generate and derender one chat request: what ``/v1/chat/completions`` returns."""
        return load_answer(await self._call(self.ingress.composed_chat.remote(chat_request, request_id)))

    async def chat_stream(self, chat_request: dict[str, Any], request_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """What ``/v1/chat/completions`` streams, as ``chat.completion.chunk`` dicts (``stream_options``
        of ``chat_request`` apply; a stream that fails once started ends with vLLM's error dict).
        Closing the iterator aborts the engine request."""
        gen = self._composed_stream.remote(chat_request, request_id)
        try:
            async for chunk in gen:
                yield chunk
        except Exception as exc:
            raise _unwrap(exc) from None
        finally:
            gen.cancel()


class ChatDerenderStream:
    """One streaming chat derender by handle (:meth:`ServeAppClient.derender_chat_stream`).

    It carries ``stream_state`` from each answer to the next call, one per choice index (``n > 1``
    streams interleave their chunks), as a client of the HTTP route does by hand."""

    def __init__(
        self,
        client: ServeAppClient,
        target: Any,
        has_parser: bool,
        chat_request: dict[str, Any] | None,
        prompt_token_ids: list[int] | None,
        model: str | None,
        session_id: str | None,
    ) -> None:
        self._client = client
        self._target = target
        self._has_parser = has_parser
        self._session_id = session_id
        self._handle: Any = None
        self._base = {
            "stream": True,
            "model": model,
            "prompt_tokens": len(prompt_token_ids) if prompt_token_ids is not None else None,
            "prompt_token_ids": prompt_token_ids,
            "chat_request": chat_request,
        }
        self.stream_states: dict[int, dict[str, Any]] = {}
        """The last ``stream_state`` per choice index."""
        self.transport: Literal["grpc", "actor"] = "grpc"
        """Serve's gRPC, or Ray actor calls after a message past gRPC's cap (see :meth:`_chat`)."""

    async def derender(self, generate_chunk: GenerateTokensStreamResponse | dict[str, Any]) -> dict[str, Any]:
        """One generate chunk in, ``{"chunk": chat.completion.chunk, "stream_state": ...}`` out."""
        gen = _as_dict(generate_chunk)
        choices = gen.get("choices") or []
        index = choices[0].get("index", 0) if choices else 0
        if self._handle is None:
            # The routing session: Serve's proxy sets it only for HTTP, so a handle caller sets it here.
            sid = self._session_id or gen.get("request_id")
            handle = self._target.options(session_id=sid) if self._has_parser and sid else self._target
            # A call per chunk, so over Serve's gRPC transport whatever this process's default (Ray
            # actor calls unless RAY_SERVE_THROUGHPUT_OPTIMIZED=1, about 1.5x slower per stream: the
            # README's parser-streams bullet).
            self._handle = handle.options(_by_reference=False)
        body = {**self._base, "generate_chunk": gen, "stream_state": self.stream_states.get(index)}
        out = load_answer(await self._client._call(self._chat(body)))
        self.stream_states[index] = out["stream_state"]
        return out

    async def _chat(self, body: dict[str, Any]) -> bytes:
        import grpc

        try:
            return await self._handle.chat.remote(body)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # never from actor calls
                raise
        self.transport = "actor"
        # Over gRPC's message cap (4 MiB unless RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH lifts it, in
        # this process for answers, in the replica's for requests): a long stream's carried state. Ray
        # actor calls from here on. The replica may have parsed the chunk and moved its session on;
        # the retry then misses and replays the carried state, to the same answer.
        self._handle = self._handle.options(_by_reference=True)
        return await self._handle.chat.remote(body)


def _as_dict(value: Any) -> dict[str, Any]:
    return value.model_dump() if hasattr(value, "model_dump") else value

"""The composed OpenAI endpoints, ``/v1/chat/completions`` and ``/v1/completions``: the one place
render -> engine -> derender is wired.

One request is rendered (``Render``, in-process when colocated), generated (``Engine``, a streaming
handle: one Serve hop per engine chunk) and derendered here, in the caller's process: each choice
gets one in-memory derender stream that holds its detokenizer window (and, with parsers, its live
vLLM parser) for the whole stream, so nothing is replayed and no ``stream_state`` makes a round trip.
The Ingress serves it over HTTP and, for :class:`serve_app.client.ServeAppClient`, by handle.

:class:`ComposedService` is Ray-free: the stages are plain async callables (:class:`Stages`);
:func:`build_composed` wires deployment handles (or colocated services) into them;
:mod:`serve_app.stages` decides which is which.

Cost per engine chunk on this path: one ``generate_stream`` chunk (a small dict) through Ray, one
derender ``feed`` (tens of microseconds without parsers), one JSON dump for the SSE frame.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from serve_app.derender.stop import engine_stop_reason
from serve_app.errors import ServiceUnavailableError, envelope
from serve_app.health import replica_gone, routable
from serve_app.logs import get_logger
from serve_app.streaming import cancel_on_close, peek
from serve_app.timeouts import within
from serve_app.wire import load_answer, stream_flag

if TYPE_CHECKING:
    from serve_app.config import AppArgs, ResolvedModel

__all__ = [
    "ChatDerender",
    "ComposedService",
    "CompletionDerender",
    "DerenderStream",
    "Stages",
    "build_composed",
]

logger = get_logger(__name__)

T = TypeVar("T")
Observe = Callable[[str, str, float], None]
"""``observe(endpoint, stage, seconds)``: where a composed request's time before its response goes
(:meth:`serve_app.metrics.HttpMetrics.composed_stage`); ``endpoint`` is ``chat`` or ``completion``."""
RETRY_LOG = "sent again to another Engine replica"  # logged on each retry (tests/integration/test_engine_failover.py reads it)

ENGINE_ATTEMPTS = 3
"""Tries per engine call (and per stream, up to its first chunk). A call whose Engine replica died
under it goes at once to another replica instead of failing, or waiting for the replacement; with
none left it is the 503 of :func:`serve_app.timeouts.within`."""


class DerenderStream(Protocol):
    """One choice's in-memory derender stream."""

    def feed(self, generate_chunk: dict[str, Any]) -> dict[str, Any]:
        """A ``GenerateTokensStreamResponse`` dict in, the response chunk dict out."""
        ...


class ChatDerender(Protocol):
    """A chat derender service (plain, or with vLLM's parsers), in-process."""

    def chat(self, body: bytes | dict[str, Any]) -> bytes: ...

    async def chat_async(self, body: bytes | dict[str, Any]) -> bytes:
        """``chat`` for a caller on an event loop: heavy work (a big response to decode, a long
        output to parse) runs off it."""
        ...

    def open_chat_stream(
        self, chat_request: dict[str, Any], prompt_token_ids: list[int], prompt_tokens: int | None = None, model: str | None = None
    ) -> DerenderStream: ...


class CompletionDerender(Protocol):
    """The completions derender service (always plain), in-process."""

    def completion(self, body: bytes | dict[str, Any]) -> bytes: ...

    async def completion_async(self, body: bytes | dict[str, Any]) -> bytes:
        """``completion`` for a caller on an event loop: a big request decodes off it."""
        ...

    def open_completion_stream(
        self, completion_request: dict[str, Any], prompt_token_ids: list[int], prompt_tokens: int | None = None, model: str | None = None
    ) -> DerenderStream: ...


@dataclass(slots=True)
class Stages:
    """Render and the engine as async callables (deployment handles, or in-process services).

    ``render_chat(body, request_id) -> bytes``: the ``GenerateRequest`` JSON, from the request's raw
    JSON bytes where the caller has them, else its dict; ``render_completion``: a JSON list of them.
    ``generate(request) -> bytes``: the ``GenerateTokensResponse`` JSON. ``generate_stream(request)``:
    an async iterator of ``GenerateTokensStreamResponse`` dicts whose ``aclose()`` cancels the engine
    request.
    """

    render_chat: Callable[[bytes | dict[str, Any], str | None], Awaitable[bytes]]
    render_completion: Callable[[bytes | dict[str, Any], str | None], Awaitable[bytes]]
    generate: Callable[[dict[str, Any]], Awaitable[bytes]]
    generate_stream: Callable[[dict[str, Any]], AsyncGenerator[dict[str, Any], None]]
    # Whether render / the engine still has a replica a waiting call can reach (None: always).
    render_routable: Callable[[], bool] | None = None
    engine_routable: Callable[[], bool] | None = None
    # Whether the engine has no replica to reach now, as the controller or this router sees it.
    engine_down: Callable[[], bool] | None = None


def build_composed(
    args: AppArgs,
    model: ResolvedModel,
    render: Any,
    engine: Any,
    chat: ChatDerender,
    completion: CompletionDerender,
    engine_down: Callable[[], bool] | None = None,
    observe: Observe | None = None,
) -> ComposedService:
    """The composition for one Ingress replica: render and the engine by handle (or a colocated
    render's :class:`serve_app.stages.InProcess`), derender by the in-process services ``chat`` and
    ``completion`` (one Serve hop per token). Which of them runs where is :mod:`serve_app.stages`'s."""
    generate_stream = engine.options(stream=True, method_name="generate_stream")
    stages = Stages(
        render_chat=lambda body, rid: render.chat.remote(body, rid),
        render_completion=lambda body, rid: render.completion.remote(body, rid),
        generate=lambda body: engine.generate.remote(body),
        generate_stream=lambda body: cancel_on_close(generate_stream.remote(body)),
        render_routable=routable(render),
        engine_routable=routable(engine),
        engine_down=engine_down,
    )
    limits = args.limits
    return ComposedService(
        stages, chat, completion, model.eos_token_id, limits.stage_timeout_s, limits.engine_first_chunk_timeout_s, observe
    )


class ComposedService:
    """Render -> Engine -> derender for one model.

    Args:
        stages: how to reach render and the engine.
        chat_derender: the chat derender service (plain, or with parsers when configured).
        completion_derender: the completions derender service.
        eos_token_id: the tokenizer's EOS id, to report ``stop_reason`` as coupled ``vllm serve``
            does (:func:`serve_app.derender.stop.engine_stop_reason`).
        render_timeout_s: most seconds render may take (504 after; ``None``: no deadline).
        first_chunk_timeout_s: most seconds a streamed generation may take to its first chunk.
        observe: told each request's time in ``render``, then ``engine_first_chunk`` (a stream: from
            sending it to the engine to the first chunk back, vLLM's own time to first token included)
            or ``engine`` (a whole generation).
    """

    def __init__(
        self,
        stages: Stages,
        chat_derender: ChatDerender,
        completion_derender: CompletionDerender,
        eos_token_id: int | None,
        render_timeout_s: float | None = None,
        first_chunk_timeout_s: float | None = None,
        observe: Observe | None = None,
    ) -> None:
        self.stages = stages
        self.chat_derender = chat_derender
        self.completion_derender = completion_derender
        self.eos_token_id = eos_token_id
        self.render_timeout_s = render_timeout_s
        self.first_chunk_timeout_s = first_chunk_timeout_s
        self.observe = observe

    def _took(self, endpoint: str, stage: str, since: float) -> None:
        if self.observe is not None:
            self.observe(endpoint, stage, time.perf_counter() - since)

    def _fix_stop_reason(self, choices: list[dict[str, Any]], gen_request: dict[str, Any]) -> None:
        stop_ids = (gen_request.get("sampling_params") or {}).get("stop_token_ids")
        for choice in choices:
            engine_stop_reason(choice, self.eos_token_id, stop_ids)

    # --- the engine: a replica that died is replaced by another at once --------------------------

    def _engine_reachable(self) -> None:
        """Checked once the request has rendered, so a malformed one is its 400 whatever the engine's
        state: a 503 now when no engine replica can be reached, not a call queued until one starts."""
        if self.stages.engine_down is not None and self.stages.engine_down():
            raise ServiceUnavailableError("Engine has no running replica; retry later.")

    async def _generate(self, gen: dict[str, Any]) -> bytes:
        """One non-streaming generation (``GenerateTokensResponse`` JSON)."""
        for attempt in range(1, ENGINE_ATTEMPTS + 1):
            try:
                return await within(self.stages.generate(gen), None, "Engine", self.stages.engine_routable)
            except Exception as exc:
                _retry_or_raise(exc, attempt, gen["request_id"])
        raise AssertionError("unreachable")

    async def _first_chunk(self, open_stream: Callable[[], AsyncGenerator[T, None]], request_id: str) -> AsyncGenerator[T, None]:
        """A stream from ``open_stream()``, its first chunk awaited (an error before it is still a
        status code); opened again, on another replica, when its replica died before that chunk."""
        for attempt in range(1, ENGINE_ATTEMPTS + 1):
            try:
                _, chunks = await within(peek(open_stream()), self.first_chunk_timeout_s, "Engine", self.stages.engine_routable)
                return chunks
            except Exception as exc:
                _retry_or_raise(exc, attempt, request_id)
        raise AssertionError("unreachable")

    # --- chat -----------------------------------------------------------------------------------

    async def chat(
        self, body: dict[str, Any], request_id: str | None = None, raw: bytes | None = None
    ) -> bytes | AsyncGenerator[dict[str, Any], None]:
        """``/v1/chat/completions``: the response JSON bytes, or (``stream``) an iterator of the chunk
        dicts (:func:`serve_app.streaming.sse_stream` frames them), ending with vLLM's in-band error
        dict if the stream fails once started.

        ``raw``: the JSON bytes ``body`` was parsed from (HTTP), rendered as they came: render reads the
        body's size from them instead of writing the dict out again to judge where its template runs
        (:func:`serve_app.render._template_is_light`), and a Render replica gets one bytes copy.

        Raises:
            ApiError: render or engine rejected the request (before any chunk).
        """
        stream = stream_flag(body)
        start = time.perf_counter()
        rendering = self.stages.render_chat(body if raw is None else raw, request_id)
        rendered = await within(rendering, self.render_timeout_s, "Render", self.stages.render_routable)
        self._took("chat", "render", start)
        self._engine_reachable()
        gen = _no_detokenize(load_answer(rendered))
        prompt_ids = gen["token_ids"]
        start = time.perf_counter()
        if not stream:
            generated = await self._generate(gen)
            self._took("chat", "engine", start)
            response = load_answer(generated)
            response["request_id"] = gen["request_id"]
            self._fix_stop_reason(response["choices"], gen)
            whole = {
                "generate_response": response,
                "chat_request": body,
                "prompt_token_ids": prompt_ids,
                "prompt_tokens": len(prompt_ids),
            }
            # A big response decodes (and, with parsers, parses) off this event loop.
            return await self.chat_derender.chat_async(whole)
        chunks = await self._first_chunk(lambda: self.stages.generate_stream(gen), gen["request_id"])
        self._took("chat", "engine_first_chunk", start)
        return self._chat_chunks(body, gen, chunks)

    async def _chat_chunks(
        self, body: dict[str, Any], gen: dict[str, Any], chunks: AsyncGenerator[dict[str, Any], None]
    ) -> AsyncGenerator[dict[str, Any], None]:
        prompt_ids, request_id = gen["token_ids"], gen["request_id"]
        streams: dict[int, DerenderStream] = {}
        try:
            async for chunk in chunks:
                chunk["request_id"] = request_id
                choices = chunk.get("choices") or []
                self._fix_stop_reason(choices, gen)
                index = choices[0]["index"] if choices else 0
                if index not in streams:
                    streams[index] = self.chat_derender.open_chat_stream(body, prompt_ids, len(prompt_ids))
                yield streams[index].feed(chunk)
        except Exception as exc:  # the stream is committed: vLLM's in-band error frame
            yield _in_band_error(exc, request_id)
        finally:
            await chunks.aclose()

    # --- completions ----------------------------------------------------------------------------

    async def completion(
        self, body: dict[str, Any], request_id: str | None = None, raw: bytes | None = None
    ) -> bytes | AsyncGenerator[dict[str, Any], None]:
        """``/v1/completions``: every prompt rendered, generated concurrently, derendered together
        (``raw`` as for :meth:`chat`)."""
        stream = stream_flag(body)
        start = time.perf_counter()
        rendering = self.stages.render_completion(body if raw is None else raw, request_id)
        rendered = await within(rendering, self.render_timeout_s, "Render", self.stages.render_routable)
        self._took("completion", "render", start)
        self._engine_reachable()
        gens = [_no_detokenize(g) for g in load_answer(rendered)]
        start = time.perf_counter()
        if not stream:
            responses = await _gather_or_cancel([self._generate(g) for g in gens])
            self._took("completion", "engine", start)
            parsed = []
            for gen, raw in zip(gens, responses, strict=True):
                response = load_answer(raw)
                response["request_id"] = _base_id(gens, gen)
                self._fix_stop_reason(response["choices"], gen)
                parsed.append(response)
            return await self.completion_derender.completion_async(
                {
                    "generate_responses": parsed,
                    "completion_request": body,
                    "prompt_token_ids": [g["token_ids"] for g in gens],
                    "prompt_tokens": [len(g["token_ids"]) for g in gens],
                }
            )
        usage_wanted = bool((gens[0].get("stream_options") or {}).get("include_usage"))  # as vLLM parsed it
        if len(gens) > 1:  # one usage chunk for all prompts, summed here (each engine would send its own)
            gens = [{**g, "stream_options": None} for g in gens]
        merged = await self._first_chunk(lambda: merge([self.stages.generate_stream(g) for g in gens]), _base_id(gens, gens[0]))
        self._took("completion", "engine_first_chunk", start)
        return self._completion_chunks(body, gens, merged, usage_wanted and len(gens) > 1)

    async def _completion_chunks(
        self,
        body: dict[str, Any],
        gens: list[dict[str, Any]],
        merged: AsyncGenerator[tuple[int, dict[str, Any]], None],
        synthesize_usage: bool,
    ) -> AsyncGenerator[dict[str, Any], None]:
        n = int((gens[0].get("sampling_params") or {}).get("n") or 1)
        request_id = _base_id(gens, gens[0])
        streams: dict[int, DerenderStream] = {}
        completion_tokens = 0

        def stream(index: int, prompt: int) -> DerenderStream:
            if index not in streams:
                # No prompt_tokens: a multi-prompt usage chunk carries the sum over prompts, which must win.
                streams[index] = self.completion_derender.open_completion_stream(body, gens[prompt]["token_ids"])
            return streams[index]

        try:
            async for prompt, chunk in merged:
                chunk["request_id"] = request_id
                choices = chunk.get("choices") or []
                self._fix_stop_reason(choices, gens[prompt])
                index = 0
                for choice in choices:
                    choice["index"] = index = prompt * n + choice["index"]
                    completion_tokens += len(choice.get("token_ids") or ())
                yield stream(index, prompt).feed(chunk)
            if synthesize_usage:
                prompt_tokens = sum(len(g["token_ids"]) for g in gens)
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                }
                yield stream(0, 0).feed({"request_id": request_id, "choices": [], "usage": usage})
        except Exception as exc:
            yield _in_band_error(exc, request_id)
        finally:
            await merged.aclose()


def _retry_or_raise(exc: Exception, attempt: int, request_id: str) -> None:
    if attempt >= ENGINE_ATTEMPTS or not replica_gone(exc):
        raise exc
    logger.warning("%s: %s, its engine replica went away; %s", request_id, type(exc).__name__, RETRY_LOG)


def _in_band_error(exc: Exception, request_id: str) -> dict[str, Any]:
    status, body = envelope(exc)
    logger.warning("stream %s failed after it started; in-band error %d: %s", request_id, status, body["error"]["message"])
    return body


def _no_detokenize(gen: dict[str, Any]) -> dict[str, Any]:
    """Text is made here, not in the engine: its detokenizer is only needed to match stop strings."""
    params = gen.get("sampling_params")
    if isinstance(params, dict) and not params.get("stop"):
        params["detokenize"] = False
    return gen


def _base_id(gens: list[dict[str, Any]], gen: dict[str, Any]) -> str:
    """The response id: render numbers multi-prompt requests ``<id>-<i>``; the response has ``<id>``."""
    rid: str = gen["request_id"]
    if len(gens) > 1:
        base, _, suffix = rid.rpartition("-")
        if suffix.isdigit() and base:
            return base
    return rid


async def _gather_or_cancel(calls: list[Awaitable[bytes]]) -> list[bytes]:
    """Every call's result; when one fails, the others are cancelled (not left generating) and it raises."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for call, task in zip(calls, tasks, strict=True):
            task.cancel()
            if hasattr(call, "cancel"):  # a DeploymentResponse: cancel the replica's request too
                call.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merge(streams: list[AsyncGenerator[dict[str, Any], None]]) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """Interleave several engine streams as chunks arrive, each tagged with its stream's position.

    When one fails, or the consumer stops, every pump is cancelled and awaited before the streams are
    closed (so no stream is closed while a pump still reads it), and the failure is raised.
    """
    if len(streams) == 1:  # the common case: no tasks, no queue
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncGenerator[dict[str, Any], None]) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
        except Exception as exc:  # re-raised by the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()

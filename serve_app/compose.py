"""The composed OpenAI endpoints: ``/v1/chat/completions`` and ``/v1/completions`` inside the cluster.

One request is rendered (``Render``, in-process when colocated), generated (``Engine``, a streaming
handle: one Serve hop per engine chunk) and derendered here, in the caller's process: each choice
gets one in-memory derender session that holds its detokenizer window (and, with parsers, its live
vLLM parser) for the whole stream, so nothing is replayed and no ``stream_state`` makes a round trip.

Ray-free: the stages are plain async callables (:class:`Stages`), so the Ingress wires deployment
handles in and tests or other hosts can wire anything with the same shapes.

Cost per engine chunk on this path: one ``generate_stream`` chunk (a small dict) through Ray, one
derender ``feed`` (tens of microseconds without parsers), one JSON dump for the SSE frame.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from serve_app.derender.stop import engine_stop_reason
from serve_app.errors import envelope
from serve_app.wire import dump_json, stream_flag

__all__ = ["ComposedService", "Stages", "open_derender_stream", "sse_frame", "sse_stream", "SSE_DONE"]

SSE_DONE = b"data: [DONE]\n\n"


def sse_frame(obj: Any) -> bytes:
    """One server-sent event as vLLM writes it: ``data: <json>\\n\\n``."""
    return b"data: " + dump_json(obj) + b"\n\n"


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Chunk dicts as vLLM's SSE body: one frame each, then ``[DONE]``; closing it closes ``chunks``."""
    try:
        async for chunk in chunks:
            yield sse_frame(chunk)
    finally:
        await chunks.aclose()
    yield SSE_DONE


@dataclass(slots=True)
class Stages:
    """The three stages as async callables (deployment handles, or in-process services).

    ``render_chat(body, request_id) -> bytes``: the ``GenerateRequest`` JSON; ``render_completion``:
    a JSON list of them. ``generate(request) -> bytes``: the ``GenerateTokensResponse`` JSON.
    ``generate_stream(request)``: an async iterator of ``GenerateTokensStreamResponse`` dicts whose
    ``aclose()`` cancels the engine request.
    """

    render_chat: Callable[[dict, str | None], Awaitable[bytes]]
    render_completion: Callable[[dict, str | None], Awaitable[bytes]]
    generate: Callable[[dict], Awaitable[bytes]]
    generate_stream: Callable[[dict], AsyncIterator[dict]]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def open_derender_stream(
    service: Any, kind: str, request: dict[str, Any], prompt_token_ids: list[int], prompt_tokens: int
) -> Any:
    """One choice's in-memory derender session (``feed(generate_chunk) -> chunk dict``)."""
    if kind == "chat":
        return service.open_chat_stream(request, prompt_token_ids, prompt_tokens)
    # No prompt_tokens: a multi-prompt usage chunk carries the sum over prompts, which must win.
    return service.open_completion_stream(request, prompt_token_ids)


async def feed(session: Any, generate_chunk: dict[str, Any]) -> dict[str, Any]:
    return await _maybe_await(session.feed(generate_chunk))


class ComposedService:
    """Render -> Engine -> derender for one model.

    Args:
        stages: how to reach render and the engine.
        chat_derender: the chat derender service (plain, or with parsers when configured), in-process.
        completion_derender: the completions derender service (always plain), in-process.
        eos_token_id: the tokenizer's EOS id. A tokens-only engine does not know it and reports
            ``stop_reason=<id>`` where coupled ``vllm serve`` reports ``None``; it is mapped back.
    """

    def __init__(self, stages: Stages, chat_derender: Any, completion_derender: Any, eos_token_id: int | None) -> None:
        self.stages = stages
        self.chat_derender = chat_derender
        self.completion_derender = completion_derender
        self.eos_token_id = eos_token_id

    # --- helpers --------------------------------------------------------------------------------

    def _fix_stop_reason(self, choices: list[dict[str, Any]], gen_request: dict[str, Any]) -> None:
        stop_ids = (gen_request.get("sampling_params") or {}).get("stop_token_ids")
        for choice in choices:
            engine_stop_reason(choice, self.eos_token_id, stop_ids)

    async def _peeked(self, stream: AsyncIterator[dict]) -> tuple[dict | None, AsyncIterator[dict]]:
        """The first chunk, awaited before the response is committed, so early errors are real statuses."""
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return None, stream
        except BaseException:
            await stream.aclose()
            raise
        return first, stream

    # --- chat -----------------------------------------------------------------------------------

    async def chat(self, body: dict[str, Any], request_id: str | None = None) -> bytes | AsyncIterator[dict[str, Any]]:
        """``/v1/chat/completions``: the response JSON bytes, or (``stream``) an iterator of the chunk
        dicts (:func:`sse_stream` frames them), ending with vLLM's in-band error dict if the stream fails.

        Raises:
            ApiError: render or engine rejected the request (before any byte is sent).
        """
        stream = stream_flag(body)
        gen = _no_detokenize(json.loads(await self.stages.render_chat(body, request_id)))
        prompt_ids = gen["token_ids"]
        if not stream:
            response = json.loads(await self.stages.generate(gen))
            response["request_id"] = gen["request_id"]
            self._fix_stop_reason(response["choices"], gen)
            out = self.chat_derender.chat(
                {
                    "generate_response": response,
                    "chat_request": body,
                    "prompt_token_ids": prompt_ids,
                    "prompt_tokens": len(prompt_ids),
                }
            )
            return await _maybe_await(out)
        first, stream = await self._peeked(self.stages.generate_stream(gen))
        return self._chat_chunks(body, gen, first, stream)

    async def _chat_chunks(
        self, body: dict[str, Any], gen: dict[str, Any], first: dict | None, stream: AsyncIterator[dict]
    ) -> AsyncIterator[dict[str, Any]]:
        prompt_ids, request_id = gen["token_ids"], gen["request_id"]
        sessions: dict[int, Any] = {}

        def session(index: int) -> Any:
            if index not in sessions:
                sessions[index] = open_derender_stream(self.chat_derender, "chat", body, prompt_ids, len(prompt_ids))
            return sessions[index]

        async def chunks() -> AsyncIterator[dict]:
            if first is not None:
                yield first
            async for chunk in stream:
                yield chunk

        try:
            async for chunk in chunks():
                chunk["request_id"] = request_id
                choices = chunk.get("choices") or []
                self._fix_stop_reason(choices, gen)
                index = choices[0]["index"] if choices else 0
                yield await feed(session(index), chunk)
        except Exception as exc:  # the stream is committed: vLLM's in-band error frame
            yield envelope(exc)[1]
        finally:
            await stream.aclose()

    # --- completions ----------------------------------------------------------------------------

    async def completion(self, body: dict[str, Any], request_id: str | None = None) -> bytes | AsyncIterator[dict[str, Any]]:
        """``/v1/completions``: every prompt rendered, generated concurrently, derendered together."""
        stream = stream_flag(body)
        gens = [_no_detokenize(g) for g in json.loads(await self.stages.render_completion(body, request_id))]
        if not stream:
            responses = await asyncio.gather(*(self.stages.generate(g) for g in gens))
            parsed = []
            for gen, raw in zip(gens, responses):
                response = json.loads(raw)
                response["request_id"] = _base_id(gens, gen)
                self._fix_stop_reason(response["choices"], gen)
                parsed.append(response)
            out = self.completion_derender.completion(
                {
                    "generate_responses": parsed,
                    "completion_request": body,
                    "prompt_token_ids": [g["token_ids"] for g in gens],
                    "prompt_tokens": [len(g["token_ids"]) for g in gens],
                }
            )
            return await _maybe_await(out)
        usage_wanted = bool((body.get("stream_options") or {}).get("include_usage"))
        if len(gens) > 1:  # one usage chunk for all prompts, summed here (each engine would send its own)
            gens = [{**g, "stream_options": None} for g in gens]
        streams = [self.stages.generate_stream(g) for g in gens]
        merged = _merge(streams)
        first, merged = await self._peeked(merged)
        return self._completion_chunks(body, gens, first, merged, usage_wanted and len(gens) > 1)

    async def _completion_chunks(
        self,
        body: dict[str, Any],
        gens: list[dict[str, Any]],
        first: tuple[int, dict] | None,
        merged: AsyncIterator[tuple[int, dict]],
        synthesize_usage: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        n = int((gens[0].get("sampling_params") or {}).get("n") or 1)
        request_id = _base_id(gens, gens[0])
        sessions: dict[int, Any] = {}
        completion_tokens = 0

        def session(index: int, prompt: int) -> Any:
            if index not in sessions:
                ids = gens[prompt]["token_ids"]
                sessions[index] = open_derender_stream(self.completion_derender, "completion", body, ids, len(ids))
            return sessions[index]

        async def chunks() -> AsyncIterator[tuple[int, dict]]:
            if first is not None:
                yield first
            async for item in merged:
                yield item

        try:
            async for prompt, chunk in chunks():
                chunk["request_id"] = request_id
                choices = chunk.get("choices") or []
                self._fix_stop_reason(choices, gens[prompt])
                index = 0
                for choice in choices:
                    choice["index"] = index = prompt * n + choice["index"]
                    completion_tokens += len(choice.get("token_ids") or ())
                yield await feed(session(index, prompt), chunk)
            if synthesize_usage:
                prompt_tokens = sum(len(g["token_ids"]) for g in gens)
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                }
                usage_chunk = {"request_id": request_id, "choices": [], "usage": usage}
                yield await feed(session(0, 0), usage_chunk)
        except Exception as exc:
            yield envelope(exc)[1]
        finally:
            await merged.aclose()


def _no_detokenize(gen: dict[str, Any]) -> dict[str, Any]:
    """Text is made here, not in the engine: its detokenizer is only needed to match stop strings."""
    params = gen.get("sampling_params")
    if isinstance(params, dict) and not params.get("stop"):
        params["detokenize"] = False
    return gen


def _base_id(gens: list[dict[str, Any]], gen: dict[str, Any]) -> str:
    """The response id: render numbers multi-prompt requests ``<id>-<i>``; the response has ``<id>``."""
    rid = gen["request_id"]
    if len(gens) > 1:
        base, _, suffix = rid.rpartition("-")
        if suffix.isdigit() and base:
            return base
    return rid


async def _merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave several engine streams as chunks arrive, tagging each with its stream's position."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
        except BaseException as exc:  # noqa: BLE001  (re-raised by the consumer)
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
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()

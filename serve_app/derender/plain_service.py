"""Plain derender: token ids -> chat / completion responses, streaming and not. Ray-free and vLLM-free.

Behaviour is vLLM 0.32's ``ServingDerender`` + ``OnlineDerenderer`` on the no-parser path, check for
check and field for field (``tests/differential`` compares them), with four deliberate fixes:

* a stop token's text is left out, as the engine's detokenizer does (:mod:`serve_app.derender.stop`);
* streaming calls bound logprob sizes like non-streaming ones (vLLM 0.32 leaves them unbounded);
* a stream state that does not add up (offsets past the window, pieces not in the vocabulary) is a
  400 instead of garbage text or a 500;
* responses are built as dicts in vLLM's key order, without constructing pydantic response models.

Each request is first bounded as a whole (:func:`~serve_app.derender.checks.check_size`); callers on
an event loop use ``chat_async`` / ``completion_async``, which decode a big request in a worker
thread so the loop (other requests, ``/health``) keeps turning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter

from serve_app.derender.checks import (
    check_bounds,
    check_choices,
    check_prompt_ids,
    check_size,
    check_stream_chunk,
    check_stream_window,
    output_ids,
    stream_state_400,
)
from serve_app.derender.detokenize import DetokWindow, detokenize_delta, seed_window
from serve_app.derender.logprobs import context_tail, resolve_logprobs, to_completion_logprobs
from serve_app.derender.model import OFFLOAD_WORK, DerenderModel, run_off_loop, stop_if_caller_gone
from serve_app.derender.responses import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    stream_state,
    stream_usage,
    usage,
)
from serve_app.derender.stop import StopTokens
from serve_app.errors import BadRequestError
from serve_app.protocol import (
    DerenderChatRequestUnion,
    DerenderChatStreamRequest,
    DerenderCompletionRequestUnion,
    DerenderCompletionStreamRequest,
    DerenderStreamState,
)
from serve_app.wire import dump_json, load_body, validate_model

__all__ = ["PlainDerenderService", "PlainStream"]

_CHAT = TypeAdapter(DerenderChatRequestUnion)
_COMPLETION = TypeAdapter(DerenderCompletionRequestUnion)
_CHAT_STREAM = TypeAdapter(DerenderChatStreamRequest)
_COMPLETION_STREAM = TypeAdapter(DerenderCompletionStreamRequest)

async def _off_loop_if_big(decode: Callable[[Any], bytes], data: Any, work: int) -> bytes:
    if work < OFFLOAD_WORK:
        return decode(data)
    return await run_off_loop(decode, data)


class PlainDerenderService:
    """Detokenization-only derender for one model."""

    def __init__(self, model: DerenderModel) -> None:
        self.model = model
        self.tok = model.tok

    def _open_stream(
        self, request: DerenderChatStreamRequest | DerenderCompletionStreamRequest, params: Any
    ) -> tuple[DerenderStreamState, DetokWindow, bool, StopTokens]:
        """The carried state, its decode window (seeded from the prompt on the first call), and how
        the original request (``params``) decodes: ``skip_special_tokens`` and its stop tokens."""
        skip = self._decode_params(params)
        stops = self.model.stop_tokens(params)
        state = request.stream_state
        if state is not None:
            return state, self._window_from_state(state), skip, stops
        chunk = request.generate_chunk
        ids = request.prompt_token_ids if request.prompt_token_ids is not None else chunk.prompt_token_ids
        return DerenderStreamState(), seed_window(self.tok, ids, skip), skip, stops

    def _window_from_state(self, state: DerenderStreamState) -> DetokWindow:
        check_stream_window(state, self.tok)
        return DetokWindow(list(state.prev_tokens), state.prefix_offset, state.read_offset)

    def _decode_delta(
        self, choice: Any, delta_ids: list[int], window: DetokWindow, stops: StopTokens, skip: bool
    ) -> tuple[str, DetokWindow]:
        """A streamed choice's new text (its stop token left out) and the window after it."""
        text_ids = stops.text_ids(delta_ids, choice.finish_reason, choice.stop_reason)
        return detokenize_delta(self.tok, text_ids, window, skip)

    @staticmethod
    def _decode_params(request: Any) -> bool:
        # Fast tokenizers ignore spaces_between_special_tokens; only skip_special_tokens matters.
        return request.skip_special_tokens if request is not None else True

    # --- in-process streams (the composed OpenAI path) ---------------------------------------

    def open_chat_stream(
        self, chat_request: Any, prompt_token_ids: list[int], prompt_tokens: int | None = None, model: str | None = None
    ) -> PlainStream:
        """One choice's chat stream held in memory: ``feed(generate_chunk)`` -> the chat chunk dict."""
        return PlainStream(self._chat_stream, _CHAT_STREAM, "chat_request", chat_request, prompt_token_ids, prompt_tokens, model)

    def open_completion_stream(
        self, completion_request: Any, prompt_token_ids: list[int], prompt_tokens: int | None = None, model: str | None = None
    ) -> PlainStream:
        """One choice's completions stream held in memory: ``feed(generate_chunk)`` -> the chunk dict."""
        return PlainStream(
            self._completion_stream, _COMPLETION_STREAM, "completion_request", completion_request, prompt_token_ids, prompt_tokens, model
        )

    # --- endpoints -----------------------------------------------------------------------------

    def _sized(self, body: bytes | dict) -> tuple[Any, int]:
        """The parsed body, bounded as a whole, and its work (token ids plus logprob entries)."""
        data = load_body(body)
        return data, check_size(data, self.model.limits)

    def chat(self, body: bytes | dict) -> bytes:
        return self._chat(self._sized(body)[0])

    async def chat_async(self, body: bytes | dict) -> bytes:
        """:meth:`chat` for a caller on an event loop: a big request decodes in a worker thread."""
        return await _off_loop_if_big(self._chat, *self._sized(body))

    def _chat(self, data: Any) -> bytes:
        request = validate_model(_CHAT, data)
        if isinstance(request, DerenderChatStreamRequest):
            with stream_state_400():
                return dump_json(self._chat_stream(request))
        model = self.model.model_name(request.model)
        gen = request.generate_response
        check_bounds([gen], self.model.limits)
        check_prompt_ids(request.prompt_token_ids, self.model.limits)
        skip = self._decode_params(request.chat_request)
        seed = seed_window(
            self.tok, request.prompt_token_ids if request.prompt_token_ids is not None else gen.prompt_token_ids, skip
        )
        return_token_ids = bool(request.chat_request is not None and request.chat_request.return_token_ids)
        stops = self.model.stop_tokens(request.chat_request)
        choices = []
        for choice in gen.choices:
            stop_if_caller_gone()
            ids = output_ids(choice)
            logprobs = resolve_logprobs(choice.logprobs, self.tok) if choice.logprobs is not None else None
            text_ids = stops.text_ids(ids, choice.finish_reason, choice.stop_reason)
            text, _ = detokenize_delta(self.tok, text_ids, seed, skip)
            choices.append(
                {
                    "index": choice.index,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                    "token_ids": choice.token_ids if return_token_ids else None,
                    "routed_experts": None,
                }
            )
        prompt_tokens = request.prompt_tokens if request.prompt_tokens is not None else 0
        completion_tokens = sum(len(c.token_ids) for c in gen.choices if c.token_ids)
        return chat_response(gen, model, choices, usage(prompt_tokens, completion_tokens))

    def _chat_stream(self, request: DerenderChatStreamRequest) -> dict[str, Any]:
        model = self.model.model_name(request.model)
        chunk = request.generate_chunk
        prompt_len = len(request.prompt_token_ids) if request.prompt_token_ids is not None else 0
        prior_len = len(request.stream_state.output_token_ids) if request.stream_state is not None else 0
        check_stream_chunk(chunk, prompt_len, prior_len, self.model.limits)
        state, window, skip, stops = self._open_stream(request, request.chat_request)
        return_token_ids = bool(request.chat_request is not None and request.chat_request.return_token_ids)
        role_sent, context = state.role_sent, state.logprob_context_token_ids
        choices = []
        for choice in chunk.choices:
            delta_ids = choice.token_ids or []
            text, window = self._decode_delta(choice, delta_ids, window, stops, skip)
            logprobs = (
                resolve_logprobs(choice.logprobs, self.tok, state.logprob_context_token_ids)
                if choice.logprobs is not None
                else None
            )
            include_role = not role_sent
            role_sent, context = True, context_tail(state.logprob_context_token_ids, delta_ids)
            choices.append(
                {
                    "index": choice.index,
                    "delta": {"role": "assistant" if include_role else None, "content": text or None, "reasoning": None},
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                    "token_ids": choice.token_ids if return_token_ids else None,
                }
            )
        return {
            "chunk": chat_chunk(chunk, model, choices, stream_usage(chunk.usage, request.prompt_tokens)),
            "stream_state": _state_dict(state, window, role_sent=role_sent, context=context),
        }

    def completion(self, body: bytes | dict) -> bytes:
        return self._completion(self._sized(body)[0])

    async def completion_async(self, body: bytes | dict) -> bytes:
        """:meth:`completion` for a caller on an event loop: a big request decodes in a worker thread."""
        return await _off_loop_if_big(self._completion, *self._sized(body))

    def _completion(self, data: Any) -> bytes:
        request = validate_model(_COMPLETION, data)
        if isinstance(request, DerenderCompletionStreamRequest):
            with stream_state_400("detokenization", (KeyError, IndexError), detail=True):  # vLLM's words here
                return dump_json(self._completion_stream(request))
        model = self.model.model_name(request.model)
        responses = request.generate_responses
        if not responses:
            raise BadRequestError("generate_responses must not be empty")
        check_bounds(responses, self.model.limits)
        for ids in request.prompt_token_ids or []:
            check_prompt_ids(ids, self.model.limits)
        n = len(responses)
        prompt_tokens = request.prompt_tokens if request.prompt_tokens is not None else [0] * n
        seeds = request.prompt_token_ids if request.prompt_token_ids is not None else [None] * n
        skip = self._decode_params(request.completion_request)
        stops = self.model.stop_tokens(request.completion_request)
        choices: list[dict[str, Any]] = []
        total_prompt, total_completion = 0, 0
        for gen, pt, seed_ids in zip(responses, prompt_tokens, seeds, strict=True):
            seed = seed_window(self.tok, seed_ids if seed_ids is not None else gen.prompt_token_ids, skip)
            for choice in gen.choices:
                stop_if_caller_gone()
                ids = output_ids(choice, f" in response {gen.request_id}")
                text_ids = stops.text_ids(ids, choice.finish_reason, choice.stop_reason)
                text, _ = detokenize_delta(self.tok, text_ids, seed, skip)
                logprobs = (
                    to_completion_logprobs(resolve_logprobs(choice.logprobs, self.tok))
                    if choice.logprobs is not None
                    else None
                )
                choices.append(
                    {
                        "index": len(choices),
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                )
                total_completion += len(ids)
            total_prompt += pt
        return completion_response(responses, model, choices, usage(total_prompt, total_completion))

    def _completion_stream(self, request: DerenderCompletionStreamRequest) -> dict[str, Any]:
        model = self.model.model_name(request.model)
        check_prompt_ids(request.prompt_token_ids, self.model.limits)
        chunk = request.generate_chunk
        if len(chunk.choices) > 1:
            raise BadRequestError("derender_completion_stream expects at most one choice per chunk")
        check_choices(chunk.choices, self.model.limits)
        state, window, skip, stops = self._open_stream(request, request.completion_request)
        context, text_offset = state.logprob_context_token_ids, state.logprob_text_offset
        choices = []
        for choice in chunk.choices:
            delta_ids = choice.token_ids or []
            text, window = self._decode_delta(choice, delta_ids, window, stops, skip)
            logprobs = None
            if choice.logprobs is not None:
                resolved = resolve_logprobs(choice.logprobs, self.tok, state.logprob_context_token_ids)
                logprobs = to_completion_logprobs(resolved, state.logprob_text_offset)
            context = context_tail(state.logprob_context_token_ids, delta_ids)
            text_offset = state.logprob_text_offset + len(text)
            choices.append(
                {
                    "index": choice.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                    "prompt_token_ids": None,
                    "token_ids": None,
                }
            )
        return {
            "chunk": completion_chunk(chunk, model, choices, stream_usage(chunk.usage, request.prompt_tokens)),
            "stream_state": _state_dict(state, window, context=context, text_offset=text_offset),
        }


class PlainStream:
    """A plain stream whose (bounded, O(1)) carried state stays in memory between chunks."""

    def __init__(
        self, step: Any, adapter: TypeAdapter, request_field: str, request: Any, prompt_ids: list[int],
        prompt_tokens: int | None, model: str | None,
    ) -> None:
        self._step, self._adapter = step, adapter
        self._fields = {"stream": True, "model": model, request_field: request, "prompt_token_ids": prompt_ids,
                        "prompt_tokens": prompt_tokens}
        self.state: dict[str, Any] | None = None

    def feed(self, generate_chunk: Any) -> dict[str, Any]:
        request = self._adapter.validate_python({**self._fields, "generate_chunk": generate_chunk, "stream_state": self.state})
        out = self._step(request)
        self.state = out["stream_state"]
        return out["chunk"]


def _state_dict(
    state: DerenderStreamState,
    window: DetokWindow,
    *,
    role_sent: bool | None = None,
    context: list[int] | None = None,
    text_offset: int | None = None,
) -> dict[str, Any]:
    """The carried state after a plain chunk: the new window, the rest passed through."""
    return stream_state(
        prev_tokens=window.prev_tokens,
        prefix_offset=window.prefix_offset,
        read_offset=window.read_offset,
        role_sent=state.role_sent if role_sent is None else role_sent,
        logprob_context_token_ids=state.logprob_context_token_ids if context is None else context,
        logprob_text_offset=state.logprob_text_offset if text_offset is None else text_offset,
        output_token_ids=state.output_token_ids,
        output_chunk_lens=state.output_chunk_lens,
        tools_streamed=state.tools_streamed,
        last_tool_call_ids=state.last_tool_call_ids,
    )

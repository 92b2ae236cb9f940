"""Plain derender: token ids -> chat / completion responses, streaming and not. Ray-free and vLLM-free.

Behaviour is vLLM 0.32's ``ServingDerender`` + ``OnlineDerenderer`` on the no-parser path, check for
check and field for field (``tests/differential`` compares them), with three deliberate fixes:

* streaming calls bound logprob sizes like non-streaming ones (vLLM 0.32 leaves them unbounded);
* a stream state that does not add up (offsets past the window, pieces not in the vocabulary) is a
  400 instead of garbage text or a 500;
* responses are built as dicts in vLLM's key order, without constructing pydantic response models.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import TypeAdapter

from serve_app.derender.detokenize import DetokWindow, detokenize_delta, seed_window
from serve_app.derender.logprobs import context_tail, resolve_logprobs, to_completion_logprobs
from serve_app.derender.stop import StopTokens
from serve_app.derender.tokenizer import DetokTokenizer
from serve_app.errors import ApiError, BadRequestError, NotFoundError
from serve_app.protocol import (
    DerenderChatRequestUnion,
    DerenderChatStreamRequest,
    DerenderCompletionRequestUnion,
    DerenderCompletionStreamRequest,
    DerenderStreamState,
    GenerateTokensResponse,
    UsageInfo,
)
from serve_app.wire import dump_json, load_body, validate_model

__all__ = ["DerenderLimits", "PlainDerenderService"]

_CHAT = TypeAdapter(DerenderChatRequestUnion)
_COMPLETION = TypeAdapter(DerenderCompletionRequestUnion)
_CHAT_STREAM = TypeAdapter(DerenderChatStreamRequest)
_COMPLETION_STREAM = TypeAdapter(DerenderCompletionStreamRequest)


class DerenderLimits:
    def __init__(self, max_model_len: int, max_logprobs: int, max_n_sequences: int) -> None:
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.max_n_sequences = max_n_sequences


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _stream_usage(usage: UsageInfo | None, prompt_tokens: int | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    pt = prompt_tokens if prompt_tokens is not None else (usage.prompt_tokens or 0)
    return _usage(pt, usage.completion_tokens or 0)


def _dump(model: Any) -> Any:
    return model.model_dump() if model is not None else None


class PlainDerenderService:
    """Detokenization-only derender for one model."""

    def __init__(
        self, tok: DetokTokenizer, served_model_names: list[str], limits: DerenderLimits, eos_token_ids: list[int]
    ) -> None:
        self.tok = tok
        self.served_model_names = served_model_names
        self.limits = limits
        self.eos_token_ids = eos_token_ids

    def stop_tokens(self, request: Any) -> StopTokens:
        """The stop tokens whose text a ``stop`` finish leaves out, for this chat / completion request."""
        return StopTokens.of_request(self.eos_token_ids, request)

    # --- checks, in vLLM's order ---------------------------------------------------------------

    def _model_name(self, model: str | None) -> str:
        if model and model not in self.served_model_names:
            raise NotFoundError(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.served_model_names)}.",
                param="model",
            )
        return model or self.served_model_names[0]

    def _check_choices(self, choices: list[Any]) -> None:
        lim = self.limits
        for choice in choices:
            if choice.token_ids and len(choice.token_ids) > lim.max_model_len:
                raise BadRequestError(
                    f"token_ids length ({len(choice.token_ids)}) in choice {choice.index} exceeds "
                    f"max_model_len ({lim.max_model_len})."
                )
            content = choice.logprobs.content if choice.logprobs else None
            if content:
                if len(content) > lim.max_model_len:
                    raise BadRequestError(
                        f"logprobs.content length ({len(content)}) in choice {choice.index} exceeds "
                        f"max_model_len ({lim.max_model_len})."
                    )
                for entry in content:
                    if lim.max_logprobs >= 0 and entry.top_logprobs and len(entry.top_logprobs) > lim.max_logprobs:
                        raise BadRequestError(
                            f"top_logprobs count ({len(entry.top_logprobs)}) in choice {choice.index} exceeds "
                            f"max_logprobs ({lim.max_logprobs})."
                        )

    def _check_bounds(self, responses: list[GenerateTokensResponse]) -> None:
        max_n, max_len = self.limits.max_n_sequences, self.limits.max_model_len
        if len(responses) > max_n:
            raise BadRequestError(
                f"generate_responses count ({len(responses)}) exceeds server maximum ({max_n}). "
                "Set VLLM_MAX_N_SEQUENCES to increase this limit."
            )
        for gen in responses:
            if len(gen.choices) > max_n:
                raise BadRequestError(
                    f"choices count ({len(gen.choices)}) in response '{gen.request_id}' exceeds server maximum ({max_n})."
                )
            self._check_choices(gen.choices)
            if gen.prompt_logprobs and len(gen.prompt_logprobs) > max_len:
                raise BadRequestError(
                    f"prompt_logprobs length ({len(gen.prompt_logprobs)}) in response '{gen.request_id}' "
                    f"exceeds max_model_len ({max_len})."
                )

    def _check_prompt_ids(self, ids: list[int] | None) -> None:
        if ids is not None and len(ids) > self.limits.max_model_len:
            raise BadRequestError(
                f"prompt_token_ids length ({len(ids)}) exceeds max_model_len ({self.limits.max_model_len})."
            )

    def _open_stream(
        self, request: DerenderChatStreamRequest | DerenderCompletionStreamRequest, skip_special_tokens: bool
    ) -> tuple[DerenderStreamState, DetokWindow]:
        """The carried state and its decode window; on the first call, a window seeded from the prompt."""
        state = request.stream_state
        if state is not None:
            return state, self._window_from_state(state)
        chunk = request.generate_chunk
        ids = request.prompt_token_ids if request.prompt_token_ids is not None else chunk.prompt_token_ids
        return DerenderStreamState(), seed_window(self.tok, ids, skip_special_tokens)

    def _window_from_state(self, state: DerenderStreamState) -> DetokWindow:
        # vLLM trusts the carried window; a tampered one decodes garbage or fails deep inside.
        if state.prefix_offset > state.read_offset or state.read_offset > len(state.prev_tokens):
            raise BadRequestError("invalid stream_state: offsets do not fit prev_tokens")
        pieces = self.tok.piece_set
        if any(p not in pieces and p != "" for p in state.prev_tokens):
            raise BadRequestError("invalid stream_state: prev_tokens holds pieces outside the vocabulary")
        return DetokWindow(list(state.prev_tokens), state.prefix_offset, state.read_offset)

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

    def chat(self, body: bytes | dict) -> bytes:
        request = validate_model(_CHAT, load_body(body))
        if isinstance(request, DerenderChatStreamRequest):
            try:
                return dump_json(self._chat_stream(request))
            except ApiError:
                raise
            except Exception:  # as vLLM: whatever breaks on a carried state is the caller's 400
                raise BadRequestError("invalid stream_state: derender failed") from None
        model = self._model_name(request.model)
        gen = request.generate_response
        self._check_bounds([gen])
        self._check_prompt_ids(request.prompt_token_ids)
        skip = self._decode_params(request.chat_request)
        seed = seed_window(
            self.tok, request.prompt_token_ids if request.prompt_token_ids is not None else gen.prompt_token_ids, skip
        )
        return_token_ids = bool(request.chat_request is not None and request.chat_request.return_token_ids)
        stops = self.stop_tokens(request.chat_request)
        choices = []
        for choice in gen.choices:
            if not choice.token_ids:
                raise BadRequestError(f"choice {choice.index} has empty or null token_ids")
            logprobs = resolve_logprobs(choice.logprobs, self.tok) if choice.logprobs is not None else None
            text_ids = stops.text_ids(choice.token_ids, choice.finish_reason, choice.stop_reason)
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
        return chat_response(gen, model, choices, _usage(prompt_tokens, completion_tokens))

    def _chat_stream(self, request: DerenderChatStreamRequest) -> dict[str, Any]:
        model = self._model_name(request.model)
        chunk = request.generate_chunk
        if len(chunk.choices) > 1:
            raise BadRequestError(f"derender_chat_stream expects at most one choice per chunk (got {len(chunk.choices)}).")
        prompt_len = len(request.prompt_token_ids) if request.prompt_token_ids is not None else 0
        prior_len = len(request.stream_state.output_token_ids) if request.stream_state is not None else 0
        delta_len = sum(len(c.token_ids) for c in chunk.choices if c.token_ids)
        max_len = self.limits.max_model_len
        if prompt_len + prior_len + delta_len > max_len:
            raise BadRequestError(
                f"prompt_token_ids length ({prompt_len}) plus output_token_ids length ({prior_len}) plus delta "
                f"({delta_len}) exceeds max_model_len ({max_len})."
            )
        self._check_choices(chunk.choices)
        skip = self._decode_params(request.chat_request)
        state, window = self._open_stream(request, skip)
        return_token_ids = bool(request.chat_request is not None and request.chat_request.return_token_ids)
        stops = self.stop_tokens(request.chat_request)
        role_sent, context = state.role_sent, state.logprob_context_token_ids
        choices = []
        for choice in chunk.choices:
            delta_ids = choice.token_ids or []
            text_ids = stops.text_ids(delta_ids, choice.finish_reason, choice.stop_reason)
            text, window = detokenize_delta(self.tok, text_ids, window, skip)
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
            "chunk": {
                "id": chunk.request_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "usage": _stream_usage(chunk.usage, request.prompt_tokens),
                "system_fingerprint": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "metrics": _dump(chunk.metrics),
            },
            "stream_state": _state_dict(state, window, role_sent=role_sent, context=context),
        }

    def completion(self, body: bytes | dict) -> bytes:
        data = load_body(body)
        request = validate_model(_COMPLETION, data)
        if isinstance(request, DerenderCompletionStreamRequest):
            try:
                return dump_json(self._completion_stream(request))
            except ApiError:
                raise
            except (KeyError, IndexError) as exc:
                raise BadRequestError(f"invalid stream_state: detokenization failed ({exc})") from None
        model = self._model_name(request.model)
        responses = request.generate_responses
        if not responses:
            raise BadRequestError("generate_responses must not be empty")
        self._check_bounds(responses)
        for ids in request.prompt_token_ids or []:
            self._check_prompt_ids(ids)
        n = len(responses)
        prompt_tokens = request.prompt_tokens if request.prompt_tokens is not None else [0] * n
        seeds = request.prompt_token_ids if request.prompt_token_ids is not None else [None] * n
        skip = self._decode_params(request.completion_request)
        stops = self.stop_tokens(request.completion_request)
        choices, total_prompt, total_completion = [], 0, 0
        for gen, pt, seed_ids in zip(responses, prompt_tokens, seeds):
            seed = seed_window(self.tok, seed_ids if seed_ids is not None else gen.prompt_token_ids, skip)
            for choice in gen.choices:
                if not choice.token_ids:
                    raise BadRequestError(
                        f"choice {choice.index} in response {gen.request_id} has empty or null token_ids"
                    )
                text_ids = stops.text_ids(choice.token_ids, choice.finish_reason, choice.stop_reason)
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
                total_completion += len(choice.token_ids)
            total_prompt += pt
        first = responses[0]
        kv = first.kv_transfer_params
        if any(r.kv_transfer_params != kv for r in responses[1:]):
            kv = None
        return dump_json(
            {
                "id": first.request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": None,
                "usage": _usage(total_prompt, total_completion),
                "kv_transfer_params": kv,
                "ec_transfer_params": None,
                "metrics": _dump(first.metrics) if n == 1 else None,
            }
        )

    def _completion_stream(self, request: DerenderCompletionStreamRequest) -> dict[str, Any]:
        model = self._model_name(request.model)
        self._check_prompt_ids(request.prompt_token_ids)
        chunk = request.generate_chunk
        if len(chunk.choices) > 1:
            raise BadRequestError("derender_completion_stream expects at most one choice per chunk")
        self._check_choices(chunk.choices)
        skip = self._decode_params(request.completion_request)
        state, window = self._open_stream(request, skip)
        stops = self.stop_tokens(request.completion_request)
        context, text_offset = state.logprob_context_token_ids, state.logprob_text_offset
        choices = []
        for choice in chunk.choices:
            delta_ids = choice.token_ids or []
            text_ids = stops.text_ids(delta_ids, choice.finish_reason, choice.stop_reason)
            text, window = detokenize_delta(self.tok, text_ids, window, skip)
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
            "chunk": {
                "id": chunk.request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                "usage": _stream_usage(chunk.usage, request.prompt_tokens),
                "system_fingerprint": None,
                "metrics": _dump(chunk.metrics),
            },
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


def chat_response(gen: GenerateTokensResponse, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]) -> bytes:
    """A non-streaming ``ChatCompletionResponse`` as vLLM serialises it (its key order)."""
    return dump_json(
        {
            "id": gen.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "prompt_logprobs": _prompt_logprobs(gen),
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": gen.kv_transfer_params,
            "ec_transfer_params": None,
            "metrics": _dump(gen.metrics),
        }
    )


def _prompt_logprobs(gen: GenerateTokensResponse) -> Any:
    if gen.prompt_logprobs is None:
        return None
    return [None if d is None else {k: v.model_dump() for k, v in d.items()} for d in gen.prompt_logprobs]


def _state_dict(
    state: DerenderStreamState,
    window: DetokWindow,
    *,
    role_sent: bool | None = None,
    context: list[int] | None = None,
    text_offset: int | None = None,
) -> dict[str, Any]:
    return {
        "prev_tokens": window.prev_tokens,
        "prefix_offset": window.prefix_offset,
        "read_offset": window.read_offset,
        "role_sent": state.role_sent if role_sent is None else role_sent,
        "logprob_context_token_ids": state.logprob_context_token_ids if context is None else context,
        "logprob_text_offset": state.logprob_text_offset if text_offset is None else text_offset,
        "output_token_ids": state.output_token_ids,
        "output_chunk_lens": state.output_chunk_lens,
        "tools_streamed": state.tools_streamed,
        "last_tool_call_ids": state.last_tool_call_ids,
    }

"""vLLM 0.32's derender responses as plain dicts, in its key order. Pure.

Both derender services build their answers here: the chat and completion responses and chunks, the
choices in them, usage, and the carried ``stream_state``. Dicts rather than pydantic response models: a chunk costs
microseconds, and ``tests/differential`` pins every key against vLLM's models.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from serve_app.wire import dump_json

if TYPE_CHECKING:
    from serve_app.protocol import GenerateTokensResponse, GenerateTokensStreamResponse, UsageInfo

__all__ = [
    "assistant_message",
    "chat_choice",
    "chat_chunk",
    "chat_delta_choice",
    "chat_response",
    "completion_choice",
    "completion_chunk",
    "completion_delta_choice",
    "completion_response",
    "dump_model",
    "stream_state",
    "stream_usage",
    "usage",
]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def stream_usage(chunk_usage: UsageInfo | None, prompt_tokens: int | None) -> dict[str, Any] | None:
    """A streamed chunk's usage: the engine's, with the request's prompt token count when it has one."""
    if chunk_usage is None:
        return None
    pt = prompt_tokens if prompt_tokens is not None else (chunk_usage.prompt_tokens or 0)
    return usage(pt, chunk_usage.completion_tokens or 0)


def dump_model(model: Any) -> Any:
    return model.model_dump() if model is not None else None


def chat_response(gen: GenerateTokensResponse, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]) -> bytes:
    """A non-streaming ``ChatCompletionResponse`` for generate response ``gen``, as JSON bytes."""
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
            "metrics": dump_model(gen.metrics),
        }
    )


def chat_chunk(
    chunk: GenerateTokensStreamResponse, model: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` for generate chunk ``chunk``."""
    return {
        "id": chunk.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "metrics": dump_model(chunk.metrics),
    }


def completion_response(responses: list[GenerateTokensResponse], model: str, choices: list[dict[str, Any]], usage: dict[str, Any]) -> bytes:
    """A non-streaming ``CompletionResponse`` for ``responses`` (one per prompt), as JSON bytes."""
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
            "usage": usage,
            "kv_transfer_params": kv,
            "ec_transfer_params": None,
            "metrics": dump_model(first.metrics) if len(responses) == 1 else None,
        }
    )


def completion_chunk(
    chunk: GenerateTokensStreamResponse, model: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """A streamed ``text_completion`` chunk for generate chunk ``chunk``."""
    return {
        "id": chunk.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
        "metrics": dump_model(chunk.metrics),
    }


def chat_choice(
    index: int, message: dict[str, Any],
    logprobs: Any, finish_reason: str | None, stop_reason: int | str | None, token_ids: list[int] | None
) -> dict[str, Any]:
    """A ``ChatCompletionResponseChoice``."""
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "routed_experts": None,
    }


def assistant_message(content: str) -> dict[str, Any]:
    """The plain path's ``ChatMessage``: the text as content, nothing parsed out of it."""
    return {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }


def chat_delta_choice(
    index: int, delta: dict[str, Any], logprobs: Any, finish_reason: str | None, stop_reason: int | str | None, token_ids: list[int] | None
) -> dict[str, Any]:
    """A ``ChatCompletionResponseStreamChoice``."""
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
    }


def completion_choice(index: int, text: str, logprobs: Any, finish_reason: str | None, stop_reason: int | str | None) -> dict[str, Any]:
    """A ``CompletionResponseChoice``."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


def completion_delta_choice(
    index: int, text: str, logprobs: Any, finish_reason: str | None, stop_reason: int | str | None
) -> dict[str, Any]:
    """A streamed ``CompletionResponseStreamChoice``."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "prompt_token_ids": None,
        "token_ids": None,
    }


def stream_state(
    *,
    prev_tokens: list[str],
    prefix_offset: int,
    read_offset: int,
    role_sent: bool,
    logprob_context_token_ids: list[int],
    logprob_text_offset: int,
    output_token_ids: list[int],
    output_chunk_lens: list[int],
    tools_streamed: bool,
    last_tool_call_ids: list[str],
) -> dict[str, Any]:
    """The ``DerenderStreamState`` the client carries to the next chunk."""
    return {
        "prev_tokens": prev_tokens,
        "prefix_offset": prefix_offset,
        "read_offset": read_offset,
        "role_sent": role_sent,
        "logprob_context_token_ids": logprob_context_token_ids,
        "logprob_text_offset": logprob_text_offset,
        "output_token_ids": output_token_ids,
        "output_chunk_lens": output_chunk_lens,
        "tools_streamed": tools_streamed,
        "last_tool_call_ids": last_tool_call_ids,
    }


def _prompt_logprobs(gen: GenerateTokensResponse) -> Any:
    if gen.prompt_logprobs is None:
        return None
    return [None if d is None else {k: v.model_dump() for k, v in d.items()} for d in gen.prompt_logprobs]

"""Whole (non-streaming) derender answers, one choice at a time. Ray-free; vLLM only through a kit.

The services check a request and derive its :class:`~serve_app.derender.request.RequestConfig`
first; these build the answer. Each loop calls :func:`~serve_app.derender.model.stop_if_caller_gone`
once per choice, so a request whose caller went away stops decoding in the worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serve_app.derender.checks import output_ids
from serve_app.derender.detokenize import detokenize_delta, seed_window
from serve_app.derender.logprobs import resolve_logprobs, to_completion_logprobs, trim_top_logprobs
from serve_app.derender.model import DerenderModel, stop_if_caller_gone
from serve_app.derender.request import RequestConfig
from serve_app.derender.responses import (
    assistant_message,
    chat_choice,
    chat_response,
    completion_choice,
    completion_response,
    usage,
)
from serve_app.errors import BadRequestError
from serve_app.protocol import DerenderChatRequest, DerenderCompletionRequest, GenerateTokensChoice

if TYPE_CHECKING:
    from serve_app._vllm import ParserKit

__all__ = ["parser_chat", "plain_chat", "plain_completion"]


def plain_chat(model: DerenderModel, config: RequestConfig, name: str, request: DerenderChatRequest) -> bytes:
    """A ``chat.completion`` with each choice's text as its content."""
    tok, skip = model.tok, config.skip_special_tokens
    gen = request.generate_response
    seed = seed_window(tok, request.prompt_token_ids if request.prompt_token_ids is not None else gen.prompt_token_ids, skip)
    choices = []
    for choice in gen.choices:
        stop_if_caller_gone()
        ids = output_ids(choice)
        logprobs = resolve_logprobs(choice.logprobs, tok) if choice.logprobs is not None else None
        text_ids = config.stops.text_ids(ids, choice.finish_reason, choice.stop_reason)
        text, _ = detokenize_delta(tok, text_ids, seed, skip)
        token_ids = choice.token_ids if config.return_token_ids else None
        choices.append(chat_choice(choice.index, assistant_message(text), logprobs, choice.finish_reason, choice.stop_reason, token_ids))
    prompt_tokens = request.prompt_tokens if request.prompt_tokens is not None else 0
    completion_tokens = sum(len(c.token_ids) for c in gen.choices if c.token_ids)
    return chat_response(gen, name, choices, usage(prompt_tokens, completion_tokens))


def plain_completion(model: DerenderModel, config: RequestConfig, name: str, request: DerenderCompletionRequest) -> bytes:
    """A ``text_completion`` over every prompt's response, choices numbered across them."""
    tok, skip = model.tok, config.skip_special_tokens
    responses = request.generate_responses
    n = len(responses)
    prompt_tokens = request.prompt_tokens if request.prompt_tokens is not None else [0] * n
    seeds = request.prompt_token_ids if request.prompt_token_ids is not None else [None] * n
    choices: list[dict[str, Any]] = []
    total_prompt, total_completion = 0, 0
    for gen, pt, seed_ids in zip(responses, prompt_tokens, seeds, strict=True):
        seed = seed_window(tok, seed_ids if seed_ids is not None else gen.prompt_token_ids, skip)
        for choice in gen.choices:
            stop_if_caller_gone()
            ids = output_ids(choice, f" in response {gen.request_id}")
            text_ids = config.stops.text_ids(ids, choice.finish_reason, choice.stop_reason)
            text, _ = detokenize_delta(tok, text_ids, seed, skip)
            logprobs = to_completion_logprobs(resolve_logprobs(choice.logprobs, tok)) if choice.logprobs is not None else None
            choices.append(completion_choice(len(choices), text, logprobs, choice.finish_reason, choice.stop_reason))
            total_completion += len(ids)
        total_prompt += pt
    return completion_response(responses, name, choices, usage(total_prompt, total_completion))


def parser_chat(kit: ParserKit, model: DerenderModel, config: RequestConfig, name: str, request: DerenderChatRequest) -> bytes:
    """A ``chat.completion`` as ``vllm serve`` builds it: each choice parsed by a fresh vLLM parser."""
    gen = request.generate_response
    prompt_ids = request.prompt_token_ids if request.prompt_token_ids is not None else gen.prompt_token_ids
    choices, reasoning_tokens = [], 0
    for choice in gen.choices:
        out, reasoning = _parser_choice(kit, model, choice, config, prompt_ids or [])
        choices.append(out)
        reasoning_tokens += reasoning
    prompt_tokens = request.prompt_tokens if request.prompt_tokens is not None else 0
    completion_tokens = sum(len(c.token_ids) for c in gen.choices if c.token_ids)
    counts = usage(prompt_tokens, completion_tokens)
    if kit.has_reasoning_parser:  # as vllm serve
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return chat_response(gen, name, choices, counts)


def _parser_choice(
    kit: ParserKit, model: DerenderModel, choice: GenerateTokensChoice, config: RequestConfig, prompt_ids: list[int]
) -> tuple[dict[str, Any], int]:
    """One choice as ``vllm serve``'s ``chat_completion_full_generator`` builds it, and its
    reasoning-token count."""
    stop_if_caller_gone()
    request = config.request
    ids = output_ids(choice)
    text_ids = config.stops.text_ids(ids, choice.finish_reason, choice.stop_reason)
    skip = config.skip_special_tokens
    tok = model.tok
    text, _ = detokenize_delta(tok, text_ids, seed_window(tok, prompt_ids, skip), skip)
    parser = kit.new_parser(request, config.template_kwargs)
    if prompt_ids:
        parser.set_prompt_token_ids(prompt_ids)
    try:
        reasoning, content, calls = parser.parse(text, request, enable_auto_tools=kit.enable_auto_tools, model_output_token_ids=ids)
    except ValueError as exc:
        raise BadRequestError(str(exc)) from None
    reasoning_tokens = parser.count_reasoning_tokens(ids) if kit.has_reasoning_parser else 0
    hide = not config.include_reasoning
    if hide:
        reasoning = None
    tools_allowed = config.named_tool_choice or config.required_tool_choice or (
        kit.enable_auto_tools
        and kit.has_tool_parser
        and request.tools
        and request.tool_choice in ("auto", None)
    )
    tool_calls = [kit.ToolCall(id=c.id or kit.tool_call_id(), function=c) for c in calls or []] if tools_allowed else []
    if config.named_tool_choice or config.required_tool_choice:
        content = content or ""
    if config.echo:
        content = config.echo + (content or "")
    if config.single_tool_call:
        tool_calls = tool_calls[:1]
    auto_called = bool(tool_calls) and not (config.named_tool_choice or config.required_tool_choice)
    finish = choice.finish_reason or "stop"
    if auto_called or (config.required_tool_choice and finish == "stop"):
        finish = "tool_calls"
    message = kit.ChatMessage(role=config.role, reasoning=reasoning, content=content, tool_calls=tool_calls)
    logprobs = None
    if choice.logprobs is not None and not hide:
        logprobs = trim_top_logprobs(resolve_logprobs(choice.logprobs, tok), config.top_logprobs)
    token_ids = ids if config.return_token_ids else None
    return chat_choice(choice.index, message.model_dump(), logprobs, finish, choice.stop_reason, token_ids), reasoning_tokens

"""What a request decides for derender, derived once: :class:`RequestConfig`, for both paths. Pure of vLLM.

A plain stream derives its configuration when it opens (:meth:`RequestConfig.plain`: a few fields
of the already validated request, cheaper than any lookup). The parser path validates the chat
request with vLLM's own model and parser hooks, which costs far more, so :class:`RequestConfigs`
keeps the configurations of recent requests by content hash: a stream's later chunks, which carry
the same ``chat_request``, skip the validation.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from serve_app.derender.model import DerenderModel
from serve_app.derender.sessions import SessionCache
from serve_app.derender.stop import StopTokens
from serve_app.errors import ApiError, InvalidChatRequest, invalid_request, validation_error

if TYPE_CHECKING:
    from serve_app._vllm import ParserKit

__all__ = ["CONFIG_CACHE_SIZE", "RequestConfig", "RequestConfigs", "parser_config"]

CONFIG_CACHE_SIZE = 1024  # request configurations kept per parser service (and at most max_request_bytes)


@dataclass(frozen=True, slots=True)
class RequestConfig:
    """What a chat or completion request decides for derender.

    The first three fields are every path's; the rest only the parser path reads (their defaults
    are what a plain request means)."""

    stops: StopTokens  # whose text a `stop` finish leaves out
    skip_special_tokens: bool  # (the parser path: after the parser's adjust_request, as the engine decodes)
    return_token_ids: bool
    key: bytes = b""  # the content hash the parser path caches it under
    request: Any = None  # vLLM's ChatCompletionRequest, without its messages (ParserKit.without_messages)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    named_tool_choice: bool = False
    required_tool_choice: bool = False
    include_reasoning: bool = True
    single_tool_call: bool = False  # parallel_tool_calls: false
    role: str = "assistant"
    top_logprobs: int = 0  # entries kept per token (-1: all)
    echo: str = ""  # with echo: the last message's text, put in front of the content
    size: int = 0  # what it keeps, for the cache's bound in bytes: the request as JSON, and echo

    @classmethod
    def plain(cls, model: DerenderModel, request: Any) -> RequestConfig:
        """A plain chat or completion request's (``serve_app.protocol``'s model, or ``None``)."""
        if request is None:
            return cls(model.stop_tokens(None), True, False)
        # Fast tokenizers ignore spaces_between_special_tokens; only skip_special_tokens matters.
        return cls(model.stop_tokens(request), request.skip_special_tokens, bool(getattr(request, "return_token_ids", None)))


class RequestConfigs:
    """The parser path's configurations by content hash, bounded in entries and in bytes kept.

    The loop thread and the derender worker thread both look configurations up and file them (the
    cache locks); two that miss on one request at once build equal configurations."""

    def __init__(self, build: Callable[[dict[str, Any], bytes], RequestConfig], max_bytes: int) -> None:
        self._build = build
        self._cache = SessionCache[RequestConfig](CONFIG_CACHE_SIZE, float("inf"), max_bytes)

    def get(self, chat_request: Any) -> RequestConfig:
        """Validate and derive once per distinct ``chat_request`` (a dict or model)."""
        raw = chat_request if isinstance(chat_request, dict) else chat_request.model_dump()
        key = blake2b(json.dumps(raw, sort_keys=True, default=str).encode(), digest_size=16).digest()
        config = self._cache.get(key)
        if config is None:
            # vLLM's validators fill in the dict they are given (tool_choice "auto", keys dropped): a
            # copy, so that the caller's request, and the key its next lookup computes, stay as sent.
            config = self._build(copy.deepcopy(raw) if raw is chat_request else raw, key)
            self._cache.put(key, config, config.size)
        return config

    def __len__(self) -> int:
        return len(self._cache)

    def values(self) -> list[RequestConfig]:
        return self._cache.values()

    @property
    def bytes(self) -> int:
        """What the cached configurations keep, in bytes (each its :attr:`RequestConfig.size`)."""
        return self._cache.tokens


def parser_config(kit: ParserKit, model: DerenderModel, raw: dict[str, Any], key: bytes) -> RequestConfig:
    """A chat request checked as ``vllm serve`` checks it (``kit``: :class:`serve_app._vllm.ParserKit`).

    Raises:
        InvalidChatRequest: the request fails vLLM's schema (answered with vLLM's 400 for the body).
        ApiError: vLLM's other checks of it (e.g. the structured outputs a tool choice asks for).
    """
    try:
        request = kit.ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        error = validation_error(exc.errors(include_url=False), loc_prefix=("body", "chat_request"))
        raise InvalidChatRequest(error) from None
    except Exception as exc:  # vLLM's validators crashing on the request's shape: its error, a 400
        raise invalid_request(exc) from None
    try:  # still vLLM's checks of the request (e.g. the structured outputs a tool choice asks for)
        template_kwargs = kit.chat_template_kwargs(request)
        request = kit.adjust_request(request, template_kwargs)
    except ApiError:
        raise
    except Exception as exc:
        raise invalid_request(exc) from None
    tool_choice = request.tool_choice
    role = _response_role(request)
    echo = _echo_text(request, role)
    request = kit.without_messages(request)  # the bulk of a request, which parsers need only a count of
    return RequestConfig(
        stops=model.stop_tokens(request),
        skip_special_tokens=bool(request.skip_special_tokens),
        return_token_ids=bool(request.return_token_ids) and bool(request.include_reasoning),
        key=key,
        request=request,
        template_kwargs=template_kwargs,
        named_tool_choice=type(tool_choice) is kit.NamedToolChoice,
        required_tool_choice=tool_choice == "required",
        include_reasoning=bool(request.include_reasoning),
        single_tool_call=request.parallel_tool_calls is False,
        role=role,
        top_logprobs=request.top_logprobs if request.top_logprobs is not None else 0,
        echo=echo,
        size=_json_size(request) + len(echo),
    )


def _json_size(model: Any) -> int:
    """A cached request's JSON length, what the byte bound counts. A lone surrogate in a string
    (valid JSON, which pydantic will not encode as UTF-8) is counted as its escape instead."""
    try:
        return len(model.model_dump_json(warnings=False))
    except ValueError:  # PydanticSerializationError
        return len(json.dumps(model.model_dump(warnings=False), default=str))


def _response_role(request: Any) -> str:
    """``vllm serve``'s response role: the last message's when it continues it (no generation
    prompt). With no message to continue (``messages: []``), vLLM's derender's: ``"assistant"``."""
    last = request.messages[-1] if not request.add_generation_prompt and request.messages else None
    role = last.get("role") if isinstance(last, dict) else None
    return role if isinstance(role, str) else "assistant"


def _echo_text(request: Any, role: str) -> str:
    """``vllm serve``'s echo: the last message's text when it has the response's role."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    if last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content

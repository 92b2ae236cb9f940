"""Parser derender: token ids -> reasoning / content / tool calls with vLLM's own parsers. Ray-free.

The split is vLLM's (its ``Parser`` classes, built from the same flags as ``vllm serve``, see
:class:`serve_app._vllm.ParserKit`); the wire format and checks are vLLM 0.32's derender. What
differs, and why (``vllm-0.32-behaviour.md`` 1.13; README "Compatibility notes"):

* streaming keeps a live parser per stream in a replica-local :class:`SessionCache` keyed by the
  digest of the carried state: a hit parses only the new chunk; a miss replays the carried history
  chunk by chunk exactly as vLLM does, so every replica can still continue every stream;
* the answer follows ``vllm serve`` where vLLM's derender drifts from it: a stop token's text is
  not parsed into ``content`` (the rule of :mod:`serve_app.derender.stop`), ``finish_reason``
  becomes ``tool_calls`` in non-streaming too (and only from ``stop``), tool-call ids are the
  parser's (``chatcmpl-tool-...``) in both modes,
  ``include_reasoning: false`` also hides logprobs and token ids, ``parallel_tool_calls: false``
  applies in non-streaming, the request's ``prompt_token_ids`` reach the non-streaming parser,
  logprobs are kept (and size-checked) on the streaming path, and a usage-only chunk replays nothing.

Callers on an event loop (the ``ParserDerender`` replica, the Ingress's composed chat) use
``chat_async`` / ``chat_with_outcome_async``: the cheap part of a request (parsing, checks, the
session lookup) runs inline, and the heavy part, a non-streaming answer over a long output or a
stream chunk that misses the cache and replays a long carried history, in the derender worker
thread (:data:`~serve_app.derender.model.OFFLOAD_EXECUTOR`), so the other streams on the
loop keep turning. A cache hit never leaves the loop: its work is the new delta, less than the hop.
Two threads may thus parse at once, never with one session (a session is out of the cache while
in use); what they share is locked (the session and request caches) or read-only: vLLM's tokenizer
as the parsers use it (``get_vocab``, cached by vLLM; ``decode``, ``convert_tokens_to_ids``;
``encode`` in a few parsers, without truncation or padding, so transformers leaves the Rust
tokenizer's settings alone) and ours
(:class:`~serve_app.derender.tokenizer.DetokTokenizer`: lookups, Rust ``decode``, and a memo of
one-piece decodes whose entries both threads would write alike).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from serve_app.config import ParserSessionArgs
from serve_app.derender.checks import (
    check_bounds,
    check_prompt_ids,
    check_size,
    check_stream_chunk,
    check_stream_window,
    output_ids,
    output_work,
    stream_state_400,
)
from serve_app.derender.detokenize import detokenize_delta, seed_window
from serve_app.derender.logprobs import context_tail, resolve_logprobs
from serve_app.derender.model import OFFLOAD_WORK, DerenderModel, run_off_loop, stop_if_caller_gone
from serve_app.derender.responses import chat_chunk, chat_response, stream_state, stream_usage, usage
from serve_app.derender.sessions import SessionCache, prompt_key, state_digest
from serve_app.derender.stop import StopTokens
from serve_app.errors import ApiError, BadRequestError, InvalidChatRequest, invalid_request, validation_error
from serve_app.protocol import (
    DerenderChatRequestUnion,
    DerenderChatStreamRequest,
    DerenderStreamState,
    GenerateTokensStreamChoice,
    GenerateTokensStreamResponse,
)
from serve_app.wire import dump_json, dump_json_floatless, load_body, validate_model

__all__ = ["ChatStream", "ParserDerenderService", "ParserSession", "RequestConfig", "SessionOutcome"]

_CHAT = TypeAdapter(DerenderChatRequestUnion)
_STREAM_CHUNK = TypeAdapter(GenerateTokensStreamResponse)
_CONFIG_CACHE_SIZE = 1024
_MAX_REQUEST_BYTES: int = ParserSessionArgs.model_fields["max_request_bytes"].default
# The "choice index" under which a finished stream's session waits for its usage chunk: not an int,
# so that no chunk's own index (-1 is valid JSON, and vLLM echoes it) reaches another stream's session.
_FINISHED = None

# A whole request's choice on this path, in OFFLOAD_WORK's units: a fresh vLLM parser and its parse,
# ~0.4 ms (2,000 one-token choices: 0.79 s with qwen3 + hermes, against 22 ms without parsers).
_PARSER_CHOICE_WORK = 200
# What replaying one carried token costs (a parse_delta call per chunk, its decode, the parser's
# Python), in units of OFFLOAD_WORK's (a token decoded, ~2 us). Measured with qwen3 + hermes:
# ~12 us a token carried in one-token chunks, 4-5 us in chunks of 4-16 (vLLM's replay: 112 ms at
# 4000 tokens). So a miss replays in the worker thread from OFFLOAD_WORK // _REPLAY_COST = 512
# carried tokens (~5-10 ms of work) on; counted in tokens alone, a 4000-token replay would stay inline.
_REPLAY_COST = 8


@dataclass(frozen=True, slots=True)
class RequestConfig:
    """What a chat request decides for derender, validated once per distinct request (by content hash)."""

    key: bytes
    request: Any  # vLLM's ChatCompletionRequest, without its messages (ParserKit.without_messages)
    template_kwargs: dict[str, Any]
    named_tool_choice: bool
    required_tool_choice: bool
    include_reasoning: bool
    stops: StopTokens  # whose text a `stop` finish leaves out
    single_tool_call: bool  # parallel_tool_calls: false
    return_token_ids: bool
    role: str
    skip_special_tokens: bool  # after the parser's adjust_request, as the engine decodes
    top_logprobs: int  # entries kept per token (-1: all)
    echo: str  # with echo: the last message's text, put in front of the content
    size: int  # what it keeps, for the cache's bound in bytes: the request as JSON, and echo


SessionOutcome = Literal["hit", "miss", "new", "none"]
"""What the session cache did for a chunk: parsed only its delta (hit), replayed the carried history
(miss), opened a stream (new), or had no parsing to do (none)."""


class ParserSession:
    """One choice's live parser, the decode window in front of it, and the output it has parsed.

    The only writer of its state: ``feed`` decodes and parses a chunk and records its ids, so the
    session's ``output_ids`` / ``chunk_lens`` are always what the parser has seen. Of the prompt it
    keeps a digest (which stream it is) and the ids only until its parser has read them: vLLM's
    parsers settle their start state from the prompt on their first ``parse_delta`` and ignore it
    after.
    """

    __slots__ = ("kit", "tok", "config", "parser", "window", "prompt_key", "prompt_token_ids", "output_ids", "chunk_lens")

    def __init__(self, kit: Any, tok: Any, config: RequestConfig, prompt_token_ids: list[int]) -> None:
        self.kit, self.tok, self.config = kit, tok, config
        self.parser = kit.new_parser(config.request, config.template_kwargs)
        self.window = seed_window(tok, prompt_token_ids, config.skip_special_tokens)
        self.prompt_key = prompt_key(prompt_token_ids)
        self.prompt_token_ids: list[int] | None = prompt_token_ids  # until the parser has read it
        self.output_ids: list[int] = []
        self.chunk_lens: list[int] = []

    @classmethod
    def replay(cls, kit: Any, tok: Any, config: RequestConfig, prompt_ids: list[int], state: DerenderStreamState) -> ParserSession:
        """vLLM's replay: a fresh parser fed every carried chunk at its original boundaries."""
        session = cls(kit, tok, config, prompt_ids)
        ids, start = state.output_token_ids, 0
        for n in state.output_chunk_lens:
            part = ids[start : start + n]
            session.feed(part, False, part)
            start += n
        return session

    def matches(self, prompt: bytes, state: DerenderStreamState) -> bool:
        """Whether this session parsed exactly the carried output after the prompt whose
        :func:`~serve_app.derender.sessions.prompt_key` is ``prompt`` (a digest hit is confirmed here)."""
        return (
            self.output_ids == state.output_token_ids
            and self.chunk_lens == state.output_chunk_lens
            and self.prompt_key == prompt
        )

    @property
    def tokens(self) -> int:
        """The token ids the session holds, for the cache's token budget: its output (and the prompt,
        until the parser has read it)."""
        return len(self.output_ids) + len(self.prompt_token_ids or ())

    def feed(self, delta_ids: list[int], finished: bool, text_ids: Sequence[int]) -> Any:
        """Parse one chunk as ``parse_delta`` sees it under ``vllm serve``; returns a DeltaMessage or None.

        ``text_ids`` are the ids decoded into text: as the engine's detokenizer, a final stop token
        ends the stream without text (``StopTokens.text_ids``); the parser still gets its id.
        """
        config = self.config
        text, self.window = detokenize_delta(self.tok, text_ids, self.window, config.skip_special_tokens)
        if delta_ids:
            self.output_ids.extend(delta_ids)
            self.chunk_lens.append(len(delta_ids))
        elif not finished:
            return None
        message = self.parser.parse_delta(
            text, delta_ids, config.request, prompt_token_ids=self.prompt_token_ids, finished=finished
        )
        self.prompt_token_ids = None  # read: the parser's start state is settled
        return message

    def reasoning_tokens(self) -> int:
        return self.parser.count_reasoning_tokens(tuple(self.output_ids))


def _trim_top_logprobs(logprobs: dict[str, Any], keep: int) -> dict[str, Any]:
    """As ``vllm serve``: ``top_logprobs`` entries as the request asked (``/generate`` sends at least one)."""
    if keep >= 0:
        for entry in logprobs["content"] or ():
            del entry["top_logprobs"][keep:]
    return logprobs


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


class ParserDerenderService:
    """Chat derender through vLLM's parsers, with live parser sessions cached per replica.

    It looks sessions up and files them; each :class:`ChatStream` owns its chunk state and each
    :class:`ParserSession` its parser.
    """

    def __init__(
        self, model: DerenderModel, kit: Any, cache: SessionCache[ParserSession], max_request_bytes: int = _MAX_REQUEST_BYTES
    ) -> None:
        self.model = model
        self.kit = kit
        self.sessions = cache
        self._configs: OrderedDict[bytes, RequestConfig] = OrderedDict()  # LRU, bounded in entries and bytes
        self._config_bytes = 0
        # The loop thread and the worker thread both look configurations up and file them.
        self._configs_lock = threading.Lock()
        self.max_request_bytes = max_request_bytes

    # --- per-request configuration ---------------------------------------------------------------

    def request_config(self, chat_request: Any) -> RequestConfig:
        """Validate and derive once per distinct ``chat_request``; later chunks hit by content hash."""
        raw = chat_request if isinstance(chat_request, dict) else chat_request.model_dump()
        key = blake2b(json.dumps(raw, sort_keys=True, default=str).encode(), digest_size=16).digest()
        with self._configs_lock:
            config = self._configs.get(key)
            if config is not None:
                self._configs.move_to_end(key)
                return config
        # Built outside the lock: two threads that miss on one request at once build equal configurations.
        kit = self.kit
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
        config = RequestConfig(
            key=key,
            request=request,
            template_kwargs=template_kwargs,
            named_tool_choice=type(tool_choice) is kit.NamedToolChoice,
            required_tool_choice=tool_choice == "required",
            include_reasoning=bool(request.include_reasoning),
            stops=self.model.stop_tokens(request),
            single_tool_call=request.parallel_tool_calls is False,
            return_token_ids=bool(request.return_token_ids) and bool(request.include_reasoning),
            role=role,
            skip_special_tokens=bool(request.skip_special_tokens),
            top_logprobs=request.top_logprobs if request.top_logprobs is not None else 0,
            echo=echo,
            size=_json_size(request) + len(echo),
        )
        with self._configs_lock:
            old = self._configs.pop(key, None)
            if old is not None:  # filed meanwhile by the other thread
                self._config_bytes -= old.size
            self._configs[key] = config
            self._config_bytes += config.size
            while len(self._configs) > _CONFIG_CACHE_SIZE or self._config_bytes > self.max_request_bytes:
                self._config_bytes -= self._configs.popitem(last=False)[1].size
        return config

    @property
    def request_bytes(self) -> int:
        """What the cached request configurations keep, in bytes (bounded by ``max_request_bytes``)."""
        return self._config_bytes

    def new_session(self, config: RequestConfig, prompt_token_ids: list[int]) -> ParserSession:
        return ParserSession(self.kit, self.model.tok, config, prompt_token_ids)

    # --- non-streaming ---------------------------------------------------------------------------

    def chat(self, body: bytes | dict) -> bytes:
        return self.chat_with_outcome(body)[0]

    def chat_with_outcome(self, body: bytes | dict) -> tuple[bytes, SessionOutcome]:
        """The response bytes and the session-cache outcome."""
        data = load_body(body)
        check_size(data, self.model.limits)
        return self._chat_data(data)

    async def chat_async(self, body: bytes | dict) -> bytes:
        """:meth:`chat` for a caller on an event loop (see :meth:`chat_with_outcome_async`)."""
        return (await self.chat_with_outcome_async(body))[0]

    async def chat_with_outcome_async(self, body: bytes | dict) -> tuple[bytes, SessionOutcome]:
        """:meth:`chat_with_outcome` for a caller on an event loop: the same bytes, with the heavy part
        in the derender worker thread. That is a non-streaming request of ``OFFLOAD_WORK`` output
        tokens and logprob entries or more (everything after the size check, as plain derender), or
        a stream chunk whose session lookup missed and must replay a long carried history (the
        checks and the lookup run here first: a hit's delta parses inline, whatever the history)."""
        data = load_body(body)
        check_size(data, self.model.limits)
        if not (isinstance(data, dict) and data.get("stream") is True):
            gen = data.get("generate_response") if isinstance(data, dict) else None
            if output_work(gen, _PARSER_CHOICE_WORK) >= OFFLOAD_WORK:
                return await run_off_loop(self._chat_data, data)
            return self._chat_data(data)
        request = validate_model(_CHAT, data)
        if not isinstance(request, DerenderChatStreamRequest):  # not reached: stream is a Literal[True]
            return self._chat_data(data)
        with self._vllm_400(data):
            opened = self._open_chunk(request, data.get("chat_request"))
        work = opened.replay_tokens * _REPLAY_COST + output_work(data.get("generate_chunk"), _PARSER_CHOICE_WORK)
        if work >= OFFLOAD_WORK:
            chunk, state, outcome = await run_off_loop(self._answer_chunk, opened)
        else:
            chunk, state, outcome = self._answer_chunk(opened)
        return _chunk_bytes(chunk, state), outcome

    def _chat_data(self, data: Any) -> tuple[bytes, SessionOutcome]:
        """A parsed, size-checked body to the response bytes and the session-cache outcome."""
        request = validate_model(_CHAT, data)
        raw_chat_request = data.get("chat_request") if isinstance(data, dict) else None
        with self._vllm_400(data):
            return self._chat(request, raw_chat_request)

    @contextmanager
    def _vllm_400(self, data: Any) -> Iterator[None]:
        """A ``chat_request`` that fails vLLM's validation is answered with the 400 vLLM's derender gives."""
        try:
            yield
        except InvalidChatRequest as exc:
            validate_model(self.kit.derender_chat_adapter, data)  # raises vLLM's exact 400
            raise exc.error from None

    def _chat(self, request: Any, raw_chat_request: Any) -> tuple[bytes, SessionOutcome]:
        if isinstance(request, DerenderChatStreamRequest):
            chunk, state, outcome = self.chat_stream(request, raw_chat_request)
            return _chunk_bytes(chunk, state), outcome
        return self._chat_whole(request, raw_chat_request), "none"

    def _chat_whole(self, request: Any, raw_chat_request: Any) -> bytes:
        model = self.model.model_name(request.model)
        gen = request.generate_response
        check_bounds([gen], self.model.limits)
        check_prompt_ids(request.prompt_token_ids, self.model.limits)
        if request.chat_request is None:
            raise BadRequestError(_CHAT_REQUEST_REQUIRED)
        config = self.request_config(raw_chat_request if raw_chat_request is not None else request.chat_request)
        prompt_ids = request.prompt_token_ids if request.prompt_token_ids is not None else gen.prompt_token_ids
        choices, reasoning_tokens = [], 0
        for choice in gen.choices:
            out, reasoning = self._whole_choice(choice, config, prompt_ids or [])
            choices.append(out)
            reasoning_tokens += reasoning
        prompt_tokens = request.prompt_tokens if request.prompt_tokens is not None else 0
        completion_tokens = sum(len(c.token_ids) for c in gen.choices if c.token_ids)
        counts = usage(prompt_tokens, completion_tokens)
        if self.kit.has_reasoning_parser:  # as vllm serve
            counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return chat_response(gen, model, choices, counts)

    def _whole_choice(self, choice: Any, config: RequestConfig, prompt_ids: list[int]) -> tuple[dict[str, Any], int]:
        """One choice as ``vllm serve``'s ``chat_completion_full_generator`` builds it, and its
        reasoning-token count."""
        stop_if_caller_gone()
        kit, request = self.kit, config.request
        ids = output_ids(choice)
        text_ids = config.stops.text_ids(ids, choice.finish_reason, choice.stop_reason)
        skip = config.skip_special_tokens
        tok = self.model.tok
        text, _ = detokenize_delta(tok, text_ids, seed_window(tok, prompt_ids, skip), skip)
        parser = kit.new_parser(request, config.template_kwargs)
        if prompt_ids:
            parser.set_prompt_token_ids(prompt_ids)
        try:
            reasoning, content, calls = parser.parse(
                text, request, enable_auto_tools=kit.enable_auto_tools, model_output_token_ids=ids
            )
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
            logprobs = _trim_top_logprobs(resolve_logprobs(choice.logprobs, self.model.tok), config.top_logprobs)
        return {
            "index": choice.index,
            "message": message.model_dump(),
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": choice.stop_reason,
            "token_ids": ids if config.return_token_ids else None,
            "routed_experts": None,
        }, reasoning_tokens

    # --- streaming -------------------------------------------------------------------------------

    def chat_stream(
        self, request: DerenderChatStreamRequest, raw_chat_request: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any], SessionOutcome]:
        """One streaming chunk over HTTP: (chunk, stream_state, cache outcome)."""
        return self._answer_chunk(self._open_chunk(request, raw_chat_request))

    def _open_chunk(self, request: DerenderChatStreamRequest, raw_chat_request: Any) -> _OpenChunk:
        """A chunk's cheap part: its checks, its request configuration and its session lookup."""
        model = self.model.model_name(request.model)
        if request.chat_request is None:
            raise BadRequestError(_CHAT_REQUEST_REQUIRED)
        if request.prompt_token_ids is None:
            raise BadRequestError(
                "prompt_token_ids is required when a tool or reasoning parser is configured. Without it "
                "parse_delta cannot tell whether the prompt left reasoning open (e.g. a chat template that "
                "pre-opens <think>) and would misclassify reasoning content as plain content."
            )
        chunk = request.generate_chunk
        state = request.stream_state or DerenderStreamState()
        prompt_ids = request.prompt_token_ids
        check_stream_chunk(chunk, len(prompt_ids), len(state.output_token_ids), self.model.limits)
        if request.stream_state is not None:  # the window passes through this path; it must still add up
            check_stream_window(state, self.model.tok)
        config = self.request_config(raw_chat_request if raw_chat_request is not None else request.chat_request)
        if not chunk.choices:  # usage-only: no text to parse, nothing to replay ...
            session = None
            replay = False
            if chunk.usage is not None and self.kit.has_reasoning_parser and state.output_token_ids:
                # ... except vllm serve's reasoning-token count, which asks the stream's own parser.
                session = self._take(config, prompt_ids, state, (chunk.request_id, _FINISHED))
                replay = session is None
            return _OpenChunk(request, config, model, prompt_ids, state, session, replay, None, "none")
        # Which stream this is: n>1 choices (or two identical requests) can carry equal states.
        stream_key = (chunk.request_id, chunk.choices[0].index)
        outcome: SessionOutcome
        session = self._take(config, prompt_ids, state, stream_key)
        if session is not None:
            outcome = "hit"
            self.sessions.count_hit()
        else:
            outcome = "miss" if state.output_token_ids else "new"
            if outcome == "miss":
                self.sessions.count_miss(len(state.output_token_ids))
        return _OpenChunk(request, config, model, prompt_ids, state, session, session is None, stream_key, outcome)

    def _answer_chunk(self, opened: _OpenChunk) -> tuple[dict[str, Any], dict[str, Any], SessionOutcome]:
        """A chunk's parsing, after :meth:`_open_chunk`: the replay a miss needs (O(history)), the
        delta, and the session filed for the next chunk. Runs on one thread at a time per session:
        the session was taken out of the cache (or is new) and goes back only at the end."""
        o = opened
        session = self._replay(o.config, o.prompt_ids, o.state) if o.replay else o.session
        stream = ChatStream.resume(self, o.config, o.model, o.request.prompt_tokens, session, o.state)
        chunk = o.request.generate_chunk
        if o.stream_key is None:  # usage-only
            return stream.step(chunk), stream.state(), o.outcome
        assert session is not None
        with stream_state_400():  # a carried state the parser chokes on
            out_chunk, out_state = stream.step(chunk), stream.state()
        stream_key = o.stream_key
        if chunk.choices[0].finish_reason is not None:
            # A finished parser is never fed again; it is kept (apart from live streams) only for
            # the usage chunk that may follow.
            stream_key = (chunk.request_id, _FINISHED)
        self.sessions.put(stream.key(stream_key), session, session.tokens)
        return out_chunk, out_state, o.outcome

    def _take(
        self, config: RequestConfig, prompt_ids: list[int], state: DerenderStreamState, stream_key: tuple[str, int | None]
    ) -> ParserSession | None:
        prompt = prompt_key(prompt_ids)
        key = _digest(
            config, prompt, state.output_token_ids, state.output_chunk_lens, stream_key,
            state.role_sent, state.tools_streamed, state.last_tool_call_ids,
        )
        session = self.sessions.take(key)
        if session is not None and not session.matches(prompt, state):
            return None  # a digest collision: never feed another stream's parser
        return session

    def _replay(self, config: RequestConfig, prompt_ids: list[int], state: DerenderStreamState) -> ParserSession:
        with stream_state_400():  # a carried state the parser chokes on
            return ParserSession.replay(self.kit, self.model.tok, config, prompt_ids, state)

    def open_chat_stream(
        self, chat_request: dict[str, Any], prompt_token_ids: list[int], prompt_tokens: int | None = None, model: str | None = None
    ) -> ChatStream:
        """An in-process stream for one choice (the composed OpenAI path): the live parser is held by
        the returned object, so chunks are parsed once and no state makes a round trip."""
        config = self.request_config(chat_request)
        session = self.new_session(config, list(prompt_token_ids))
        return ChatStream.resume(self, config, self.model.model_name(model), prompt_tokens, session, DerenderStreamState())


@dataclass(slots=True)
class _OpenChunk:
    """A stream chunk after :meth:`ParserDerenderService._open_chunk`: checked, configured, looked up."""

    request: DerenderChatStreamRequest
    config: RequestConfig
    model: str
    prompt_ids: list[int]
    state: DerenderStreamState
    session: ParserSession | None  # a hit (or, usage-only, the finished stream's session)
    replay: bool  # no session: one is built from the carried history first (a miss, or a new stream)
    stream_key: tuple[str, int | None] | None  # None: a usage-only chunk, whose session is not filed again
    outcome: SessionOutcome

    @property
    def replay_tokens(self) -> int:
        """The carried output tokens a replay feeds through a fresh parser (its cost grows with them)."""
        return len(self.state.output_token_ids) if self.replay else 0


def _chunk_bytes(chunk: dict[str, Any], state: dict[str, Any]) -> bytes:
    # The state is the bulk of the bytes (every output id) and holds no floats.
    return b'{"chunk":' + dump_json(chunk) + b',"stream_state":' + dump_json_floatless(state) + b"}"


_CHAT_REQUEST_REQUIRED = (
    "chat_request is required when a tool or reasoning parser is configured because plain "
    "detokenization would leak raw parser markup into content."
)


def _digest(
    config: RequestConfig,
    prompt: bytes,
    output_ids: list[int],
    chunk_lens: list[int],
    stream_key: tuple[str, int | None],
    role_sent: bool,
    tools_streamed: bool,
    tool_call_ids: list[str],
) -> bytes:
    """The cache key of a stream's state: what the next chunk will carry (see ``sessions.state_digest``)."""
    return state_digest(
        config.key, prompt, output_ids, chunk_lens, (*stream_key, role_sent, tools_streamed, *tool_call_ids)
    )


class ChatStream:
    """One choice's chat stream: its parser session and what chat chunks carry between calls (role
    sent, tool calls streamed and their ids, the logprob context). The only writer of those fields."""

    __slots__ = ("kit", "tok", "config", "model", "prompt_tokens", "session", "carried",
                 "role_sent", "tools_streamed", "tool_call_ids", "context")

    def __init__(
        self, kit: Any, tok: Any, config: RequestConfig, model: str, prompt_tokens: int | None,
        session: ParserSession | None, carried: DerenderStreamState,
    ) -> None:
        self.kit, self.tok, self.config, self.model, self.prompt_tokens = kit, tok, config, model, prompt_tokens
        self.session = session
        self.carried = carried  # prev_tokens / offsets pass through: the parser path keeps its window itself
        self.role_sent = carried.role_sent
        self.tools_streamed = carried.tools_streamed
        self.tool_call_ids = list(carried.last_tool_call_ids)
        self.context = list(carried.logprob_context_token_ids)

    @classmethod
    def resume(
        cls, service: ParserDerenderService, config: RequestConfig, model: str, prompt_tokens: int | None,
        session: ParserSession | None, carried: DerenderStreamState,
    ) -> ChatStream:
        return cls(service.kit, service.model.tok, config, model, prompt_tokens, session, carried)

    def key(self, stream_key: tuple[str, int | None]) -> bytes:
        """The cache key the state this stream just returned will be looked up under."""
        assert self.session is not None
        s = self.session
        return _digest(
            self.config, s.prompt_key, s.output_ids, s.chunk_lens, stream_key,
            self.role_sent, self.tools_streamed, self.tool_call_ids,
        )

    def feed(self, generate_chunk: Any) -> dict[str, Any]:
        """The composed path: one engine chunk (a dict or model) in, the chat chunk dict out."""
        if isinstance(generate_chunk, dict):
            generate_chunk = _STREAM_CHUNK.validate_python(generate_chunk)
        return self.step(generate_chunk)

    def step(self, chunk: Any) -> dict[str, Any]:
        """One generate chunk in, its chat chunk out."""
        choices = [self._choice(choice) for choice in chunk.choices]
        return chat_chunk(chunk, self.model, choices, self._usage(chunk.usage))

    def state(self) -> dict[str, Any]:
        """The state the client carries to the next chunk (its lists copied: the session keeps growing its own)."""
        c, s = self.carried, self.session
        return stream_state(
            prev_tokens=c.prev_tokens,
            prefix_offset=c.prefix_offset,
            read_offset=c.read_offset,
            role_sent=self.role_sent,
            logprob_context_token_ids=self.context,
            logprob_text_offset=c.logprob_text_offset,
            output_token_ids=list(s.output_ids) if s is not None else c.output_token_ids,
            output_chunk_lens=list(s.chunk_lens) if s is not None else c.output_chunk_lens,
            tools_streamed=self.tools_streamed,
            last_tool_call_ids=list(self.tool_call_ids),
        )

    def _usage(self, chunk_usage: Any) -> dict[str, Any] | None:
        out = stream_usage(chunk_usage, self.prompt_tokens)
        if out is not None and self.kit.has_reasoning_parser:
            # As vllm serve: reasoning tokens of the output so far (this choice's: a stream carries one).
            count = self.session.reasoning_tokens() if self.session is not None else 0
            out["completion_tokens_details"] = {"reasoning_tokens": count}
        return out

    def _choice(self, choice: GenerateTokensStreamChoice) -> dict[str, Any]:
        config = self.config
        assert self.session is not None
        delta_ids = choice.token_ids or []
        text_ids = config.stops.text_ids(delta_ids, choice.finish_reason, choice.stop_reason)
        msg = self.session.feed(delta_ids, choice.finish_reason is not None, text_ids)
        if msg is None:
            msg = self.kit.DeltaMessage()
        if msg.tool_calls:
            self.tools_streamed = True
            for tc in msg.tool_calls:
                if tc.id is None:
                    continue
                if tc.index < len(self.tool_call_ids):
                    tc.id = self.tool_call_ids[tc.index]  # a replayed parser re-issues ids; keep the first
                else:
                    self.tool_call_ids.append(tc.id)
            if config.single_tool_call:
                msg.tool_calls = [tc for tc in msg.tool_calls if tc.index == 0]
        if not self.role_sent:
            msg.role = config.role
            self.role_sent = True
            if config.echo:
                msg.content = config.echo + (msg.content or "")
        finish = choice.finish_reason
        if finish == "stop" and self.tools_streamed and not config.named_tool_choice:
            finish = "tool_calls"
        logprobs = None
        if choice.logprobs is not None:  # vLLM drops them here (1.13 #8); the context only serves them
            if config.include_reasoning:
                logprobs = _trim_top_logprobs(resolve_logprobs(choice.logprobs, self.tok, self.context), config.top_logprobs)
            self.context = context_tail(self.context, delta_ids)
        return {
            "index": choice.index,
            "delta": msg.model_dump(),
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": choice.stop_reason,
            "token_ids": choice.token_ids if config.return_token_ids else None,
        }

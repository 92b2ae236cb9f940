"""Derender streams: one choice's chunks in, its response chunks out. Ray-free; vLLM only through a kit.

Every stream has the contract of httpx's decoders: it is opened from a request configuration
(:class:`~serve_app.derender.request.RequestConfig`), the prompt and, over HTTP, the state the
client carried; then ``feed(generate_chunk) -> chunk dict`` as often as chunks come, and
``state() -> carried dict`` for the client's next call. An HTTP chunk opens a stream, feeds it once
and answers ``(chunk, state())``; the composed ``/v1/*`` path opens one per choice and feeds it
every engine chunk, so nothing makes a round trip.

* :class:`PlainChatStream` / :class:`PlainCompletionStream`: detokenization only; each owns its
  decode window (O(1) state).
* :class:`ChatStream`: chat through vLLM's parsers; its :class:`ParserSession` owns the window and
  the live parser, which the parser service caches between HTTP chunks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from serve_app.derender.checks import check_choices, check_prompt_ids, check_stream_chunk, check_stream_window
from serve_app.derender.detokenize import DetokWindow, detokenize_delta, seed_window
from serve_app.derender.logprobs import context_tail, resolve_logprobs, to_completion_logprobs, trim_top_logprobs
from serve_app.derender.model import DerenderModel
from serve_app.derender.request import RequestConfig
from serve_app.derender.responses import (
    chat_chunk,
    chat_delta_choice,
    completion_chunk,
    completion_delta_choice,
    stream_state,
    stream_usage,
)
from serve_app.derender.sessions import prompt_key, state_digest
from serve_app.derender.tokenizer import DetokTokenizer
from serve_app.errors import BadRequestError
from serve_app.protocol import DerenderStreamState, GenerateTokensStreamChoice, GenerateTokensStreamResponse, UsageInfo

if TYPE_CHECKING:
    from serve_app._vllm import ParserKit

__all__ = ["ChatStream", "ParserSession", "PlainChatStream", "PlainCompletionStream", "PlainStream", "state_key"]

_STREAM_CHUNK = TypeAdapter(GenerateTokensStreamResponse)


def _chunk_model(generate_chunk: dict[str, Any] | GenerateTokensStreamResponse) -> GenerateTokensStreamResponse:
    """A generate chunk as the engine's dict (the composed path) or already validated (HTTP)."""
    if isinstance(generate_chunk, dict):
        return _STREAM_CHUNK.validate_python(generate_chunk)
    return generate_chunk


# --- plain: detokenization only ------------------------------------------------------------------


class PlainStream:
    """A plain stream: its decode window and the carried fields, typed, between chunks.

    ``step`` takes a validated chunk (HTTP: the request's); ``feed`` a dict or a model.
    """

    __slots__ = ("model", "config", "name", "prompt_tokens", "prompt_len", "window", "carried", "_window_unchecked",
                 "role_sent", "context", "text_offset")

    def __init__(
        self, model: DerenderModel, config: RequestConfig, name: str, prompt_tokens: int | None, prompt_len: int,
        window: DetokWindow, carried: DerenderStreamState, window_unchecked: bool,
    ) -> None:
        self.model, self.config, self.name, self.prompt_tokens = model, config, name, prompt_tokens
        self.prompt_len = prompt_len  # the request's prompt_token_ids, for the chunk bound
        self.window = window
        self.carried = carried  # the fields this path passes through (output ids, tool-call flags)
        self._window_unchecked = window_unchecked
        self.role_sent = carried.role_sent
        self.context = carried.logprob_context_token_ids
        self.text_offset = carried.logprob_text_offset

    @classmethod
    def open(
        cls, model: DerenderModel, config: RequestConfig, prompt_token_ids: list[int] | None,
        state: DerenderStreamState | None = None, *, name: str, prompt_tokens: int | None = None,
        seed_ids: list[int] | None = None,
    ) -> PlainStream:
        """A stream after ``state`` (a carried window), or a fresh one whose window is seeded from the
        prompt (``seed_ids``, a chunk's own prompt ids, when the request sent none)."""
        prompt_len = len(prompt_token_ids) if prompt_token_ids is not None else 0
        if state is not None:
            # Checked with the first chunk, after the chunk's own checks (vLLM's order).
            window = DetokWindow(list(state.prev_tokens), state.prefix_offset, state.read_offset)
            return cls(model, config, name, prompt_tokens, prompt_len, window, state, True)
        ids = prompt_token_ids if prompt_token_ids is not None else seed_ids
        window = seed_window(model.tok, ids, config.skip_special_tokens)
        return cls(model, config, name, prompt_tokens, prompt_len, window, DerenderStreamState(), False)

    def feed(self, generate_chunk: dict[str, Any] | GenerateTokensStreamResponse) -> dict[str, Any]:
        """One generate chunk (a dict or model) in, its response chunk out."""
        return self.step(_chunk_model(generate_chunk))

    def step(self, chunk: GenerateTokensStreamResponse) -> dict[str, Any]:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """The state the client carries to the next chunk: the new window, the rest passed through."""
        w, c = self.window, self.carried
        return stream_state(
            prev_tokens=w.prev_tokens,
            prefix_offset=w.prefix_offset,
            read_offset=w.read_offset,
            role_sent=self.role_sent,
            logprob_context_token_ids=self.context,
            logprob_text_offset=self.text_offset,
            output_token_ids=c.output_token_ids,
            output_chunk_lens=c.output_chunk_lens,
            tools_streamed=c.tools_streamed,
            last_tool_call_ids=c.last_tool_call_ids,
        )

    def _check_window(self) -> None:
        if self._window_unchecked:
            check_stream_window(self.carried, self.model.tok)
            self._window_unchecked = False

    def _decode(self, choice: GenerateTokensStreamChoice, delta_ids: list[int]) -> str:
        """A choice's new text (its stop token left out); moves the window on."""
        config = self.config
        text_ids = config.stops.text_ids(delta_ids, choice.finish_reason, choice.stop_reason)
        text, self.window = detokenize_delta(self.model.tok, text_ids, self.window, config.skip_special_tokens)
        return text


class PlainChatStream(PlainStream):
    __slots__ = ()

    def step(self, chunk: GenerateTokensStreamResponse) -> dict[str, Any]:
        model = self.model
        check_stream_chunk(chunk, self.prompt_len, len(self.carried.output_token_ids), model.limits)
        self._check_window()
        return_token_ids = self.config.return_token_ids
        choices = []
        for choice in chunk.choices:
            delta_ids = choice.token_ids or []
            text = self._decode(choice, delta_ids)
            logprobs = resolve_logprobs(choice.logprobs, model.tok, self.context) if choice.logprobs is not None else None
            delta = {"role": None if self.role_sent else "assistant", "content": text or None, "reasoning": None}
            self.role_sent, self.context = True, context_tail(self.context, delta_ids)
            token_ids = choice.token_ids if return_token_ids else None
            choices.append(chat_delta_choice(choice.index, delta, logprobs, choice.finish_reason, choice.stop_reason, token_ids))
        return chat_chunk(chunk, self.name, choices, stream_usage(chunk.usage, self.prompt_tokens))


class PlainCompletionStream(PlainStream):
    __slots__ = ()

    @classmethod
    def open(
        cls, model: DerenderModel, config: RequestConfig, prompt_token_ids: list[int] | None,
        state: DerenderStreamState | None = None, *, name: str, prompt_tokens: int | None = None,
        seed_ids: list[int] | None = None,
    ) -> PlainStream:
        check_prompt_ids(prompt_token_ids, model.limits)
        return super().open(model, config, prompt_token_ids, state, name=name, prompt_tokens=prompt_tokens, seed_ids=seed_ids)

    def step(self, chunk: GenerateTokensStreamResponse) -> dict[str, Any]:
        model = self.model
        if len(chunk.choices) > 1:
            raise BadRequestError("derender_completion_stream expects at most one choice per chunk")
        check_choices(chunk.choices, model.limits)
        self._check_window()
        choices = []
        for choice in chunk.choices:
            delta_ids = choice.token_ids or []
            text = self._decode(choice, delta_ids)
            logprobs = None
            if choice.logprobs is not None:
                logprobs = to_completion_logprobs(resolve_logprobs(choice.logprobs, model.tok, self.context), self.text_offset)
            self.context = context_tail(self.context, delta_ids)
            self.text_offset += len(text)
            choices.append(completion_delta_choice(choice.index, text, logprobs, choice.finish_reason, choice.stop_reason))
        return completion_chunk(chunk, self.name, choices, stream_usage(chunk.usage, self.prompt_tokens))


# --- chat through vLLM's parsers -------------------------------------------------------------------


class ParserSession:
    """One choice's live parser, the decode window in front of it, and the output it has parsed.

    The only writer of its state: ``feed`` decodes and parses a chunk and records its ids, so the
    session's ``output_ids`` / ``chunk_lens`` are always what the parser has seen. Of the prompt it
    keeps a digest (which stream it is) and the ids only until its parser has read them: vLLM's
    parsers settle their start state from the prompt on their first ``parse_delta`` and ignore it
    after.
    """

    __slots__ = ("kit", "tok", "config", "parser", "window", "prompt_key", "prompt_token_ids", "output_ids", "chunk_lens")

    def __init__(self, kit: ParserKit, tok: DetokTokenizer, config: RequestConfig, prompt_token_ids: list[int]) -> None:
        self.kit, self.tok, self.config = kit, tok, config
        self.parser = kit.new_parser(config.request, config.template_kwargs)
        self.window = seed_window(tok, prompt_token_ids, config.skip_special_tokens)
        self.prompt_key = prompt_key(prompt_token_ids)
        self.prompt_token_ids: list[int] | None = prompt_token_ids  # until the parser has read it
        self.output_ids: list[int] = []
        self.chunk_lens: list[int] = []

    @classmethod
    def replay(
        cls, kit: ParserKit, tok: DetokTokenizer, config: RequestConfig, prompt_ids: list[int], state: DerenderStreamState
    ) -> ParserSession:
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


def state_key(config: RequestConfig, prompt: bytes, stream_key: tuple[str, int | None], state: Mapping[str, Any]) -> bytes:
    """The session-cache key of a stream state, read from the state itself: a chunk files its session
    under the state it returns (:meth:`ChatStream.state`), the next looks it up under the state it
    carries (``dict(DerenderStreamState)``, no copy), so the two keys agree by construction
    (see ``sessions.state_digest``)."""
    flags = (*stream_key, state["role_sent"], state["tools_streamed"], *state["last_tool_call_ids"])
    return state_digest(config.key, prompt, state["output_token_ids"], state["output_chunk_lens"], flags)


class ChatStream:
    """One choice's chat stream: its parser session and what chat chunks carry between calls (role
    sent, tool calls streamed and their ids, the logprob context). The only writer of those fields."""

    __slots__ = ("kit", "tok", "config", "model", "prompt_tokens", "session", "carried",
                 "role_sent", "tools_streamed", "tool_call_ids", "context")

    def __init__(
        self, kit: ParserKit, tok: DetokTokenizer, config: RequestConfig, model: str, prompt_tokens: int | None,
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
    def open(
        cls, kit: ParserKit, tok: DetokTokenizer, config: RequestConfig, prompt_token_ids: list[int], *, name: str,
        prompt_tokens: int | None = None,
    ) -> ChatStream:
        """A fresh stream with a new parser session (the composed path). Over HTTP the parser service
        builds the stream around the session it found, or replayed, for the carried state."""
        return cls(kit, tok, config, name, prompt_tokens, ParserSession(kit, tok, config, prompt_token_ids), DerenderStreamState())

    def feed(self, generate_chunk: dict[str, Any] | GenerateTokensStreamResponse) -> dict[str, Any]:
        """One generate chunk (a dict or model) in, its chat chunk out."""
        return self.step(_chunk_model(generate_chunk))

    def step(self, chunk: GenerateTokensStreamResponse) -> dict[str, Any]:
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

    def _usage(self, chunk_usage: UsageInfo | None) -> dict[str, Any] | None:
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
                logprobs = trim_top_logprobs(resolve_logprobs(choice.logprobs, self.tok, self.context), config.top_logprobs)
            self.context = context_tail(self.context, delta_ids)
        token_ids = choice.token_ids if config.return_token_ids else None
        return chat_delta_choice(choice.index, msg.model_dump(), logprobs, finish, choice.stop_reason, token_ids)

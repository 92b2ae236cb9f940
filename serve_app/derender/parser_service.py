"""Parser derender: token ids -> reasoning / content / tool calls with vLLM's own parsers. Ray-free.

The split is vLLM's (its ``Parser`` classes, built from the same flags as ``vllm serve``, see
:class:`serve_app._vllm.ParserKit`); the wire format and checks are vLLM 0.32's derender. What
differs, and why (``vllm-0.32-behaviour.md`` 1.13; README "Compatibility notes"):

* streaming keeps a live parser per stream (a :class:`~serve_app.derender.streams.ParserSession`)
  in a replica-local :class:`SessionCache` keyed by the digest of the carried state: a hit parses
  only the new chunk; a miss replays the carried history chunk by chunk exactly as vLLM does, so
  every replica can still continue every stream;
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

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import TypeAdapter

from serve_app.config import AppArgs, ParserSessionArgs, ResolvedModel
from serve_app.derender.checks import (
    check_bounds,
    check_prompt_ids,
    check_size,
    check_stream_chunk,
    check_stream_window,
    output_work,
    stream_state_400,
    validate_in_slices,
)
from serve_app.derender.model import OFFLOAD_WORK, DerenderModel, is_big_body, run_inline, run_off_loop, run_sync
from serve_app.derender.request import RequestConfig, RequestConfigs, parser_config
from serve_app.derender.sessions import SessionCache, prompt_key
from serve_app.derender.streams import ChatStream, ParserSession, state_key
from serve_app.derender.whole import parser_chat
from serve_app.errors import BadRequestError, InvalidChatRequest
from serve_app.protocol import DerenderChatRequestUnion, DerenderChatStreamRequest, DerenderStreamState
from serve_app.wire import dump_json, dump_json_floatless, load_body, validate_model

if TYPE_CHECKING:
    from serve_app._vllm import ParserKit, RenderState

__all__ = ["ParserDerenderService", "SessionOutcome"]

_CHAT = TypeAdapter(DerenderChatRequestUnion)
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

SessionOutcome = Literal["hit", "miss", "new", "none"]
"""What the session cache did for a chunk: parsed only its delta (hit), replayed the carried history
(miss), opened a stream (new), or had no parsing to do (none)."""


class ParserDerenderService:
    """Chat derender through vLLM's parsers, with live parser sessions cached per replica.

    It checks a request and dispatches it: a whole one to a parse per choice, a stream chunk to the
    :class:`~serve_app.derender.streams.ChatStream` around the session it looked up (or replayed),
    which it files again after the chunk.
    """

    def __init__(
        self, model: DerenderModel, kit: ParserKit, cache: SessionCache[ParserSession], max_request_bytes: int = _MAX_REQUEST_BYTES
    ) -> None:
        self.model = model
        self.kit = kit
        self.sessions = cache
        self.configs = RequestConfigs(lambda raw, key: parser_config(kit, model, raw, key), max_request_bytes)
        self.max_request_bytes = max_request_bytes

    @classmethod
    async def create(cls, args: AppArgs, model: ResolvedModel, render_state: RenderState | None = None) -> ParserDerenderService:
        """From the app's ``AppArgs`` and ``ResolvedModel``; ``render_state``: vLLM's render objects
        already built in this process (a colocated Render's), which the parsers then share."""
        from serve_app._vllm import build_parser_kit

        kit = await build_parser_kit(args, model, render_state)
        c = args.parser_sessions
        sessions = SessionCache[ParserSession](c.max_sessions, c.ttl_s, c.max_tokens)
        return cls(DerenderModel.from_config(args, model), kit, sessions, c.max_request_bytes)

    def request_config(self, chat_request: Any) -> RequestConfig:
        """Validate and derive once per distinct ``chat_request``; later chunks hit by content hash."""
        return self.configs.get(chat_request)

    @property
    def request_bytes(self) -> int:
        """What the cached request configurations keep, in bytes (bounded by ``max_request_bytes``)."""
        return self.configs.bytes

    # --- the one dispatcher ----------------------------------------------------------------------

    def chat(self, body: bytes | dict) -> bytes:
        return self.chat_with_outcome(body)[0]

    def chat_with_outcome(self, body: bytes | dict) -> tuple[bytes, SessionOutcome]:
        """The response bytes and the session-cache outcome, all on the calling thread."""
        return run_sync(self._dispatch(body, run_inline))

    async def chat_async(self, body: bytes | dict) -> bytes:
        """:meth:`chat` for a caller on an event loop (see :meth:`chat_with_outcome_async`)."""
        return (await self.chat_with_outcome_async(body))[0]

    async def chat_with_outcome_async(self, body: bytes | dict) -> tuple[bytes, SessionOutcome]:
        """:meth:`chat_with_outcome` for a caller on an event loop: the same bytes, with the heavy part
        in the derender worker thread (see :meth:`_dispatch`)."""
        return await self._dispatch(body, run_off_loop)

    async def _dispatch(self, body: bytes | dict, run: Callable[..., Awaitable[Any]]) -> tuple[bytes, SessionOutcome]:
        """Every chat request's way through the service; ``run(work, *args)`` runs its heavy part:
        :func:`~serve_app.derender.model.run_off_loop` or, for a synchronous caller, inline.

        Heavy is a non-streaming request of ``OFFLOAD_WORK`` output tokens and logprob entries or
        more (everything after the size check, as plain derender), or a stream chunk whose session
        lookup missed and must replay a long carried history (the checks and the lookup run first,
        here: a hit's delta parses inline, whatever the history).
        """
        data = await run(self._sized, body) if is_big_body(body) else self._sized(body)
        if not (isinstance(data, dict) and data.get("stream") is True):
            gen = data.get("generate_response") if isinstance(data, dict) else None
            if output_work(gen, _PARSER_CHOICE_WORK) >= OFFLOAD_WORK:
                return await run(self._chat_data, data)
            return self._chat_data(data)
        opened = self._open_hit(data)  # most chunks: a live stream's, its carried lists not validated again
        if opened is None:
            request = validate_model(_CHAT, data)
            if not isinstance(request, DerenderChatStreamRequest):  # not reached: stream is a Literal[True]
                return self._chat_data(data)
            with self._vllm_400(data):
                opened = self._open_chunk(request, data.get("chat_request"))
        work = opened.replay_tokens * _REPLAY_COST + output_work(data.get("generate_chunk"), _PARSER_CHOICE_WORK)
        if work >= OFFLOAD_WORK:
            chunk, state, outcome = await run(self._answer_chunk, opened)
        else:
            chunk, state, outcome = self._answer_chunk(opened)
        return _chunk_bytes(chunk, state), outcome

    def _sized(self, body: bytes | dict) -> Any:
        """The parsed body, bounded as a whole."""
        data = load_body(body)
        check_size(data, self.model.limits)
        if is_big_body(body):  # our own parse: safe to fill in place
            validate_in_slices(data)
        return data

    def _chat_data(self, data: Any) -> tuple[bytes, SessionOutcome]:
        """A parsed, size-checked body (not a stream chunk, as the dispatcher sorts them) to its answer."""
        request = validate_model(_CHAT, data)
        raw_chat_request = data.get("chat_request") if isinstance(data, dict) else None
        with self._vllm_400(data):
            if isinstance(request, DerenderChatStreamRequest):
                chunk, state, outcome = self._answer_chunk(self._open_chunk(request, raw_chat_request))
                return _chunk_bytes(chunk, state), outcome
            return self._chat_whole(request, raw_chat_request), "none"

    @contextmanager
    def _vllm_400(self, data: Any) -> Iterator[None]:
        """A ``chat_request`` that fails vLLM's validation is answered with the 400 vLLM's derender gives."""
        try:
            yield
        except InvalidChatRequest as exc:
            validate_model(self.kit.derender_chat_adapter, data)  # raises vLLM's exact 400
            raise exc.error from None

    # --- non-streaming ---------------------------------------------------------------------------

    def _chat_whole(self, request: Any, raw_chat_request: Any) -> bytes:
        name = self.model.model_name(request.model)
        check_bounds([request.generate_response], self.model.limits)
        check_prompt_ids(request.prompt_token_ids, self.model.limits)
        if request.chat_request is None:
            raise BadRequestError(_CHAT_REQUEST_REQUIRED)
        config = self.request_config(raw_chat_request if raw_chat_request is not None else request.chat_request)
        return parser_chat(self.kit, self.model, config, name, request)

    # --- streaming -------------------------------------------------------------------------------

    def _open_chunk(self, request: DerenderChatStreamRequest, raw_chat_request: Any) -> _OpenChunk:
        """A chunk's cheap part: its checks, its request configuration and its session lookup."""
        model, config, prompt_ids, state = self._checked_chunk(request, raw_chat_request)
        chunk = request.generate_chunk
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

    def _checked_chunk(
        self, request: DerenderChatStreamRequest, raw_chat_request: Any
    ) -> tuple[str, RequestConfig, list[int], DerenderStreamState]:
        """A chunk's checks, in vLLM's order; its model name, request configuration, prompt and carried state."""
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
        return model, config, prompt_ids, state

    def _open_hit(self, data: dict[str, Any]) -> _OpenChunk | None:
        """A stream chunk whose live session is here, opened without validating the carried output
        lists, the O(history) part of a chunk's validation, or the prompt's ids (most of the rest);
        ``None`` for any other chunk.

        On a hit the output lists equal, item for item, the lists of the session that parsed them,
        which hold only valid ids and chunk lengths adding up, so their validation could only pass (and
        would only turn equal floats or bools into those ints, which a hit never reads: it continues
        from the session's lists). The prompt's ids are the session's too: their digest
        (:func:`~serve_app.derender.sessions.prompt_key`, which takes only ints in ``TokenId``'s range)
        is the session's, and a hit reads no more of them than their count. Everything else is
        validated and checked as in :meth:`_open_chunk`.
        Nothing is answered or changed here unless it is a hit: a miss, a new stream or a request
        that fails anything takes the full path, which answers (and words every 400) as ever.
        """
        carried = data.get("stream_state")
        if not isinstance(carried, dict):
            return None
        ids, lens, prompt_ids = carried.get("output_token_ids"), carried.get("output_chunk_lens"), data.get("prompt_token_ids")
        if not (isinstance(ids, list) and isinstance(lens, list) and ids and isinstance(prompt_ids, list)):
            return None
        unlisted = {**data, "prompt_token_ids": [], "stream_state": {**carried, "output_token_ids": [], "output_chunk_lens": []}}
        try:
            request = _CHAT.validate_python(unlisted, from_attributes=True)
            if not isinstance(request, DerenderChatStreamRequest) or request.stream_state is None or not request.generate_chunk.choices:
                return None
            request.stream_state.output_token_ids, request.stream_state.output_chunk_lens = ids, lens
            request.prompt_token_ids = prompt_ids
            prompt = prompt_key(prompt_ids)  # raises for anything but ids in TokenId's range
            model, config, prompt_ids, state = self._checked_chunk(request, data.get("chat_request"))
        except Exception:  # its answer is the full path's
            return None
        chunk = request.generate_chunk
        stream_key = (chunk.request_id, chunk.choices[0].index)
        key = state_key(config, prompt, stream_key, dict(state))
        # Looked at first and taken only if it is this stream's: anything else is the full path's to find.
        peeked = self.sessions.peek(key)
        if peeked is None or not peeked.matches(prompt, state):
            return None
        session = self.sessions.take(key)
        if session is not peeked and (session is None or not session.matches(prompt, state)):
            return None  # another thread took it meanwhile: the full path misses, as it would have
        self.sessions.count_hit()
        return _OpenChunk(request, config, model, prompt_ids, state, session, False, stream_key, "hit")

    def _answer_chunk(self, opened: _OpenChunk) -> tuple[dict[str, Any], dict[str, Any], SessionOutcome]:
        """A chunk's parsing, after :meth:`_open_chunk`: the replay a miss needs (O(history)), the
        delta, and the session filed for the next chunk. Runs on one thread at a time per session:
        the session was taken out of the cache (or is new) and goes back only at the end."""
        o = opened
        session = self._replay(o.config, o.prompt_ids, o.state) if o.replay else o.session
        stream = ChatStream(self.kit, self.model.tok, o.config, o.model, o.request.prompt_tokens, session, o.state)
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
        self.sessions.put(state_key(o.config, session.prompt_key, stream_key, out_state), session, session.tokens)
        return out_chunk, out_state, o.outcome

    def _take(
        self, config: RequestConfig, prompt_ids: list[int], state: DerenderStreamState, stream_key: tuple[str, int | None]
    ) -> ParserSession | None:
        prompt = prompt_key(prompt_ids)
        session = self.sessions.take(state_key(config, prompt, stream_key, dict(state)))
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
        name = self.model.model_name(model)
        return ChatStream.open(self.kit, self.model.tok, config, list(prompt_token_ids), name=name, prompt_tokens=prompt_tokens)


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


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
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from serve_app.derender.checks import check_bounds, check_prompt_ids, check_size, stream_state_400, validate_in_slices
from serve_app.derender.model import OFFLOAD_WORK, DerenderModel, is_big_body, run_off_loop
from serve_app.derender.request import RequestConfig
from serve_app.derender.streams import PlainChatStream, PlainCompletionStream, PlainStream
from serve_app.derender.whole import plain_chat, plain_completion
from serve_app.errors import BadRequestError
from serve_app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DerenderChatRequestUnion,
    DerenderChatStreamRequest,
    DerenderCompletionRequestUnion,
    DerenderCompletionStreamRequest,
)
from serve_app.wire import dump_json, load_body, validate_model

if TYPE_CHECKING:
    from serve_app.config import AppArgs, ResolvedModel

__all__ = ["PlainDerenderService"]

_CHAT = TypeAdapter(DerenderChatRequestUnion)
_COMPLETION = TypeAdapter(DerenderCompletionRequestUnion)


async def _decode_async(decode: Callable[[Any], bytes], sized: Callable[[Any], tuple[Any, int]], body: Any) -> bytes:
    """``decode(sized(body)[0])`` for a caller on an event loop: all of it in the worker thread for a
    big raw body, else the decoding only, when the parsed request is big."""
    if is_big_body(body):
        return await run_off_loop(lambda: decode(sized(body)[0]))
    return await _off_loop_if_big(decode, *sized(body))


async def _off_loop_if_big(decode: Callable[[Any], bytes], data: Any, work: int) -> bytes:
    if work < OFFLOAD_WORK:
        return decode(data)
    return await run_off_loop(decode, data)


class PlainDerenderService:
    """Detokenization-only derender for one model: it checks a request and dispatches it, a whole
    one to :mod:`~serve_app.derender.whole`, a stream chunk to a :class:`~serve_app.derender.streams.PlainStream`."""

    def __init__(self, model: DerenderModel) -> None:
        self.model = model
        self.tok = model.tok

    @classmethod
    def create(cls, args: AppArgs, model: ResolvedModel) -> PlainDerenderService:
        """From the app's ``AppArgs`` and ``ResolvedModel`` (loads the tokenizer: ``tokenizers`` only)."""
        return cls(DerenderModel.from_config(args, model))

    # --- in-process streams (the composed OpenAI path) ---------------------------------------

    def open_chat_stream(
        self, chat_request: dict[str, Any], prompt_token_ids: list[int], prompt_tokens: int | None = None, model: str | None = None
    ) -> PlainStream:
        """One choice's chat stream held in memory: ``feed(generate_chunk)`` -> the chat chunk dict."""
        config = RequestConfig.plain(self.model, ChatCompletionRequest.model_validate(chat_request))
        name = self.model.model_name(model)
        return PlainChatStream.open(self.model, config, prompt_token_ids, name=name, prompt_tokens=prompt_tokens)

    def open_completion_stream(
        self, completion_request: dict[str, Any], prompt_token_ids: list[int], prompt_tokens: int | None = None, model: str | None = None
    ) -> PlainStream:
        """One choice's completions stream held in memory: ``feed(generate_chunk)`` -> the chunk dict."""
        config = RequestConfig.plain(self.model, CompletionRequest.model_validate(completion_request))
        name = self.model.model_name(model)
        return PlainCompletionStream.open(self.model, config, prompt_token_ids, name=name, prompt_tokens=prompt_tokens)

    # --- endpoints -----------------------------------------------------------------------------

    def _sized(self, body: bytes | dict) -> tuple[Any, int]:
        """The parsed body, bounded as a whole, and its work (token ids plus logprob entries)."""
        data = load_body(body)
        work = check_size(data, self.model.limits)
        if is_big_body(body):  # our own parse: safe to fill in place
            validate_in_slices(data)
        return data, work

    def chat(self, body: bytes | dict) -> bytes:
        return self._chat(self._sized(body)[0])

    async def chat_async(self, body: bytes | dict) -> bytes:
        """:meth:`chat` for a caller on an event loop: a big request decodes in a worker thread."""
        return await _decode_async(self._chat, self._sized, body)

    def _chat(self, data: Any) -> bytes:
        request = validate_model(_CHAT, data)
        if isinstance(request, DerenderChatStreamRequest):
            with stream_state_400():  # as vLLM: whatever breaks on a carried state is the caller's 400
                return self._chat_chunk(request)
        name = self.model.model_name(request.model)
        check_bounds([request.generate_response], self.model.limits)
        check_prompt_ids(request.prompt_token_ids, self.model.limits)
        return plain_chat(self.model, RequestConfig.plain(self.model, request.chat_request), name, request)

    def _chat_chunk(self, request: DerenderChatStreamRequest) -> bytes:
        """One HTTP chunk: open the stream from the carried state, feed the chunk, answer its state."""
        name = self.model.model_name(request.model)
        chunk = request.generate_chunk
        stream = PlainChatStream.open(
            self.model, RequestConfig.plain(self.model, request.chat_request), request.prompt_token_ids,
            request.stream_state, name=name, prompt_tokens=request.prompt_tokens, seed_ids=chunk.prompt_token_ids,
        )
        return dump_json({"chunk": stream.step(chunk), "stream_state": stream.state()})

    def completion(self, body: bytes | dict) -> bytes:
        return self._completion(self._sized(body)[0])

    async def completion_async(self, body: bytes | dict) -> bytes:
        """:meth:`completion` for a caller on an event loop: a big request decodes in a worker thread."""
        return await _decode_async(self._completion, self._sized, body)

    def _completion(self, data: Any) -> bytes:
        request = validate_model(_COMPLETION, data)
        if isinstance(request, DerenderCompletionStreamRequest):
            with stream_state_400("detokenization", (KeyError, IndexError), detail=True):  # vLLM's words here
                return self._completion_chunk(request)
        name = self.model.model_name(request.model)
        if not request.generate_responses:
            raise BadRequestError("generate_responses must not be empty")
        check_bounds(request.generate_responses, self.model.limits)
        for ids in request.prompt_token_ids or []:
            check_prompt_ids(ids, self.model.limits)
        return plain_completion(self.model, RequestConfig.plain(self.model, request.completion_request), name, request)

    def _completion_chunk(self, request: DerenderCompletionStreamRequest) -> bytes:
        """One HTTP chunk: open the stream from the carried state, feed the chunk, answer its state."""
        name = self.model.model_name(request.model)
        chunk = request.generate_chunk
        stream = PlainCompletionStream.open(
            self.model, RequestConfig.plain(self.model, request.completion_request), request.prompt_token_ids,
            request.stream_state, name=name, prompt_tokens=request.prompt_tokens, seed_ids=chunk.prompt_token_ids,
        )
        return dump_json({"chunk": stream.step(chunk), "stream_state": stream.state()})

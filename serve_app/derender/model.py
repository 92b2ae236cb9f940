"""What a derender service knows of its model, and where its heavy work runs. Ray-free, vLLM-free.

:class:`DerenderModel` is one model as derender sees it: its tokenizer, served names, EOS ids and
the bounds a request is checked against (:class:`DerenderLimits`, whose defaults are
``serve_app.config.RequestLimits``'s). :func:`run_off_loop` runs a whole request's decoding (or a
parser's replay) in the one derender worker thread, so the event loop it was called from (other
requests, ``/health``) keeps turning.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from serve_app.config import AppArgs, RequestLimits, ResolvedModel
from serve_app.derender.stop import StopTokens
from serve_app.derender.tokenizer import DetokTokenizer
from serve_app.errors import NotFoundError

__all__ = [
    "OFFLOAD_BODY_BYTES",
    "OFFLOAD_EXECUTOR",
    "OFFLOAD_WORK",
    "DerenderLimits",
    "DerenderModel",
    "run_inline",
    "is_big_body",
    "run_off_loop",
    "run_sync",
    "stop_if_caller_gone",
]

_T = TypeVar("_T")

_DEFAULT = RequestLimits.model_fields  # one source for the per-request bounds' defaults


@dataclass(frozen=True, slots=True)
class DerenderLimits:
    max_model_len: int
    max_logprobs: int
    max_n_sequences: int
    # Per request, all responses and choices together (serve_app.config.RequestLimits.max_derender_*).
    max_choices: int = _DEFAULT["max_derender_choices"].default
    max_tokens: int = _DEFAULT["max_derender_tokens"].default
    max_logprob_entries: int = _DEFAULT["max_derender_logprobs"].default


@dataclass(frozen=True, slots=True)
class DerenderModel:
    """One model as derender sees it."""

    tok: DetokTokenizer
    served_model_names: list[str]
    limits: DerenderLimits
    eos_token_ids: list[int]

    @classmethod
    def from_config(cls, args: AppArgs, model: ResolvedModel) -> DerenderModel:
        """From the app's ``AppArgs`` and ``ResolvedModel``: loads the tokenizer (``tokenizers`` only)."""
        model = model.on_this_node()  # the builder may have run on another node
        tok = DetokTokenizer(model.tokenizer_dir, model.special_token_ids)
        bounds = args.limits
        limits = DerenderLimits(
            model.max_model_len,
            args.max_logprobs,
            bounds.max_n_sequences,
            bounds.max_derender_choices,
            bounds.max_derender_tokens,
            bounds.max_derender_logprobs,
        )
        return cls(tok, model.served_model_names, limits, model.eos_token_ids)

    def model_name(self, model: str | None) -> str:
        """The response's model: the request's, when served here (a 404 otherwise), else the first name."""
        if model and model not in self.served_model_names:
            raise NotFoundError(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.served_model_names)}.",
                param="model",
            )
        return model or self.served_model_names[0]

    def stop_tokens(self, request: Any) -> StopTokens:
        """The stop tokens whose text a ``stop`` finish leaves out, for this chat / completion request."""
        return StopTokens.of_request(self.eos_token_ids, request)


# --- off the event loop ------------------------------------------------------------------------

OFFLOAD_WORK = 4096
"""Token ids plus logprob entries from which ``*_async`` decode in a worker thread (~10 ms of work
and up, at ~2 us a token and ~7 us a logprob entry); below it, the work costs less than the hop."""

OFFLOAD_BODY_BYTES = 1 << 20
"""Raw bodies from which ``*_async`` also parse and bound the JSON in the worker thread: parsing and
counting a 14 MB body of prompt logprobs took ~0.7 s, which on the event loop held up every request
of the replica (~15 ms at this size)."""


def is_big_body(body: Any) -> bool:
    return isinstance(body, (bytes, bytearray, str)) and len(body) >= OFFLOAD_BODY_BYTES


# One worker, shared by every derender service in the process (plain, and the parser path's
# ``ParserDerenderService``, which a colocated Ingress runs next to it): decoding and parsing hold
# the GIL (Python code, tokenizers' decode, vLLM's parsers), so more threads would add no
# throughput, only take more of the GIL from the event loop they are there to keep turning.
OFFLOAD_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="derender")

_WORKER = threading.local()  # the worker thread's current job: its "caller has gone" flag


class _CallerGone(Exception):
    """Raised in the worker when the coroutine that awaits the job was cancelled; nobody reads it."""


def stop_if_caller_gone() -> None:
    """Called once per choice by the whole-request loops: a job whose caller was cancelled (the
    client disconnected) stops there instead of decoding on for no one, as do queued ones."""
    gone = getattr(_WORKER, "gone", None)
    if gone is not None and gone.is_set():
        raise _CallerGone


async def run_off_loop(work: Callable[..., _T], *args: Any) -> _T:
    """``work(*args)`` in :data:`OFFLOAD_EXECUTOR`, awaited from the running event loop; cancelling
    the await stops the work at its next :func:`stop_if_caller_gone`."""
    gone = threading.Event()

    def job() -> _T:
        _WORKER.gone = gone
        try:
            return work(*args)
        finally:
            _WORKER.gone = None

    try:
        return await asyncio.get_running_loop().run_in_executor(OFFLOAD_EXECUTOR, job)
    except asyncio.CancelledError:
        gone.set()
        raise


async def run_inline(work: Callable[..., _T], *args: Any) -> _T:
    """:func:`run_off_loop`'s stand-in for a synchronous caller: ``work(*args)`` here, never suspending."""
    return work(*args)


def run_sync(coro: Coroutine[Any, Any, _T]) -> _T:
    """The result of a coroutine that never suspends (a dispatcher given :func:`run_inline`),
    computed on the calling thread without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a derender dispatcher suspended with no event loop to resume it")

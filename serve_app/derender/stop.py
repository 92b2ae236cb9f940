"""Stop tokens: which final token's text an answer leaves out. Pure: no Ray, no vLLM, no tokenizer.

vLLM's engine detokenizer leaves out the text of the token generation stopped *on* (an EOS id or a
``stop_token_ids`` hit) unless ``include_stop_str_in_output``. Derender only sees the finish, so the
rule is decided from the ids, once, for every path (plain and parser derender, chat and
completions, whole and streamed, the composed ``/v1/*`` routes and the by-handle client):

the last token's text is dropped exactly when the finish is ``stop``, ``include_stop_str_in_output``
is off, and that token is a stop token: ``stop_reason`` an int naming it, or ``stop_reason`` null
(the engine's word for EOS) and the token one of the model's EOS ids or the request's
``stop_token_ids``. A string ``stop_reason`` is a stop string, matched in text upstream: no token
is dropped. Every other finish (``length``, ``abort``, a ``stop`` ending on an ordinary token, as an
orchestrator, a trimming engine or a replayed log can send) keeps all text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["StopTokens", "engine_stop_reason"]


class StopTokens:
    """One request's stop tokens: the model's EOS ids and the request's ``stop_token_ids``."""

    __slots__ = ("ids", "keep_text")

    def __init__(
        self, eos_token_ids: Iterable[int], stop_token_ids: Iterable[int] | None = None, include_stop_str_in_output: bool = False
    ) -> None:
        self.ids = frozenset((*eos_token_ids, *(stop_token_ids or ())))
        self.keep_text = include_stop_str_in_output  # the engine keeps the stop token's text then

    @classmethod
    def of_request(cls, eos_token_ids: Iterable[int], request: Any) -> StopTokens:
        """From a chat / completion request (a pydantic model, a dict, or ``None``)."""
        if request is None:
            return cls(eos_token_ids)
        get = request.get if isinstance(request, dict) else lambda k: getattr(request, k, None)
        return cls(eos_token_ids, get("stop_token_ids"), bool(get("include_stop_str_in_output")))

    def ends_on_stop(self, token_ids: Sequence[int] | None, finish_reason: str | None, stop_reason: int | str | None) -> bool:
        """True when the last of ``token_ids`` (a choice's output, or its final chunk) is the stop token."""
        if finish_reason != "stop" or not token_ids or self.keep_text or isinstance(stop_reason, str):
            return False
        last = token_ids[-1]
        return last in self.ids if stop_reason is None else last == stop_reason

    def text_ids(self, token_ids: Sequence[int], finish_reason: str | None, stop_reason: int | str | None) -> Sequence[int]:
        """The ids whose text the answer shows: all of them, or all but the stop token."""
        return token_ids[:-1] if self.ends_on_stop(token_ids, finish_reason, stop_reason) else token_ids


def engine_stop_reason(choice: dict[str, Any], eos_token_id: int | None, request_stop_token_ids: Iterable[int] | None) -> None:
    """``stop_reason`` as coupled ``vllm serve`` reports it, set in place on an engine choice dict.

    A tokens-only engine has no tokenizer, so it stops on the tokenizer's EOS as one of its stop ids
    and reports ``stop_reason=<id>``; with a tokenizer it reports ``None`` for that id unless the
    request itself listed it in ``stop_token_ids``.
    """
    if (
        eos_token_id is not None
        and choice.get("finish_reason") == "stop"
        and choice.get("stop_reason") == eos_token_id
        and eos_token_id not in (request_stop_token_ids or ())
    ):
        choice["stop_reason"] = None

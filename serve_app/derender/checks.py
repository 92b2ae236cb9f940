"""The derender request checks both derender services run, in vLLM 0.32's order and words. Pure.

The functions bound a request before any decoding (against
:class:`~serve_app.derender.model.DerenderLimits`), so an oversized one is a 400 before it costs
anything. :func:`check_size` runs first, on the parsed JSON: it bounds the request
as a whole (vLLM bounds each response and choice only) before schema validation, whose cost grows
with the body and which holds the GIL throughout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from serve_app.derender.model import DerenderLimits
from serve_app.derender.tokenizer import DetokTokenizer
from serve_app.errors import ApiError, BadRequestError
from serve_app.logs import get_logger

if TYPE_CHECKING:
    from serve_app.protocol import DerenderStreamState, GenerateTokensChoice, GenerateTokensStreamResponse

__all__ = [
    "CHOICE_WORK",
    "check_bounds",
    "check_choices",
    "check_prompt_ids",
    "check_size",
    "check_stream_chunk",
    "check_stream_window",
    "output_ids",
    "output_work",
    "stream_state_400",
    "validate_in_slices",
]

logger = get_logger(__name__)


def output_ids(choice: GenerateTokensChoice, where: str = "") -> list[int]:
    """A whole choice's token ids: none is vLLM's 400, except for an abort that landed before the
    first token, which is a finished choice with no text (``finish_reason: "abort"``), as a stream's
    finish-only chunk is. ``where`` places the choice in the message (`` in response <id>``)."""
    if choice.token_ids:
        return list(choice.token_ids)
    if choice.finish_reason == "abort":
        return []
    raise BadRequestError(f"choice {choice.index}{where} has empty or null token_ids")


def check_choices(choices: Sequence[Any], limits: DerenderLimits) -> None:
    for choice in choices:
        if choice.token_ids and len(choice.token_ids) > limits.max_model_len:
            raise BadRequestError(
                f"token_ids length ({len(choice.token_ids)}) in choice {choice.index} exceeds "
                f"max_model_len ({limits.max_model_len})."
            )
        content = choice.logprobs.content if choice.logprobs else None
        if content:
            if len(content) > limits.max_model_len:
                raise BadRequestError(
                    f"logprobs.content length ({len(content)}) in choice {choice.index} exceeds "
                    f"max_model_len ({limits.max_model_len})."
                )
            for entry in content:
                if limits.max_logprobs >= 0 and entry.top_logprobs and len(entry.top_logprobs) > limits.max_logprobs:
                    raise BadRequestError(
                        f"top_logprobs count ({len(entry.top_logprobs)}) in choice {choice.index} exceeds "
                        f"max_logprobs ({limits.max_logprobs})."
                    )


def _too_many_responses(count: int, max_n: int) -> BadRequestError:
    return BadRequestError(
        f"generate_responses count ({count}) exceeds server maximum ({max_n}). "
        "Set VLLM_MAX_N_SEQUENCES to increase this limit."
    )


def _too_many_choices(count: int, request_id: str, max_n: int) -> BadRequestError:
    return BadRequestError(f"choices count ({count}) in response '{request_id}' exceeds server maximum ({max_n}).")


def check_bounds(responses: Sequence[Any], limits: DerenderLimits) -> None:
    """A non-streaming call's generate responses: how many, how many choices, how long."""
    max_n, max_len = limits.max_n_sequences, limits.max_model_len
    if len(responses) > max_n:
        raise _too_many_responses(len(responses), max_n)
    for gen in responses:
        if len(gen.choices) > max_n:
            raise _too_many_choices(len(gen.choices), gen.request_id, max_n)
        check_choices(gen.choices, limits)
        if gen.prompt_logprobs and len(gen.prompt_logprobs) > max_len:
            raise BadRequestError(
                f"prompt_logprobs length ({len(gen.prompt_logprobs)}) in response '{gen.request_id}' "
                f"exceeds max_model_len ({max_len})."
            )


def check_prompt_ids(ids: Sequence[int] | None, limits: DerenderLimits) -> None:
    if ids is not None and len(ids) > limits.max_model_len:
        raise BadRequestError(f"prompt_token_ids length ({len(ids)}) exceeds max_model_len ({limits.max_model_len}).")


def check_stream_chunk(chunk: GenerateTokensStreamResponse, prompt_len: int, prior_len: int, limits: DerenderLimits) -> None:
    """A streaming chat chunk: one choice at most, and prompt + output so far + delta within the model."""
    if len(chunk.choices) > 1:
        raise BadRequestError(f"derender_chat_stream expects at most one choice per chunk (got {len(chunk.choices)}).")
    delta_len = sum(len(c.token_ids) for c in chunk.choices if c.token_ids)
    if prompt_len + prior_len + delta_len > limits.max_model_len:
        raise BadRequestError(
            f"prompt_token_ids length ({prompt_len}) plus output_token_ids length ({prior_len}) plus delta "
            f"({delta_len}) exceeds max_model_len ({limits.max_model_len})."
        )
    check_choices(chunk.choices, limits)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _choice_counts(choice: Any) -> tuple[int, int]:
    """A raw choice's token ids and logprob entries (sampled plus top candidates); another shape: none."""
    if not isinstance(choice, dict):
        return 0, 0
    lp = choice.get("logprobs")
    content = _list(lp.get("content")) if isinstance(lp, dict) else []
    logprobs = len(content) + sum(len(_list(e.get("top_logprobs"))) for e in content if isinstance(e, dict))
    return len(_list(choice.get("token_ids"))), logprobs


def _prompt_logprob_entries(gen: dict[str, Any]) -> int:
    """A raw response's ``prompt_logprobs``: one entry per position, plus each position's candidates."""
    return sum(1 + (len(p) if isinstance(p, dict) else 0) for p in _list(gen.get("prompt_logprobs")))


CHOICE_WORK = 4
"""A choice's own cost on the plain path (its response entry, seed, usage), in token units (~2 us):
2,000 one-token choices take ~22 ms. A parser choice costs far more (a fresh vLLM parser each)."""


def output_work(gen: Any, choice_work: int = CHOICE_WORK) -> int:
    """A raw generate response's (or chunk's) work: output token ids, logprob entries (sampled, top
    and prompt), and ``choice_work`` per choice; counted as :func:`check_size` counts them
    (anything of another shape: nothing)."""
    if not isinstance(gen, dict):
        return 0
    choices = _list(gen.get("choices"))
    return sum(sum(_choice_counts(c)) for c in choices) + choice_work * len(choices) + _prompt_logprob_entries(gen)


def check_size(data: Any, limits: DerenderLimits) -> int:
    """Bound a derender request as a whole, on its parsed JSON, before schema validation.

    It counts and does not validate: a value of an unexpected shape counts as nothing and is left
    to the schema. vLLM's own count checks come first, in its words, so a body vLLM would refuse
    for its size gets vLLM's message (only sooner, before a schema error it may also hold).

    Returns:
        The request's work: token ids, logprob entries (prompt logprobs too) and ``CHOICE_WORK``
        per choice (what decoding and validation costs grow with).

    Raises:
        BadRequestError: too many generate responses, choices, token ids or logprob entries.
    """
    if not isinstance(data, dict):
        return 0
    completions = "generate_responses" in data
    if completions:
        responses = _list(data["generate_responses"])
        if len(responses) > limits.max_n_sequences:
            raise _too_many_responses(len(responses), limits.max_n_sequences)
    else:  # chat: one response, or one chunk of a stream
        responses = [data.get("generate_response"), data.get("generate_chunk")]
    prompt_ids = _list(data.get("prompt_token_ids"))  # completions: one list per response
    tokens = sum(len(_list(ids)) for ids in prompt_ids) if completions else len(prompt_ids)
    state = data.get("stream_state")
    tokens += len(_list(state.get("output_token_ids"))) if isinstance(state, dict) else 0
    choices = logprobs = 0
    for gen in responses:
        if not isinstance(gen, dict):
            continue
        gen_choices = _list(gen.get("choices"))
        request_id = gen.get("request_id")
        if len(gen_choices) > limits.max_n_sequences and isinstance(request_id, str):
            raise _too_many_choices(len(gen_choices), request_id, limits.max_n_sequences)
        choices += len(gen_choices)
        tokens += len(_list(gen.get("prompt_token_ids")))
        logprobs += _prompt_logprob_entries(gen)
        for choice in gen_choices:
            choice_tokens, choice_logprobs = _choice_counts(choice)
            tokens += choice_tokens
            logprobs += choice_logprobs
    for count, limit, what, field in (
        (choices, limits.max_choices, "choices", "max_derender_choices"),
        (tokens, limits.max_tokens, "token_ids", "max_derender_tokens"),
        (logprobs, limits.max_logprob_entries, "logprobs entries", "max_derender_logprobs"),
    ):
        if count > limit:
            raise BadRequestError(
                f"{what} count ({count}) in request exceeds server maximum ({limit}). "
                f"Set limits.{field} to increase this limit."
            )
    return tokens + logprobs + CHOICE_WORK * choices


def check_stream_window(state: DerenderStreamState, tok: DetokTokenizer) -> None:
    """A carried decode window that adds up: offsets inside ``prev_tokens``, pieces of this vocabulary.

    vLLM trusts it; a tampered one decodes garbage or fails deep inside (a 400 here instead).
    """
    if state.prefix_offset > state.read_offset or state.read_offset > len(state.prev_tokens):
        raise BadRequestError("invalid stream_state: offsets do not fit prev_tokens")
    pieces = tok.piece_set
    if any(p not in pieces and p != "" for p in state.prev_tokens):
        raise BadRequestError("invalid stream_state: prev_tokens holds pieces outside the vocabulary")


@contextmanager
def stream_state_400(
    failed: str = "derender", errors: type[Exception] | tuple[type[Exception], ...] = Exception, detail: bool = False
) -> Iterator[None]:
    """As vLLM: what breaks while a carried state is decoded or parsed is the caller's 400,
    ``invalid stream_state: <failed> failed`` (with the error's text when ``detail``); an
    :class:`~serve_app.errors.ApiError` passes as it is, and an exception outside ``errors`` too."""
    try:
        yield
    except ApiError:
        raise
    except errors as exc:
        message = f"invalid stream_state: {failed} failed"
        logger.info(message, exc_info=True)
        raise BadRequestError(f"{message} ({exc})" if detail else message) from None


# --- long lists validated slice by slice --------------------------------------------------------

_SLICE = 64  # list items per pydantic call: a few ms of GIL at the densest (a position's candidates)


def validate_in_slices(data: Any) -> None:
    """Validate a freshly parsed body's long logprob lists (``prompt_logprobs``, each choice's
    ``logprobs.content``) slice by slice, in place, before the whole body's validation.

    One pydantic call holds the GIL for its whole run: 240k prompt-logprob entries in one call held it
    ~1.5 s, so the replica's event loop stalled although the call ran in the worker thread. Between
    slices the loop gets the GIL back. The whole body's validation then takes the validated models
    as they are. A slice that fails leaves its list raw, so that validation words the error, with
    its own locations, exactly as before.
    """
    if not isinstance(data, dict):
        return
    gens = _list(data.get("generate_responses")) + [data.get("generate_response"), data.get("generate_chunk")]
    for gen in gens:
        if not isinstance(gen, dict):
            continue
        _slices(gen, "prompt_logprobs", _adapter("prompt_logprobs"))
        for choice in _list(gen.get("choices")):
            logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
            if isinstance(logprobs, dict):
                _slices(logprobs, "content", _adapter("content"))


def _slices(owner: dict[str, Any], key: str, adapter: Any) -> None:
    from pydantic import ValidationError

    items = owner.get(key)
    if not isinstance(items, list) or len(items) <= _SLICE:
        return
    done: list[Any] = []
    try:
        for i in range(0, len(items), _SLICE):
            done.extend(adapter.validate_python(items[i : i + _SLICE], from_attributes=True))
    except (ValidationError, RecursionError, ValueError, TypeError):
        return
    owner[key] = done


_ADAPTERS: dict[str, Any] = {}


def _adapter(name: str) -> Any:
    if name not in _ADAPTERS:
        from pydantic import TypeAdapter

        from serve_app.protocol import GenerateLogProbsContent, Logprob

        types = {"prompt_logprobs": list[dict[int, Logprob] | None], "content": list[GenerateLogProbsContent]}
        _ADAPTERS[name] = TypeAdapter(types[name])
    return _ADAPTERS[name]

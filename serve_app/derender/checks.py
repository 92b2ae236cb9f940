"""The derender request checks both derender services run, in vLLM 0.32's order and words. Pure.

:class:`DerenderModel` is what a derender service knows of its model (tokenizer, served names,
limits, EOS ids); the functions bound a request before any decoding, so an oversized one is a 400
before it costs anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serve_app.derender.stop import StopTokens
from serve_app.derender.tokenizer import DetokTokenizer
from serve_app.errors import BadRequestError, NotFoundError

__all__ = ["DerenderLimits", "DerenderModel", "check_bounds", "check_choices", "check_prompt_ids", "check_stream_chunk"]


@dataclass(frozen=True, slots=True)
class DerenderLimits:
    max_model_len: int
    max_logprobs: int
    max_n_sequences: int


@dataclass(frozen=True, slots=True)
class DerenderModel:
    """One model as derender sees it."""

    tok: DetokTokenizer
    served_model_names: list[str]
    limits: DerenderLimits
    eos_token_ids: list[int]

    @classmethod
    def from_config(cls, args: Any, model: Any) -> DerenderModel:
        """From the app's ``AppArgs`` and ``ResolvedModel``: loads the tokenizer (``tokenizers`` only)."""
        tok = DetokTokenizer(model.tokenizer_dir, model.special_token_ids)
        limits = DerenderLimits(model.max_model_len, args.max_logprobs, args.limits.max_n_sequences)
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


def check_bounds(responses: Sequence[Any], limits: DerenderLimits) -> None:
    """A non-streaming call's generate responses: how many, how many choices, how long."""
    max_n, max_len = limits.max_n_sequences, limits.max_model_len
    if len(responses) > max_n:
        raise BadRequestError(
            f"generate_responses count ({len(responses)}) exceeds server maximum ({max_n}). "
            "Set VLLM_MAX_N_SEQUENCES to increase this limit."
        )
    for gen in responses:
        if len(gen.choices) > max_n:
            raise BadRequestError(
                f"choices count ({len(gen.choices)}) in response '{gen.request_id}' exceeds server maximum ({max_n})."
            )
        check_choices(gen.choices, limits)
        if gen.prompt_logprobs and len(gen.prompt_logprobs) > max_len:
            raise BadRequestError(
                f"prompt_logprobs length ({len(gen.prompt_logprobs)}) in response '{gen.request_id}' "
                f"exceeds max_model_len ({max_len})."
            )


def check_prompt_ids(ids: Sequence[int] | None, limits: DerenderLimits) -> None:
    if ids is not None and len(ids) > limits.max_model_len:
        raise BadRequestError(f"prompt_token_ids length ({len(ids)}) exceeds max_model_len ({limits.max_model_len}).")


def check_stream_chunk(chunk: Any, prompt_len: int, prior_len: int, limits: DerenderLimits) -> None:
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

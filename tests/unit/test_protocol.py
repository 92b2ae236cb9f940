"""Our vLLM-free derender wire models against vLLM 0.32's: same classes, fields, order and defaults."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

import serve_app.protocol as ours

NAMES = [
    "DerenderChatRequest",
    "DerenderChatStreamRequest",
    "DerenderCompletionRequest",
    "DerenderCompletionStreamRequest",
    "DerenderStreamState",
    "GenerateTokensResponse",
    "GenerateTokensStreamResponse",
    "GenerateTokensChoice",
    "GenerateTokensStreamChoice",
    "GenerateLogProbs",
    "GenerateLogProbsContent",
    "GenerateLogProb",
]
# Passed through to responses: their defaults decide which keys an echo carries.
ECHOED = {
    "PerRequestMetrics": "vllm.entrypoints.generate.base.protocol",
    "SpeculativeDecodingMetrics": "vllm.entrypoints.generate.base.protocol",
    "UsageInfo": "vllm.entrypoints.serve.engine.protocol",
}


def _fields(cls: type[BaseModel]) -> list[tuple[str, object, bool]]:
    out = []
    for name, f in cls.model_fields.items():
        default = None if f.default is PydanticUndefined else f.default
        if f.default_factory is not None and name != "request_id":  # request_id: a random id either way
            default = f.default_factory()
        out.append((name, default, f.is_required()))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_fields_and_defaults_match_vllm(name: str):
    import serve_app.vllm_cli  # noqa: F401
    # isort: split
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as theirs

    assert _fields(getattr(ours, name)) == _fields(getattr(theirs, name))


def _comparable(exc) -> list[dict]:
    # Exceptions in ctx compare by identity; compare their text.
    return [{**e, "ctx": {k: str(v) for k, v in e.get("ctx", {}).items()}} for e in exc.errors(include_url=False)]


def test_state_bounds_match_vllm():
    import serve_app.vllm_cli  # noqa: F401
    # isort: split
    from pydantic import ValidationError
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as theirs

    for bad in (
        {"prev_tokens": ["a"] * 1025},
        {"prefix_offset": -1},
        {"logprob_context_token_ids": [1, 2, 3, 4, 5]},
        {"output_token_ids": [1], "output_chunk_lens": []},
        {"output_token_ids": [1], "output_chunk_lens": [0, 1]},
    ):
        with pytest.raises(ValidationError) as a:
            ours.DerenderStreamState.model_validate(bad)
        with pytest.raises(ValidationError) as b:
            theirs.DerenderStreamState.model_validate(bad)
        assert _comparable(a.value) == _comparable(b.value)
    ours.DerenderStreamState.model_validate({"prev_tokens": ["a"] * 1024})


@pytest.mark.parametrize("name", sorted(ECHOED))
def test_echoed_models_match_vllm(name: str):
    import importlib

    import serve_app.vllm_cli  # noqa: F401

    theirs = getattr(importlib.import_module(ECHOED[name]), name)
    assert _fields(getattr(ours, name)) == _fields(theirs)


def test_negative_token_ids_keep_vllms_errors():
    """The u32 bound on ids leaves vLLM's own errors for negative ids as they were."""
    import serve_app.vllm_cli  # noqa: F401
    # isort: split
    from pydantic import ValidationError
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as theirs

    for name, bad in (
        ("GenerateTokensChoice", {"index": 0, "token_ids": [1, -1]}),
        ("GenerateTokensResponse", {"choices": [], "prompt_token_ids": [-1]}),
        ("DerenderCompletionRequest", {"generate_responses": [], "prompt_token_ids": [[-3]]}),
    ):
        with pytest.raises(ValidationError) as a:
            getattr(ours, name).model_validate(bad)
        with pytest.raises(ValidationError) as b:
            getattr(theirs, name).model_validate(bad)
        assert _comparable(a.value) == _comparable(b.value)


@pytest.mark.parametrize("token_id", [-1, 2**32, 2**64])
def test_token_ids_outside_u32_are_refused(token_id):
    from pydantic import ValidationError

    for name, data in (
        ("GenerateLogProb", {"token_id": token_id, "logprob": -1.0}),
        ("GenerateTokensStreamChoice", {"index": 0, "token_ids": [token_id]}),
        ("DerenderStreamState", {"logprob_context_token_ids": [token_id]}),
        ("DerenderStreamState", {"output_token_ids": [token_id], "output_chunk_lens": [1]}),
        ("DerenderChatStreamRequest", {"stream": True, "generate_chunk": {"choices": []}, "prompt_token_ids": [token_id]}),
    ):
        with pytest.raises(ValidationError):
            getattr(ours, name).model_validate(data)
    ours.GenerateLogProb.model_validate({"token_id": 2**32 - 1, "logprob": -1.0})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_logprobs_must_be_finite(value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ours.GenerateLogProb.model_validate({"token_id": 1, "logprob": value})
    with pytest.raises(ValidationError):
        ours.Logprob.model_validate({"logprob": value})
    ours.GenerateLogProb.model_validate({"token_id": 1, "logprob": -9999.0})

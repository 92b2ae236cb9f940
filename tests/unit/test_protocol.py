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
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as theirs

    assert _fields(getattr(ours, name)) == _fields(getattr(theirs, name))


def _comparable(exc) -> list[dict]:
    # Exceptions in ctx compare by identity; compare their text.
    return [{**e, "ctx": {k: str(v) for k, v in e.get("ctx", {}).items()}} for e in exc.errors(include_url=False)]


def test_state_bounds_match_vllm():
    import serve_app.vllm_cli  # noqa: F401
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

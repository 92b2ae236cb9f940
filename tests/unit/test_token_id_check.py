"""``serve_app._vllm.fast_token_id_check``: ``GenerateRequest`` accepts and refuses exactly the
``token_ids`` vLLM's own validator does, with vLLM's errors, after the validator is swapped (and
``use_token_id_check`` puts vLLM's back, as the benchmark's A/B does)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pydantic import ValidationError
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

from serve_app._vllm import fast_token_id_check, use_token_id_check


def _cases() -> list[list[int]]:
    rng = random.Random(21)
    cases: list[list[int]] = [[0], [1], [-1], [0, -1], [-(2**63)], [2**40, -2], [5] * 4096 + [-1], [-1] + [5] * 4096]
    for _ in range(200):
        ids = [rng.randrange(0, 200_000) for _ in range(rng.randrange(1, 300))]
        if rng.random() < 0.5:
            ids[rng.randrange(len(ids))] = -rng.randrange(1, 10)
        cases.append(ids)
    return cases


def _verdict(ids: list[int]) -> tuple[str, Any]:
    try:
        request = GenerateRequest(token_ids=ids, sampling_params={"max_tokens": 4})
    except ValidationError as exc:
        return "refused", [(e["type"], e["loc"], e["msg"]) for e in exc.errors()]
    return "accepted", request.token_ids


def _vllm_verdict(ids: list[int]) -> str:
    try:
        GenerateRequest.validate_token_ids(ids)  # vLLM's own validator, still the class attribute
    except ValueError:
        return "refused"
    return "accepted"


def test_same_verdicts_as_vllms_validator() -> None:
    use_token_id_check(GenerateRequest.validate_token_ids)
    try:
        assert GenerateRequest.__pydantic_decorators__.field_validators["validate_token_ids"].func.__module__ != "serve_app._vllm"
        vllms = [_verdict(ids) for ids in _cases()]
    finally:
        fast_token_id_check()
    assert [_verdict(ids) for ids in _cases()] == vllms  # the same ids, error types, locs and messages
    assert sum(v == "refused" for v, _ in vllms) > 50
    assert GenerateRequest.__pydantic_decorators__.field_validators["validate_token_ids"].func.__module__ == "serve_app._vllm"


def test_verdicts_match_vllms_validator_called_directly() -> None:
    fast_token_id_check()
    for ids in _cases():
        verdict, detail = _verdict(ids)
        assert verdict == _vllm_verdict(ids), ids
        if verdict == "accepted":
            assert detail == ids
        else:
            assert detail == [("value_error", ("token_ids",), "Value error, token_ids must not contain negative values")]


def test_idempotent_and_other_constraints_kept() -> None:
    fast_token_id_check()
    fast_token_id_check()
    assert _verdict([])[0] == "refused" and _verdict([])[1][0][0] == "too_short"  # min_length=1, before the check
    with pytest.raises(ValidationError):
        GenerateRequest(token_ids=["a"], sampling_params={"max_tokens": 4})
    ok = GenerateRequest(token_ids=[1, 2], sampling_params={"max_tokens": 4})
    assert ok._sampling_params_provided_keys == {"max_tokens"}  # vLLM's wrap validator still runs

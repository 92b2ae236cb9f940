"""``serve_app.derender.checks.check_size``: one derender request is bounded as a whole (choices,
token ids, logprob entries; issue 12) before schema validation, through the real plain service
(qwen3-tiny's tokenizer) with small limits, and answers vLLM's own words where vLLM has a check."""

from __future__ import annotations

import json
from typing import Any

import pytest

from serve_app.config import AppArgs, RequestLimits
from serve_app.derender.checks import CHOICE_WORK, check_size
from serve_app.derender.model import DerenderLimits
from serve_app.derender.plain import build_plain_service
from serve_app.errors import ApiError, envelope

LIMITS = {"max_n_sequences": 8, "max_derender_choices": 4, "max_derender_tokens": 64, "max_derender_logprobs": 10}


@pytest.fixture(scope="module")
def service():
    args = AppArgs(model="qwen3-tiny", limits=LIMITS)
    return build_plain_service(args, args.resolve())


def _choice(index: int, ids: Any, logprobs: dict | None = None) -> dict:
    return {"index": index, "token_ids": ids, "logprobs": logprobs, "finish_reason": "length"}


def _gen(choices: list[dict], request_id: str = "r") -> dict:
    return {"request_id": request_id, "choices": choices}


def _completion(*gens: dict, **fields) -> dict:
    return {"generate_responses": list(gens), "completion_request": {"prompt": "x"}, **fields}


def _lp(positions: int, tops: int) -> dict:
    return {
        "content": [
            {"token_id": 100 + i, "logprob": -1.0, "top_logprobs": [{"token_id": 200 + k, "logprob": -2.0} for k in range(tops)]}
            for i in range(positions)
        ]
    }


def _answer(service, kind: str, body: dict) -> dict:
    """The response dict, or the error envelope of the 400."""
    try:
        return json.loads(getattr(service, kind)(json.dumps(body).encode()))
    except ApiError as exc:
        status, env = envelope(exc)
        assert status == 400 == env["error"]["code"] and env["error"]["type"] == "BadRequestError", env
        return env


def _message(answer: dict) -> str | None:
    return answer.get("error", {}).get("message")


class TestChoices:
    def test_choices_across_generate_responses_are_bounded(self, service):
        body = _completion(*(_gen([_choice(i, [9707]) for i in range(2)], f"r{j}") for j in range(3)))
        assert _message(_answer(service, "completion", body)) == (
            "choices count (6) in request exceeds server maximum (4). Set limits.max_derender_choices to increase this limit."
        )

    def test_choices_at_the_bound_pass(self, service):
        body = _completion(*(_gen([_choice(i, [9707]) for i in range(2)], f"r{j}") for j in range(2)))
        assert len(_answer(service, "completion", body)["choices"]) == 4

    def test_vllm_counts_keep_vllms_words_and_come_before_validation(self, service):
        # Malformed choices ("token_ids": "x"): the size is refused before the schema looks at them.
        chat = {"generate_response": _gen([_choice(i, "x") for i in range(9)], "big")}
        assert _message(_answer(service, "chat", chat)) == "choices count (9) in response 'big' exceeds server maximum (8)."
        completion = _completion(*(_gen([_choice(0, "x")]) for _ in range(9)))
        assert _message(_answer(service, "completion", completion)) == (
            "generate_responses count (9) exceeds server maximum (8). Set VLLM_MAX_N_SEQUENCES to increase this limit."
        )


class TestTokens:
    @pytest.mark.parametrize("kind", ["chat", "completion"])
    def test_output_and_prompt_token_ids_count_together(self, service, kind):
        gen = _gen([_choice(0, [9707] * 40)])
        prompt = [9707] * 25
        body = {"generate_response": gen, "prompt_token_ids": prompt} if kind == "chat" else _completion(gen, prompt_token_ids=[prompt])
        assert _message(_answer(service, kind, body)) == (
            "token_ids count (65) in request exceeds server maximum (64). Set limits.max_derender_tokens to increase this limit."
        )
        body = {**body, "prompt_token_ids": prompt[:24] if kind == "chat" else [prompt[:24]]}
        assert _message(_answer(service, kind, body)) is None

    def test_a_stream_chunk_and_its_carried_output_ids_count(self, service):
        body = {
            "stream": True,
            "generate_chunk": _gen([_choice(0, [9707] * 40)]),
            "stream_state": {"output_token_ids": [9707] * 30, "output_chunk_lens": [30]},
        }
        assert "token_ids count (70)" in _message(_answer(service, "chat", body))


class TestLogprobs:
    def test_sampled_and_top_entries_count_together(self, service):
        body = {"generate_response": _gen([_choice(0, [100, 101, 102, 103], _lp(4, 2))])}
        assert _message(_answer(service, "chat", body)) == (
            "logprobs entries count (12) in request exceeds server maximum (10). Set limits.max_derender_logprobs to increase this limit."
        )

    def test_entries_at_the_bound_pass(self, service):
        body = {"generate_response": _gen([_choice(0, [100, 101], _lp(2, 4))])}
        assert len(_answer(service, "chat", body)["choices"][0]["logprobs"]["content"]) == 2

    def test_top_logprobs_per_position_stay_bounded_by_max_logprobs(self, service):
        limits = {**LIMITS, "max_derender_logprobs": 1000}
        args = AppArgs(model="qwen3-tiny", limits=limits, max_logprobs=3)
        strict = build_plain_service(args, args.resolve())
        body = {"generate_response": _gen([_choice(0, [100], _lp(1, 4))])}
        assert _message(_answer(strict, "chat", body)) == "top_logprobs count (4) in choice 0 exceeds max_logprobs (3)."


class TestCheckSize:
    LIMITS = DerenderLimits(4096, 20, 16384)

    def test_returns_the_work_token_ids_plus_logprob_entries_plus_choices(self):
        body = {"generate_response": _gen([_choice(0, [1, 2, 3], _lp(3, 2))]), "prompt_token_ids": [7, 8]}
        assert check_size(body, self.LIMITS) == 3 + 2 + 3 * 3 + CHOICE_WORK
        body["generate_response"]["prompt_logprobs"] = [None, {"5": {"logprob": -1.0}, "6": {"logprob": -2.0}}]
        assert check_size(body, self.LIMITS) == 3 + 2 + 3 * 3 + CHOICE_WORK + 2 + 2

    @pytest.mark.parametrize(
        "body",
        [
            None,
            [],
            "x",
            {"generate_response": "x"},
            {"generate_response": {"choices": "x"}},
            {"generate_response": {"choices": [1, None, {"token_ids": 5, "logprobs": []}]}},
            {"generate_responses": {"a": 1}, "prompt_token_ids": 3},
            {"generate_chunk": {"choices": [{"logprobs": {"content": [1, {"top_logprobs": "x"}]}}]}, "stream_state": []},
        ],
    )
    def test_shapes_it_does_not_expect_are_left_to_the_schema(self, body):
        assert isinstance(check_size(body, self.LIMITS), int)  # no raise, no crash

    def test_defaults_come_from_the_config(self):
        limits = RequestLimits()
        assert (limits.max_derender_choices, limits.max_derender_tokens, limits.max_derender_logprobs) == (16384, 1 << 21, 1 << 20)
        defaults = DerenderLimits(4096, 20, 16384)
        assert (defaults.max_choices, defaults.max_tokens, defaults.max_logprob_entries) == (16384, 1 << 21, 1 << 20)


class TestValidateInSlices:
    """Long logprob lists are validated slice by slice (each pydantic call holds the GIL for its whole
    run); the whole body's validation must then give the same request, and the same error, as before."""

    @staticmethod
    def _body(positions: int, bad_at: int | None = None) -> dict:
        candidates = {str(i): {"logprob": -1.0 - i, "rank": i + 1, "decoded_token": f"t{i}"} for i in range(3)}
        prompt_logprobs: list = [None] + [dict(candidates) for _ in range(positions)]
        entry = {"token_id": 5, "logprob": -0.5, "rank": 1, "top_logprobs": [{"token_id": 6, "logprob": -1.5, "rank": 2}]}
        content = [dict(entry) for _ in range(positions)]
        if bad_at is not None:
            prompt_logprobs[bad_at] = {"7": {"logprob": "not a number"}}
            content[bad_at] = {**entry, "token_id": -1}
        return {
            "generate_responses": [
                {
                    "request_id": "r",
                    "prompt_logprobs": prompt_logprobs,
                    "choices": [{"index": 0, "token_ids": [5] * positions, "logprobs": {"content": content}}],
                }
            ],
            "prompt_token_ids": [[5] * (positions + 1)],
        }

    def _validate(self, body: dict):
        from serve_app.derender.plain_service import _COMPLETION
        from serve_app.wire import validate_model

        return validate_model(_COMPLETION, body)

    @pytest.mark.parametrize("positions", [1, 64, 65, 200])
    def test_the_request_equals_whole_validation(self, positions):
        import copy

        from serve_app.derender.checks import validate_in_slices

        body = self._body(positions)
        sliced = copy.deepcopy(body)
        validate_in_slices(sliced)
        assert self._validate(sliced) == self._validate(body)

    @pytest.mark.parametrize("bad_at", [1, 70, 199])
    def test_an_invalid_entry_is_worded_as_whole_validation_words_it(self, bad_at):
        import copy

        from serve_app.derender.checks import validate_in_slices
        from serve_app.errors import ApiError

        body = self._body(200, bad_at)
        sliced = copy.deepcopy(body)
        validate_in_slices(sliced)
        with pytest.raises(ApiError) as whole:
            self._validate(body)
        with pytest.raises(ApiError) as in_slices:
            self._validate(sliced)
        assert str(in_slices.value) == str(whole.value) and in_slices.value.param == whole.value.param

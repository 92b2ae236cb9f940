"""serve_app's render tier against vLLM 0.32's own renderer, request for request.

Each corpus case is sent, as the same bytes with the same headers, to serve_app over HTTP (Ray
Serve) and to vLLM's ``vllm launch render`` app in this process. The answers must be the same JSON:
every ``GenerateRequest`` field (request ids included: both sides get the same ``X-Request-Id``),
every ``/tokenize`` / ``/detokenize`` field, and for errors the status code and the whole envelope.

Three differences are intended and asserted exactly, nothing looser:

* A completions prompt of token ids past the model's vocabulary: vLLM's render passes it on (and a
  tokens-only engine's EngineCore then dies on it); serve_app answers vLLM's own out-of-vocabulary
  400 (``param: prompt``). Cases in ``REJECTED_OUT_OF_VOCAB``.

* A chat message with a role neither OpenAI's nor the chat template's: vLLM hands it to the template,
  which drops it from the prompt without a word (or fails in its own words); serve_app answers a 400
  naming it (``param: messages``). Cases in ``REJECTED_UNKNOWN_ROLE``.

* ``sampling_params.max_tokens``: vLLM 0.32 drops it when it equals 16 (msgspec ``omit_defaults``);
  serve_app always emits it. Where vLLM's answer lacks the key, ours must carry ``16`` and
  otherwise be equal.
* Error bodies that are not vLLM's envelope: for a few framework errors vLLM answers FastAPI's
  ``{"detail": ...}``; serve_app answers its envelope for every error (README). Where vLLM's body
  has no ``error`` key, the status must be equal and ours must be exactly that detail wrapped the
  way serve_app's ingress wraps framework errors: ``{"error": {"message": detail, "type": <HTTP
  phrase>, "param": null, "code": status}}``.
"""

from __future__ import annotations

import copy
import re
from http import HTTPStatus
from typing import Any

import httpx
import pytest

from tests.differential.conftest import ORACLE_FIXTURE, OUR_URL_FIXTURE
from tests.differential.corpus import CHAT, COMPLETION, DETOKENIZE, MESSAGES, MODELS, RESPONSES, TOKENIZE, Case, cases_for

GENERATE_PATHS = {CHAT, COMPLETION, MESSAGES, RESPONSES}
RANDOM_ID = re.compile(r"(chatcmpl-|cmpl-|resp_)[0-9a-f]{16}(-\d+)?")
MIN_CASES_PER_MODEL = 50

CORPUS = {model: cases_for(model) for model in MODELS}
PARAMS = [pytest.param(model, case, id=f"{model}:{case.id}") for model, cases in CORPUS.items() for case in cases]


def _media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";")[0].strip()


def _generate_requests(body: Any) -> list[dict[str, Any]]:
    return body if isinstance(body, list) else [body]


SERVE_ID = re.compile(r"(chatcmpl|cmpl)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}(-\d+)?")


def expected_from_vllm(case: Case, ref: Any, ours: Any) -> Any:
    """vLLM's answer with the intended differences applied; ``ours`` is only read, never adjusted."""
    expected = copy.deepcopy(ref)
    if case.path not in GENERATE_PATHS:
        return expected
    ref_items, our_items = _generate_requests(expected), _generate_requests(ours)
    assert len(our_items) == len(ref_items), f"{len(our_items)} GenerateRequests, vLLM rendered {len(ref_items)}"
    for ref_item, our_item in zip(ref_items, our_items, strict=True):
        params = ref_item["sampling_params"]
        if "max_tokens" not in params:
            # vLLM 0.32 omits max_tokens exactly when it equals SamplingParams' default, 16.
            params["max_tokens"] = 16
        if not case.request_id and case.path != RESPONSES:
            # Documented deviation (README): with no X-Request-Id header, Ray Serve's proxy assigns
            # one (a uuid4) before our ingress runs, so the id is <prefix>-<uuid4> and a body
            # request_id is not used. Prefix and per-prompt suffix must still be vLLM's.
            ours_id = SERVE_ID.fullmatch(our_item["request_id"])
            assert ours_id, our_item["request_id"]
            assert ours_id[1] == ref_item["request_id"].split("-", 1)[0]
            suffix = "-" + ref_item["request_id"].rsplit("-", 1)[1] if len(ref_items) > 1 else ""
            assert (ours_id[2] or "") == suffix, (our_item["request_id"], ref_item["request_id"])
            ref_item["request_id"] = our_item["request_id"]
        elif _draws_random_id(case):
            # Neither an X-Request-Id header (which vLLM's responses render ignores) nor a body
            # request_id: both sides draw a random id; prefix, shape and per-prompt suffix must agree.
            ref_id, our_id = RANDOM_ID.fullmatch(ref_item["request_id"]), RANDOM_ID.fullmatch(our_item["request_id"])
            assert ref_id and our_id, (ref_item["request_id"], our_item["request_id"])
            assert (our_id[1], our_id[2]) == (ref_id[1], ref_id[2]), (our_item["request_id"], ref_item["request_id"])
            ref_item["request_id"] = our_item["request_id"]
    return expected


def _draws_random_id(case: Case) -> bool:
    if isinstance(case.body, dict) and "request_id" in case.body:
        return False
    return case.path == RESPONSES or not case.request_id


def differences(ours: Any, ref: Any, path: str = "$") -> list[str]:
    """Where two JSON values differ, as ``path: ours=... vLLM=...`` lines."""
    if isinstance(ours, dict) and isinstance(ref, dict):
        out = []
        for key in sorted(set(ours) | set(ref), key=str):
            if key not in ref:
                out.append(f"{path}.{key}: only ours, {ours[key]!r:.300}")
            elif key not in ours:
                out.append(f"{path}.{key}: only vLLM, {ref[key]!r:.300}")
            else:
                out += differences(ours[key], ref[key], f"{path}.{key}")
        return out
    if isinstance(ours, list) and isinstance(ref, list) and len(ours) == len(ref):
        return [line for i, (o, r) in enumerate(zip(ours, ref, strict=True)) for line in differences(o, r, f"{path}[{i}]")]
    return [] if ours == ref else [f"{path}: ours={ours!r:.300} vLLM={ref!r:.300}"]


def assert_same_error(ours: httpx.Response, ref: httpx.Response) -> None:
    ref_body, our_body = ref.json(), ours.json()
    assert ours.status_code == ref.status_code, (
        f"status {ours.status_code}, vLLM {ref.status_code}\nours: {ours.text}\nvLLM: {ref.text}"
    )
    if isinstance(ref_body, dict) and "error" in ref_body:
        assert our_body == ref_body, f"\nours: {ours.text}\nvLLM: {ref.text}"
    else:
        # FastAPI's {"detail": ...} in vLLM. serve_app answers its envelope for every error, with the
        # detail as message and the HTTP phrase as type, as its ingress does for framework errors.
        status = ref.status_code
        assert our_body == {
            "error": {"message": ref_body["detail"], "type": HTTPStatus(status).phrase, "param": None, "code": status}
        }, f"\nours: {ours.text}\nvLLM: {ref.text}"


REJECTED_OUT_OF_VOCAB = {"cmpl-out-of-vocab-ids"}
REJECTED_UNKNOWN_ROLE = {"chat-unknown-role"}


@pytest.mark.parametrize(("model", "case"), PARAMS)
def test_render_matches_vllm(request: pytest.FixtureRequest, http: httpx.Client, model: str, case: Case) -> None:
    # Session fixtures, looked up by model so each app and oracle starts on first use only.
    base_url = request.getfixturevalue(OUR_URL_FIXTURE[model])
    oracle = request.getfixturevalue(ORACLE_FIXTURE[model])
    content, headers = case.wire()

    ref = oracle.post(case.path, content=content, headers=headers)
    # The corpus states what vLLM answers; a case that drifted into an unintended error covers nothing.
    assert ref.status_code == case.expect, f"corpus drift: vLLM answered {ref.status_code}: {ref.text[:3000]}"

    ours = http.post(base_url + case.path, content=content, headers=headers)
    assert _media_type(ours) == _media_type(ref) == "application/json"

    if case.id in REJECTED_OUT_OF_VOCAB:
        error = ours.json()["error"]
        assert (ours.status_code, error["param"], error["type"]) == (400, "prompt", "BadRequestError")
        assert "is out of vocabulary" in error["message"]
        return
    if case.id in REJECTED_UNKNOWN_ROLE:
        error = ours.json()["error"]
        assert (ours.status_code, error["param"], error["type"]) == (400, "messages", "BadRequestError")
        assert error["message"].startswith("Unsupported message role 'wizard' in messages[0].")
        return

    if ref.status_code != 200:
        assert_same_error(ours, ref)
        return
    assert ours.status_code == 200, f"ours {ours.status_code}: {ours.text[:3000]}\nvLLM: {ref.text[:3000]}"
    our_body = ours.json()
    expected = expected_from_vllm(case, ref.json(), our_body)
    assert our_body == expected, "\n".join(["ours != vLLM at:", *differences(our_body, expected)[:20]])
    if case.path in GENERATE_PATHS:
        for item in _generate_requests(our_body):
            assert item["token_ids"] and isinstance(item["sampling_params"]["max_tokens"], int)


# --- the corpus itself ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_corpus_is_broad_enough(model: str) -> None:
    cases = CORPUS[model]
    renders = [c for c in cases if c.path in GENERATE_PATHS]
    assert len([c for c in renders if c.expect == 200]) >= MIN_CASES_PER_MODEL
    assert {c.path for c in cases} == {CHAT, COMPLETION, MESSAGES, RESPONSES, TOKENIZE, DETOKENIZE}

    chat = [c.body for c in cases if c.path == CHAT and isinstance(c.body, dict)]
    choices = {str(b.get("tool_choice")) for b in chat if "tools" in b}
    assert {"auto", "none", "required", str({"type": "function", "function": {"name": "get_weather"}})} <= choices
    for key in ("chat_template_kwargs", "reasoning_effort", "documents", "continue_final_message", "stop", "stop_token_ids",
                "seed", "n", "top_logprobs", "max_completion_tokens", "stream_options"):
        assert any(key in b for b in chat), key
    assert any(m.get("role") == "tool" for b in chat for m in b.get("messages", []) if isinstance(m, dict))
    assert any(c.expect == 404 for c in cases) and any(c.raw is not None for c in cases)

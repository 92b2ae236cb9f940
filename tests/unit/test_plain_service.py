"""``serve_app.derender.plain_service``, called directly: hostile bodies are 400s in vLLM's envelope
(never 500s), and in-memory streams (the composed path) answer exactly as the carried-state API."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_app.config import AppArgs
from serve_app.derender.plain import build_plain_service
from serve_app.errors import ApiError, envelope

U32 = 2**32


@pytest.fixture(scope="module")
def service():
    args = AppArgs(model="qwen3-tiny")  # a Rust (fast) tokenizer: OverflowError outside u32
    return build_plain_service(args, args.resolve())


@pytest.fixture(scope="module")
def partial(service) -> int:
    """An id whose text alone is an incomplete UTF-8 character: its logprob text is repaired from context ids."""
    tok = service.model.tok
    return next(i for i in range(tok.vocab_size) if tok.piece(i) and tok.decode([i]).endswith("\ufffd"))


def _gen(ids: list[int], logprobs: dict | None = None, **extra) -> dict:
    return {"request_id": "r", "choices": [{"index": 0, "token_ids": ids, "logprobs": logprobs}], **extra}


def _lp(token_id: int, logprob: float = -1.0, top: int | None = None, top_logprob: float = -2.0) -> dict:
    entry = {"token_id": token_id, "logprob": logprob}
    if top is not None:
        entry["top_logprobs"] = [{"token_id": top, "logprob": top_logprob}]
    return {"content": [entry]}


def _body(kind: str, stream: bool, gen: dict, **fields) -> dict:
    if kind == "chat":
        body = {"generate_chunk": gen} if stream else {"generate_response": gen}
    else:
        body = {"generate_chunk": gen} if stream else {"generate_responses": [gen]}
        body["completion_request"] = {"prompt": "x"}
    return {"stream": True, **body, **fields} if stream else {**body, **fields}


def _call(service, kind: str, body) -> bytes:
    return getattr(service, kind)(json.dumps(body).encode() if isinstance(body, dict) else body)


def _assert_400(service, kind: str, body) -> dict:
    with pytest.raises(ApiError) as got:
        _call(service, kind, body)
    status, env = envelope(got.value)
    assert status == 400 == env["error"]["code"], env
    return env["error"]


KINDS = [("chat", False), ("chat", True), ("completion", False), ("completion", True)]


@pytest.mark.parametrize(("kind", "stream"), KINDS)
def test_deep_json_is_a_400(service, kind, stream):
    body = json.dumps(_body(kind, stream, _gen([1]))).encode()
    deep = b"[" * 5000 + b"]" * 5000
    _assert_400(service, kind, body[:-1] + b', "x": ' + deep + b"}")
    request = b'"chat_request": {"messages": [' if kind == "chat" else b'"completion_request": {"prompt": ['
    _assert_400(service, kind, body[:-1] + b", " + request + deep + b"]}}")


@pytest.mark.parametrize(("kind", "stream"), KINDS)
def test_integers_past_4300_digits_are_a_400(service, kind, stream):
    body = json.dumps(_body(kind, stream, _gen([7]))).encode()
    _assert_400(service, kind, body.replace(b"[7]", b"[" + b"7" * 5000 + b"]"))


@pytest.mark.parametrize(("kind", "stream"), KINDS)
@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"])
def test_non_finite_logprobs_are_a_400(service, kind, stream, value):
    body = json.dumps(_body(kind, stream, _gen([5], _lp(5, -1.5, top=6, top_logprob=-2.5)))).encode()
    _assert_400(service, kind, body.replace(b"-1.5", value, 1))  # the sampled token's logprob
    _assert_400(service, kind, body.replace(b"-2.5", value, 1))  # a top logprob


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logprobs_from_a_handle_caller_are_a_400(service, value):
    # A by-handle caller passes a dict: no JSON parse, so the models themselves refuse it.
    _assert_400(service, "chat", {"generate_response": _gen([5], _lp(5, value))})
    _assert_400(service, "chat", {"generate_response": _gen([5], _lp(5, top=6, top_logprob=value))})
    prompt_logprobs = [None, {"5": {"logprob": value}}]
    _assert_400(service, "chat", {"generate_response": _gen([5], prompt_logprobs=prompt_logprobs)})


@pytest.mark.parametrize("bad", [U32, 2**40, 2**64, 10**30])
@pytest.mark.parametrize(("kind", "stream"), KINDS)
def test_token_ids_past_u32_are_a_400(service, kind, stream, bad):
    prompt_ids = [[bad]] if kind == "completion" and not stream else [bad]
    for body in (
        _body(kind, stream, _gen([bad])),
        _body(kind, stream, _gen([5], _lp(bad))),
        _body(kind, stream, _gen([5], _lp(5, top=bad))),
        _body(kind, stream, _gen([5], prompt_token_ids=[bad])),
        _body(kind, stream, _gen([5]), prompt_token_ids=prompt_ids),
    ):
        _assert_400(service, kind, body)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("bad", [U32, 2**64, -1])
def test_stream_state_ids_past_u32_are_a_400(service, partial, kind, bad):
    # The logprob context repairs a partial character by decoding context + id: OverflowError there.
    gen = _gen([partial], _lp(partial, top=partial))
    _assert_400(service, kind, _body(kind, True, gen, stream_state={"logprob_context_token_ids": [bad]}))
    state = {"output_token_ids": [bad], "output_chunk_lens": [1]}
    _assert_400(service, kind, _body(kind, True, _gen([5]), stream_state=state))


@pytest.mark.parametrize(("kind", "stream"), KINDS)
def test_negative_logprob_ids_are_a_400(service, partial, kind, stream):
    # A negative id as the context of a partial character reached the tokenizer (OverflowError).
    gen = {"request_id": "r", "choices": [{"index": 0, "token_ids": [partial, partial],
                                           "logprobs": {"content": [{"token_id": -1, "logprob": -1.0},
                                                                    {"token_id": partial, "logprob": -1.0}]}}]}
    _assert_400(service, kind, _body(kind, stream, gen))


@pytest.mark.parametrize(("kind", "stream"), KINDS)
def test_ids_past_the_vocabulary_but_within_u32_still_decode(service, partial, kind, stream):
    # vLLM decodes ids past the vocabulary as empty text; only the u32 overflow is an error.
    for tid in (service.model.tok.vocab_size + 5, U32 - 1):
        gen = _gen([tid, 5], {"content": [{"token_id": tid, "logprob": -1.0, "top_logprobs": [{"token_id": tid, "logprob": -1.0}]},
                                          {"token_id": 5, "logprob": -1.0}]})
        state = {"logprob_context_token_ids": [tid], "output_token_ids": [tid], "output_chunk_lens": [1]}
        fields = {"stream_state": state} if stream else {}
        json.loads(_call(service, kind, _body(kind, stream, gen, **fields)))


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("value", ["false", "true", "False", None, []])
def test_stream_that_is_not_a_boolean_is_a_400(service, kind, value):
    for stream in (False, True):  # the body of either branch
        err = _assert_400(service, kind, {**_body(kind, stream, _gen([5])), "stream": value})
        assert "stream" in err["message"]


@pytest.fixture(scope="module")
def mistral_service():
    args = AppArgs(model="mistral-sp")  # a sentencepiece tokenizer: byte-fallback pieces
    return build_plain_service(args, args.resolve())


def _chunks(ids: list[int]) -> list[dict]:
    return [
        {"request_id": "r", "choices": [{"index": 0, "token_ids": ids[i : i + 2], "finish_reason": "stop" if i + 2 >= len(ids) else None}]}
        for i in range(0, len(ids), 2)
    ] + [{"request_id": "r", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(ids)}}]


@pytest.mark.parametrize(("kind", "request_field", "original"), [
    ("chat", "chat_request", {"messages": [{"role": "user", "content": "hi"}]}),
    ("completion", "completion_request", {"prompt": "hi"}),
])
def test_feed_equals_http_api(mistral_service, kind, request_field, original):
    prompt = [1, 22557, 1526]
    ids = [22557, 1526, 29491, 1183, 12180, 29473, 243, 162, 155, 131, 2]
    opened = getattr(mistral_service, f"open_{kind}_stream")(original, prompt, 3)
    call = getattr(mistral_service, kind)
    state = None
    for chunk in _chunks(ids):
        fed = opened.feed(chunk)
        body = {"stream": True, "generate_chunk": chunk, "stream_state": state, request_field: original,
                "prompt_token_ids": prompt, "prompt_tokens": 3}
        http = json.loads(call(body))
        state = http["stream_state"]
        assert {k: v for k, v in fed.items() if k != "created"} == {k: v for k, v in http["chunk"].items() if k != "created"}
        assert opened.state() == state


# --- big requests decode off the event loop (issue 12) ------------------------------------------


def _big_completion() -> bytes:
    """64k token ids: ~100 ms of decoding, far above OFFLOAD_WORK."""
    choices = [{"index": i, "token_ids": list(range(1000, 5000)), "finish_reason": "length"} for i in range(16)]
    return json.dumps(_body("completion", False, {"request_id": "big", "choices": choices})).encode()


def test_a_small_request_decodes_inline_without_a_thread_hop(service):
    body = json.dumps(_body("chat", False, _gen([9707, 11]))).encode()
    coro = service.chat_async(body)
    with pytest.raises(StopIteration) as done:  # finished on its first step: it never suspended
        coro.send(None)
    assert json.loads(done.value.value)["choices"][0]["message"]["content"] == service.tok.decode([9707, 11])


def test_a_big_request_decodes_off_the_event_loop_so_a_small_one_finishes_first(service):
    """Liveness, not speed: a small request that starts while a big one decodes completes before it."""
    big, small = _big_completion(), json.dumps(_body("chat", False, _gen([9707]))).encode()

    async def run() -> list[str]:
        finished: list[str] = []

        async def call(name: str, method, body: bytes) -> None:
            await method(body)
            finished.append(name)

        big_call = asyncio.create_task(call("big", service.completion_async, big))
        await asyncio.sleep(0)  # the big one is parsed, bounded and handed to the worker thread
        assert not big_call.done()
        await call("small", service.chat_async, small)
        await big_call
        return finished

    assert asyncio.run(run()) == ["small", "big"]
    assert json.loads(service.completion(big))["usage"]["completion_tokens"] == 16 * 4000  # same answer inline


@pytest.mark.parametrize("what", ["one-token choices", "prompt_logprobs"])
def test_work_the_size_bounds_did_not_count_decodes_off_the_loop(service, what):
    """Issue 19: 16,384 one-token choices and a long prompt_logprobs (validated entry by entry) are
    work too, counted by the size check: a small request started meanwhile finishes first."""
    if what == "one-token choices":
        gen = {"request_id": "big", "choices": [{"index": i, "token_ids": [9707]} for i in range(16384)]}
    else:
        candidates = {str(i): {"logprob": -1.0, "rank": i + 1, "decoded_token": "a"} for i in range(20)}
        gen = _gen([9707], prompt_logprobs=[None] + [candidates] * 4000)
    big, small = json.dumps(_body("chat", False, gen)).encode(), json.dumps(_body("chat", False, _gen([9707]))).encode()

    async def run() -> list[str]:
        finished: list[str] = []

        async def call(name: str, body: bytes) -> None:
            await service.chat_async(body)
            finished.append(name)

        big_call = asyncio.create_task(call("big", big))
        await asyncio.sleep(0)  # the big one is parsed, bounded and handed to the worker thread
        assert not big_call.done()
        await call("small", small)
        await big_call
        return finished

    assert asyncio.run(run()) == ["small", "big"]


def test_prompt_logprobs_count_against_the_logprob_bound(service):
    from serve_app.derender.checks import check_size
    from serve_app.derender.model import DerenderLimits

    candidates = {str(i): {"logprob": -1.0} for i in range(20)}
    body = _body("chat", False, _gen([9707], prompt_logprobs=[None] + [candidates] * 10))
    limits = DerenderLimits(4096, 20, 16384, max_logprob_entries=200)  # 11 positions + 10 x 20 candidates
    with pytest.raises(ApiError, match="logprobs entries count \\(211\\)"):
        check_size(body, limits)


def test_a_cancelled_request_stops_decoding_in_the_worker(service, monkeypatch):
    """Issue 19: a client that went away (its request's coroutine cancelled) stops the decoding it
    started: the next job in the worker thread runs after fewer than all of its choices decoded."""
    from serve_app.derender import model, whole

    decoded: list[int] = []
    real = whole.detokenize_delta

    def counted(*args, **kwargs):
        decoded.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(whole, "detokenize_delta", counted)
    n = 16384
    gen = {"request_id": "big", "choices": [{"index": i, "token_ids": [9707]} for i in range(n)]}
    big = json.dumps(_body("chat", False, gen)).encode()

    async def run() -> int:
        task = asyncio.create_task(service.chat_async(big))
        await asyncio.sleep(0)  # parsed, bounded and handed to the worker thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await model.run_off_loop(len, decoded)  # queued behind it in the one worker

    assert asyncio.run(run()) < n
    assert json.loads(service.chat(json.dumps(_body("chat", False, _gen([9707]))).encode()))["choices"]

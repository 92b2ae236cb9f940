"""ParserDerenderService in-process (real vLLM parsers and tokenizer, no Ray): the vLLM 0.32 gaps
it fixes, and the session cache's hit / miss / replay rules."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from transformers import AutoTokenizer

from serve_app.config import AppArgs
from serve_app.derender.parser import build_parser_service
from serve_app.errors import ApiError
from tests.harness.derender_stream import carry_state, split, token_chunks
from tests.harness.payloads import MINIMAL_WEATHER_TOOLS as TOOLS

CHAT_REQUEST = {"messages": [{"role": "user", "content": "Weather in Paris and Rome?"}], "tools": TOOLS}
OUTPUT = (
    "<think>\nTwo cities, two calls.\n</think>\n\nOn it.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def service():
    args = AppArgs(model="qwen3-tiny", tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True)
    return asyncio.run(build_parser_service(args, args.resolve()))


@pytest.fixture(scope="module")
def tok():
    from serve_app.models import ensure_model

    return AutoTokenizer.from_pretrained(ensure_model("qwen3-tiny"))


@pytest.fixture(scope="module")
def ids(tok):
    prompt = tok.apply_chat_template(CHAT_REQUEST["messages"], tools=TOOLS, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    return prompt, tok.encode(OUTPUT) + [tok.convert_tokens_to_ids("<|im_end|>")]


def _whole(service, prompt, output, chat_request=CHAT_REQUEST, **choice):
    body = {
        "generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": output, **choice}]},
        "prompt_token_ids": prompt,
        "chat_request": chat_request,
    }
    return json.loads(service.chat(body))["choices"][0]


def _chunk(prompt, ids, state, last=False, chat_request=CHAT_REQUEST, **choice):
    return {
        "stream": True,
        "generate_chunk": {
            "request_id": "s",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop" if last else None, **choice}],
        },
        "stream_state": state,
        "chat_request": chat_request,
        "prompt_token_ids": prompt,
    }


def _stream(service, prompt, output, step=1, chat_request=CHAT_REQUEST, finish=True):
    chunks, outcomes, state = [], [], None

    def post(body):
        out, outcome = service.chat_with_outcome(body)
        outcomes.append(outcome)
        return json.loads(out)

    parts = token_chunks(split(output, step), "s", "stop" if finish else None)
    for data in carry_state(post, parts, chat_request=chat_request, prompt_token_ids=prompt):
        state = data["stream_state"]
        chunks.append(data["chunk"])
    return chunks, outcomes, state


class TestFixedGaps:
    def test_non_streaming_tool_calls(self, service, ids):
        choice = _whole(service, *ids)
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls"  # vLLM 0.32's derender: "stop"
        assert [c["id"][:14] for c in message["tool_calls"]] == ["chatcmpl-tool-"] * 2  # vLLM: 16 hex digits
        assert message["content"] == "\n\nOn it.\n"  # the stop token's text is not content
        assert message["reasoning"] == "\nTwo cities, two calls.\n"

    def test_streamed_length_finish_stays_length(self, service, ids):
        """As ``vllm serve``: only a ``stop`` finish becomes ``tool_calls`` (vLLM's derender rewrites any)."""
        prompt, output = ids
        _, _, state = _stream(service, prompt, output[:-2])  # both tool calls have started streaming
        assert state["tools_streamed"]
        body = _chunk(prompt, output[-2:-1], state)
        body["generate_chunk"]["choices"][0]["finish_reason"] = "length"
        assert json.loads(service.chat(body))["chunk"]["choices"][0]["finish_reason"] == "length"

    def test_parallel_tool_calls_false_keeps_the_first_call(self, service, ids):
        message = _whole(service, *ids, chat_request={**CHAT_REQUEST, "parallel_tool_calls": False})["message"]
        assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris"}]

    def test_hidden_reasoning_hides_logprobs_and_token_ids(self, service, ids):
        prompt, output = ids
        logprobs = {"content": [{"token_id": t, "logprob": -0.5, "top_logprobs": []} for t in output]}
        hidden = {**CHAT_REQUEST, "include_reasoning": False, "return_token_ids": True, "logprobs": True}
        choice = _whole(service, prompt, output, chat_request=hidden, logprobs=logprobs)
        assert choice["message"]["reasoning"] is None
        assert choice["logprobs"] is None and choice["token_ids"] is None
        shown = _whole(service, prompt, output, chat_request={**hidden, "include_reasoning": True}, logprobs=logprobs)
        assert len(shown["logprobs"]["content"]) == len(output) and shown["token_ids"] == output

    def test_streaming_keeps_and_bounds_logprobs(self, service, ids):
        prompt, output = ids
        body = _chunk(prompt, output[:2], None)
        body["generate_chunk"]["choices"][0]["logprobs"] = {
            "content": [{"token_id": t, "logprob": -1.0, "top_logprobs": [{"token_id": t, "logprob": -1.0}]} for t in output[:2]]
        }
        got = json.loads(service.chat(body))["chunk"]["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in got] == [service.model.tok.decode([t]) for t in output[:2]]
        entry = body["generate_chunk"]["choices"][0]["logprobs"]["content"][0]
        entry["top_logprobs"] = [{"token_id": t, "logprob": -1.0} for t in range(21)]
        with pytest.raises(ApiError, match="exceeds max_logprobs"):
            service.chat(body)

    def test_logprob_context_is_carried_only_when_logprobs_are(self, service, ids):
        """vLLM's parser path returns the logprob fields as sent; ours also keeps the context that
        resolves a split character in the logprobs it (unlike vLLM) streams, and only then."""
        prompt, output = ids
        *_, state = _stream(service, prompt, output[:6])
        assert state["logprob_context_token_ids"] == [] and state["logprob_text_offset"] == 0
        body = _chunk(prompt, output[:6], None)
        body["generate_chunk"]["choices"][0]["logprobs"] = {"content": [{"token_id": t, "logprob": -1.0} for t in output[:6]]}
        assert json.loads(service.chat(body))["stream_state"]["logprob_context_token_ids"] == output[2:6]

    @pytest.mark.parametrize(
        ("drop", "message"),
        [("chat_request", "chat_request is required"), ("prompt_token_ids", "prompt_token_ids is required")],
    )
    def test_stream_requires_chat_request_and_prompt(self, service, ids, drop, message):
        body = _chunk(*ids[:1], ids[1][:1], None)
        body[drop] = None
        with pytest.raises(ApiError, match=message) as exc:
            service.chat(body)
        assert exc.value.status_code == 400


class TestSessionCache:
    def test_stream_equals_non_streaming_and_hits_after_the_first_chunk(self, service, ids):
        prompt, output = ids
        for step in (1, 3):
            chunks, outcomes, _ = _stream(service, prompt, output, step)
            assert outcomes == ["new"] + ["hit"] * (len(outcomes) - 1)
            deltas = [c["choices"][0]["delta"] for c in chunks]
            whole = _whole(service, prompt, output)["message"]
            assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
            assert "".join(d.get("reasoning") or "" for d in deltas) == whole["reasoning"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    def test_a_retried_chunk_misses_and_replays_to_the_same_answer(self, service, ids):
        prompt, output = ids
        _, _, state = _stream(service, prompt, output[:20], finish=False)
        body = _chunk(prompt, output[20:21], {**state})
        first, outcome1 = service.chat_with_outcome(body)
        again, outcome2 = service.chat_with_outcome(body)  # the same state a second time
        assert (outcome1, outcome2) == ("hit", "miss")
        assert _normalized([json.loads(first)["chunk"]]) == _normalized([json.loads(again)["chunk"]])

    def test_same_shape_other_history_is_never_a_hit(self, service, ids):
        """Two states with equal lengths and tails (equal digests) but different history: the full
        comparison turns the digest match into a miss."""
        prompt, output = ids
        _, _, state = _stream(service, prompt, output[:30])
        forged = {**state, "output_token_ids": [output[5]] * 10 + state["output_token_ids"][10:]}
        _, outcome = service.chat_with_outcome(_chunk(prompt, output[30:31], forged))
        assert outcome == "miss"

    @pytest.mark.parametrize(
        "tamper",
        [
            lambda s: {**s, "output_token_ids": [-1] + s["output_token_ids"][1:]},  # not a token id
            lambda s: {**s, "output_chunk_lens": [0, 2] + s["output_chunk_lens"][2:]},  # a chunk of none, sum intact
            lambda s: {**s, "output_chunk_lens": [2] + s["output_chunk_lens"][1:]},  # sum off by one
        ],
    )
    @pytest.mark.parametrize("two_choices", [False, True])
    def test_a_live_streams_chunk_with_bad_carried_lists_is_the_full_validations_400(self, service, ids, tamper, two_choices):
        """A hit skips validating the carried output lists (the session's equal ones prove them):
        lists of the right length and tail that do not equal them get what the whole validation
        answers, before any later check (two choices), and the stream's session stays for its
        next, correct, chunk."""
        from pydantic import TypeAdapter

        from serve_app.protocol import DerenderChatRequestUnion
        from serve_app.wire import validate_model

        prompt, output = ids
        _, _, state = _stream(service, prompt, output[:30], finish=False)
        body = _chunk(prompt, output[30:31], tamper(state))
        if two_choices:
            choices = body["generate_chunk"]["choices"]
            choices.append({**choices[0], "index": 1})
        with pytest.raises(ApiError) as want:
            validate_model(TypeAdapter(DerenderChatRequestUnion), body)
        with pytest.raises(ApiError) as got:
            service.chat_with_outcome(body)
        assert (got.value.status_code, got.value.message, got.value.param) == (400, want.value.message, want.value.param)
        assert service.chat_with_outcome(_chunk(prompt, output[30:31], state))[1] == "hit"

    @pytest.mark.parametrize(
        "loosen",
        [
            lambda s: {**s, "output_token_ids": [float(t) for t in s["output_token_ids"]]},
            lambda s: {**s, "output_token_ids": [float(t) for t in s["output_token_ids"][:10]] + s["output_token_ids"][10:]},
            lambda s: {**s, "output_token_ids": [str(t) for t in s["output_token_ids"]]},
            lambda s: {**s, "output_chunk_lens": [True for _ in s["output_chunk_lens"]]},  # one-token chunks
        ],
    )
    def test_carried_lists_pydantic_takes_as_ints_still_hit(self, service, ids, loosen):
        """Ids as floats, strings or bools validate as today (pydantic's lax ints), so the stream still
        meets its session and carries ints on (floats before the tail: equal to the session's ids,
        a hit without validating them)."""
        prompt, output = ids
        _, _, state = _stream(service, prompt, output[:30], finish=False)
        out, outcome = service.chat_with_outcome(_chunk(prompt, output[30:31], loosen(state)))
        after = json.loads(out)["stream_state"]
        assert outcome == "hit" and after["output_token_ids"] == output[:31] and after["output_chunk_lens"] == [1] * 31
        assert all(type(t) is int for t in after["output_token_ids"] + after["output_chunk_lens"])

    def test_usage_only_chunk_needs_no_parser(self, service, ids):
        prompt, output = ids
        _, _, state = _stream(service, prompt, output)
        body = _chunk(prompt, [], state)
        body["generate_chunk"] = {"request_id": "s", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": len(output)}}
        out, outcome = service.chat_with_outcome(body)
        data = json.loads(out)
        assert outcome == "none" and data["stream_state"] == state
        assert data["chunk"]["usage"]["completion_tokens"] == len(output)

    def test_a_stream_continues_on_another_service_by_replay(self, service, ids):
        prompt, output = ids
        args = AppArgs(model="qwen3-tiny", tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True)
        other = asyncio.run(build_parser_service(args, args.resolve()))
        reference, _, _ = _stream(service, prompt, output)
        _, _, state = _stream(service, prompt, output[:25])
        moved, outcomes = [], []
        for i in range(25, len(output)):
            out, outcome = other.chat_with_outcome(_chunk(prompt, output[i : i + 1], state, i == len(output) - 1))
            data = json.loads(out)
            state = data["stream_state"]
            moved.append(data["chunk"])
            outcomes.append(outcome)
        assert outcomes == ["miss"] + ["hit"] * (len(outcomes) - 1)
        assert _normalized(moved) == _normalized(reference[25:])


def _normalized(chunks: list[dict]) -> list[dict]:
    """Chunks without what two runs legitimately differ in: timestamps and random tool-call ids."""
    text = json.dumps([{k: v for k, v in c.items() if k != "created"} for c in chunks])
    return json.loads(re.sub(r"chatcmpl-tool-[0-9a-f]+", "chatcmpl-tool-X", text))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "chat_request",
    [
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},  # vLLM's own check
        {"messages": "nope"},  # fails our light model too
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},  # only vLLM's full model
    ],
)
def test_invalid_chat_request_is_vllms_400(service, stream, chat_request):
    from pydantic import TypeAdapter
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import DerenderChatRequestUnion

    from serve_app._vllm import api_error
    from serve_app.wire import validate_model

    choice = {"index": 0, "token_ids": [1]}
    body = (
        {"stream": True, "generate_chunk": {"request_id": "g", "choices": [choice]}}
        if stream
        else {"generate_response": {"request_id": "g", "choices": [choice]}}
    )
    body |= {"chat_request": chat_request, "prompt_token_ids": [1]}
    with pytest.raises(ApiError) as ours:
        service.chat(body)
    try:
        validate_model(TypeAdapter(DerenderChatRequestUnion), body)
        raise AssertionError("vLLM accepted the body")
    except ApiError as exc:
        theirs = exc
    except Exception as exc:  # raised by vLLM's validators, answered by its exception handler
        theirs = api_error(exc)
    assert (ours.value.status_code, ours.value.message, ours.value.param) == (theirs.status_code, theirs.message, theirs.param)


class TestCarriedState:
    """The decode window the parser path passes through unread is checked as on the plain path."""

    @pytest.mark.parametrize(
        "window",
        [
            {"prev_tokens": ["a"], "prefix_offset": 0, "read_offset": 2},  # read past the window
            {"prev_tokens": ["a", "b"], "prefix_offset": 2, "read_offset": 1},  # prefix past read
            {"prev_tokens": ["not a piece!"], "prefix_offset": 0, "read_offset": 1},  # not in the vocabulary
        ],
    )
    def test_a_window_that_does_not_add_up_is_the_plain_paths_400(self, service, ids, window):
        from serve_app.derender.plain import build_plain_service

        prompt, output = ids
        *_, state = _stream(service, prompt, output[:3], finish=False)
        body = _chunk(prompt, output[3:4], {**state, **window})
        with pytest.raises(ApiError) as ours:
            service.chat(body)
        args = AppArgs(model="qwen3-tiny")
        with pytest.raises(ApiError) as plain:
            build_plain_service(args, args.resolve()).chat(body)
        assert ours.value.status_code == plain.value.status_code == 400
        assert ours.value.message == plain.value.message
        assert ours.value.message.startswith("invalid stream_state: ")


def _service_like(service, **cache):
    from serve_app.derender.parser_service import ParserDerenderService
    from serve_app.derender.sessions import SessionCache

    sessions = {"max_sessions": 100, "ttl_s": 60, "max_tokens": 1_000_000} | {k: v for k, v in cache.items() if k != "max_request_bytes"}
    return ParserDerenderService(service.model, service.kit, SessionCache(**sessions), cache.get("max_request_bytes", 32 << 20))


def test_request_cache_is_bounded_in_bytes_and_keeps_no_conversation(service, ids):
    import gc
    import tracemalloc

    from vllm.parser.utils import count_history_tool_calls

    prompt, output = ids
    history = [
        {"role": "user", "content": "earlier"},
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}] * 2},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]
    bound = 20_000  # ~2 KB a request once its messages are left out
    svc = _service_like(service, max_request_bytes=bound)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(20):  # twenty distinct ~1 MB requests
        big = {**CHAT_REQUEST, "messages": [*history, {"role": "user", "content": f"{i} " + "x" * 1_000_000}]}
        _whole(svc, prompt, output, chat_request=big)
        assert svc.request_bytes <= bound
    del big
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    largest = max(trace.size for trace in tracemalloc.take_snapshot().traces)
    tracemalloc.stop()
    configs = list(svc.configs.values())
    assert 1 < len(configs) < 20 and svc.request_bytes == sum(c.size for c in configs)
    # Not one request's conversation is left: each is a single 1 MB string. The total is only
    # bounded below one of them, since first calls into vLLM may fill its own lazy caches.
    assert largest < 100_000 and held < 1_000_000
    for config in configs:  # the parsers' view of the conversation is kept: the tool calls it made
        assert count_history_tool_calls(config.request) == 2 and len(config.request.messages) == 1


def test_a_request_configuration_leaves_the_callers_chat_request_as_sent(service):
    """vLLM's validation fills in ``tool_choice``; done on the caller's dict, a stream's next chunk
    sharing it would look its configuration (and so its session) up under another key."""
    import copy

    chat_request = {**copy.deepcopy(CHAT_REQUEST), "messages": [{"role": "user", "content": "as sent"}]}
    sent = copy.deepcopy(chat_request)
    first = service.request_config(chat_request)
    assert chat_request == sent and "tool_choice" not in chat_request
    assert service.request_config(chat_request) is first


def test_request_cache_is_exact_when_two_threads_fill_it(service):
    """The loop thread (stream chunks) and the worker thread (big non-streaming requests) both look
    configurations up and file them: the byte count and the bounds stay exact."""
    from tests.unit.test_sessions import race_in_two_threads

    svc = _service_like(service, max_request_bytes=30_000)

    def fill(offset: int) -> None:
        for i in range(150):
            svc.request_config({**CHAT_REQUEST, "messages": [{"role": "user", "content": f"{(i + offset) % 60}"}]})

    race_in_two_threads(fill)
    assert svc.request_bytes == sum(c.size for c in svc.configs.values()) <= 30_000


def _lexer(parser):
    """The special-token lexer vLLM's engine-based reasoning parser (qwen3 here) built for itself."""
    engine = parser._reasoning_parser._parser_engine._engine
    return engine.config, engine._lexer._shape, engine._resolved_token_ids


def _shape_fields(shape) -> tuple:
    terminals = [(t.name, t.pattern.pattern, t.is_literal, t.literal) for t in shape.terminals]
    return terminals, shape.literal_strings, shape.literal_first_chars, shape.prefix_set, shape.literals_by_first


def test_parsers_share_the_special_token_lexer_vllm_would_build_for_each(service, ids, monkeypatch):
    """``SharedDropInfo``: parsers of one config and tokenizer get one lexer, equal field for field to
    the one vLLM's own function builds, and an output parses the same with vLLM's function put back."""
    from vllm.parser.engine import streaming_parser_engine as engine

    from serve_app._vllm import SharedDropInfo

    shared = engine._build_drop_info
    assert isinstance(shared, SharedDropInfo)
    request = service.kit.ChatCompletionRequest.model_validate(CHAT_REQUEST)
    (config, shape, token_ids), (config2, shape2, token_ids2) = (_lexer(service.kit.new_parser(request, {})) for _ in range(2))
    assert config is config2 and shape is shape2 and token_ids == token_ids2
    own = shared.__wrapped__(config, service.kit.tokenizer)
    assert own.lexer_shape is not shape and _shape_fields(own.lexer_shape) == _shape_fields(shape)
    assert own.extra_token_ids.items() <= token_ids.items() and len(own.extra_token_ids) > 0

    prompt, output = ids

    def parsed() -> str:  # a whole answer and a stream, their random tool-call ids and clock times left out
        out = _whole(service, prompt, output), _stream(service, prompt, output, step=3)
        assert out[0]["message"]["tool_calls"] and out[0]["message"]["reasoning"]
        return re.sub(r'"created": \d+', '"created": 0', re.sub(r"chatcmpl-tool-[0-9a-f]+", "<id>", json.dumps(out)))

    with_shared = parsed()
    monkeypatch.setattr(engine, "_build_drop_info", shared.__wrapped__)
    assert parsed() == with_shared


def test_shared_lexers_are_bounded_and_rebuilt_once_evicted(service):
    from dataclasses import replace

    from serve_app._vllm import SharedDropInfo

    built: list[object] = []
    shared = SharedDropInfo(lambda config, tok: built.append(config) or object())
    config = _lexer(service.kit.new_parser(service.kit.ChatCompletionRequest.model_validate(CHAT_REQUEST), {}))[0]
    configs = [replace(config) for _ in range(SharedDropInfo.ENTRIES + 1)]
    first = shared(configs[0], service.kit.tokenizer)
    assert shared(configs[0], service.kit.tokenizer) is first and len(built) == 1
    for c in configs[1:]:
        shared(c, service.kit.tokenizer)
    assert len(shared.built) == SharedDropInfo.ENTRIES and len(built) == len(configs)
    assert shared(configs[0], service.kit.tokenizer) is not first and len(built) == len(configs) + 1  # evicted, built again


def _stream_chunk(request_id: str, prompt: list[int], ids: list[int], state: dict | None) -> dict:
    body = _chunk(prompt, ids, state)
    body["generate_chunk"]["request_id"] = request_id
    return body


def test_long_prompts_do_not_crowd_other_streams_out_of_the_session_cache(service, tok, ids):
    """A session keeps a digest of its prompt, not the ids, so the token budget is spent on outputs."""
    prompt, output = ids
    filler = tok.encode(" lorem ipsum" * 1500)[:3000]
    streams = [(f"long{i}", [*filler, *prompt]) for i in range(3)] + [(f"short{i}", prompt) for i in range(4)]
    svc = _service_like(service, max_tokens=300)  # less than one long prompt
    states: dict[str, dict | None] = dict.fromkeys(name for name, _ in streams)
    outcomes: dict[str, list[str]] = {name: [] for name, _ in streams}
    for start in range(0, 40, 4):  # the streams' chunks interleave
        for name, stream_prompt in streams:
            out, outcome = svc.chat_with_outcome(_stream_chunk(name, stream_prompt, output[start : start + 4], states[name]))
            states[name] = json.loads(out)["stream_state"]
            outcomes[name].append(outcome)
            assert svc.sessions.tokens <= 300
    assert all(o == ["new"] + ["hit"] * 9 for o in outcomes.values()), outcomes
    assert len(svc.sessions) == len(streams) and svc.sessions.tokens == 40 * len(streams)


def test_a_long_run_of_broken_utf8_decodes_with_bounded_work(service, ids, monkeypatch):
    """The parser path shares the plain path's detokenizer: no quadratic re-decoding of a held-back run."""
    prompt, output = ids
    tok = service.model.tok
    broken = next(i for i in range(tok.vocab_size) if tok.piece(i) == "ÿ")  # the byte 0xFF, never in UTF-8
    garbage = output[:8] + [broken] * 2000 + output[8:]
    decoded = [0]
    to_string = tok.tokens_to_string

    def counting(pieces: list[str]) -> str:
        decoded[0] += len(pieces)
        return to_string(pieces)

    monkeypatch.setattr(tok, "tokens_to_string", counting)
    whole = _whole(service, prompt, garbage)["message"]
    chunks, _, _ = _stream(service, prompt, garbage, step=50)
    assert decoded[0] <= 40 * 2 * len(garbage)  # vLLM: ~1000 pieces a token here
    streamed = "".join((c["choices"][0]["delta"].get("reasoning") or "") for c in chunks)
    assert streamed == whole["reasoning"] and whole["reasoning"].count("\ufffd") == 2000


# --- heavy parser work leaves the event loop (issue 13) ------------------------------------------


@pytest.fixture(scope="module")
def long_output(tok, ids) -> list[int]:
    """OUTPUT with a long reasoning part: ~3,000 tokens, within the model's 4,096 with the prompt."""
    prompt, _ = ids
    head, tail = OUTPUT.split("</think>")
    out = tok.encode(head + "Two cities, two calls. " * 500 + "</think>" + tail) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert 2500 < len(out) and len(prompt) + len(out) <= 4096
    return out


def _whole_body(prompt: list[int], output: list[int], n: int = 1) -> dict:
    choices = [{"index": i, "token_ids": output, "finish_reason": "stop"} for i in range(n)]
    return {"generate_response": {"request_id": "g", "choices": choices}, "prompt_token_ids": prompt, "chat_request": CHAT_REQUEST}


def _same_bytes(a: bytes, b: bytes) -> bool:
    """Equal up to what two runs legitimately differ in: the clock and random tool-call ids."""
    def norm(raw: bytes) -> bytes:
        return re.sub(rb"chatcmpl-tool-[0-9a-f]+", b"chatcmpl-tool-X", re.sub(rb'"created":\d+', b'"created":0', raw))

    return norm(a) == norm(b)


@pytest.fixture()
def off_loop(monkeypatch) -> list[tuple[str, str]]:
    """What the service hands to the worker thread: (function, the thread it ran on)."""
    import threading

    from serve_app.derender import parser_service

    calls: list[tuple[str, str]] = []
    run_off_loop = parser_service.run_off_loop

    async def spy(work, *args):
        def traced(*a):
            calls.append((work.__name__, threading.current_thread().name))
            return work(*a)

        return await run_off_loop(traced, *args)

    monkeypatch.setattr(parser_service, "run_off_loop", spy)
    return calls


class TestOffLoop:
    @pytest.mark.parametrize("offload", [True, False])
    def test_a_hit_chunk_answers_while_a_big_request_and_a_long_replay_parse(self, service, ids, long_output, monkeypatch, offload):
        """Liveness, not speed: a hit chunk of one stream that starts while a big non-streaming request
        and another stream's miss (replaying ~3,000 carried tokens) are parsing completes before them.
        With offloading off, both run to their end on the loop first: the hit waits."""
        from serve_app.derender import parser_service

        if not offload:
            monkeypatch.setattr(parser_service, "OFFLOAD_WORK", 1 << 62)
        svc = _service_like(service)
        prompt, output = ids
        *_, live = _stream(svc, prompt, output[:10], finish=False)
        *_, carried = _stream(svc, prompt, long_output[:-1], step=256, finish=False)
        big = _whole_body(prompt, long_output, n=4)
        miss = _stream_chunk("elsewhere", prompt, long_output[-1:], carried)  # another stream's key: no session
        hit = _chunk(prompt, output[10:11], live)

        async def run() -> list[tuple[str, str]]:
            finished: list[tuple[str, str]] = []

            async def call(name: str, body: dict) -> None:
                _, outcome = await svc.chat_with_outcome_async(body)
                finished.append((name, outcome))

            heavy = [asyncio.create_task(call("big", big)), asyncio.create_task(call("miss", miss))]
            await asyncio.sleep(0)  # both are checked, looked up and (offloading) handed to the worker
            await call("hit", hit)
            await asyncio.gather(*heavy)
            return finished

        expected = [("big", "none"), ("miss", "miss")]
        assert asyncio.run(run()) == ([("hit", "hit"), *expected] if offload else [*expected, ("hit", "hit")])

    def test_offloaded_answers_equal_inline_ones(self, service, ids, long_output, off_loop):
        svc = _service_like(service)
        prompt, _ = ids
        *_, carried = _stream(svc, prompt, long_output[:-1], step=256, finish=False)
        usage_only = _stream_chunk("ended", prompt, [], carried)
        usage_only["generate_chunk"] |= {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 9}}
        bodies = {
            "big": (_whole_body(prompt, long_output, n=2), "none"),
            "miss": (_stream_chunk("elsewhere", prompt, long_output[-1:], carried), "miss"),
            "usage-only miss": (usage_only, "none"),  # reasoning tokens: the stream's parser, replayed
        }
        for name, (body, outcome) in bodies.items():
            inline = svc.chat_with_outcome(body)
            off_loop.clear()
            offloaded = asyncio.run(svc.chat_with_outcome_async(body))
            assert len(off_loop) == 1 and off_loop[0][1].startswith("derender"), (name, off_loop)
            assert inline[1] == offloaded[1] == outcome, name
            assert _same_bytes(inline[0], offloaded[0]), name
        assert json.loads(offloaded[0])["chunk"]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 2000

    @pytest.mark.parametrize("what", ["one-token choices", "prompt_logprobs"])
    def test_work_the_size_bounds_did_not_count_goes_off_the_loop(self, service, ids, off_loop, what):
        """Issue 19: many one-token choices (each a fresh vLLM parser) and prompt_logprobs (validated
        entry by entry) are work too: such a request is parsed in the worker thread, same answer."""
        svc = _service_like(service)
        prompt, output = ids
        if what == "one-token choices":
            body = _whole_body(prompt, output[:1], n=64)
        else:
            body = _whole_body(prompt, output[:1])
            candidates = {str(i): {"logprob": -1.0, "rank": i + 1, "decoded_token": "a"} for i in range(20)}
            body["generate_response"]["prompt_logprobs"] = [None] + [candidates] * 400
        inline = svc.chat_with_outcome(body)
        offloaded = asyncio.run(svc.chat_with_outcome_async(body))
        assert len(off_loop) == 1 and off_loop[0][1].startswith("derender"), off_loop
        assert _same_bytes(inline[0], offloaded[0])

    def test_a_hit_chunk_parses_inline_whatever_its_history(self, service, ids, long_output, off_loop):
        """A hit's work is its delta: it never leaves the loop, even after ~3,000 carried tokens (far
        above OFFLOAD_WORK as the size check counts the body), nor do a new stream and a small answer."""
        svc = _service_like(service)
        prompt, output = ids
        *_, state = _stream(svc, prompt, long_output[:-1], step=256, finish=False)
        bodies = [
            (_chunk(prompt, long_output[-1:], state, last=True), "hit"),
            (_stream_chunk("fresh", prompt, output[:3], None), "new"),
            (_whole_body(prompt, output), "none"),
        ]
        for body, outcome in bodies:
            coro = svc.chat_with_outcome_async(body)
            with pytest.raises(StopIteration) as done:  # finished on its first step: it never suspended
                coro.send(None)
            assert done.value.value[1] == outcome
        assert off_loop == []


def test_a_lone_surrogate_in_the_chat_request_is_no_500(service, ids):
    """Valid JSON (``"\\ud800"``) that UTF-8 cannot encode: the request cache's byte count copes."""
    prompt, output = ids
    chat_request = {**CHAT_REQUEST, "messages": [{"role": "user", "content": "hi", "name": "\ud800"}], "user": "\udfff"}
    message = _whole(service, prompt, output, chat_request=chat_request)["message"]
    assert message["tool_calls"] and message["reasoning"]

"""Issue 19, classes 1-4, in-process over the real services (vLLM's render stack and parsers, the
qwen3-tiny tokenizer; no Ray): each class generated, not one example of it.

1. Request text that vLLM formats into an error message (model names, tool names, response ids)
   reaches vLLM's ``sanitize_message``, whose regexes backtracked; ours runs instead, everywhere.
2. A lone surrogate in any string of any route's body is a 400 naming the field (never a 500 while
   encoding the answer).
3. Whatever vLLM's request validators raise on a malformed value, at any depth of a chat request
   (render, or a derender ``chat_request``), is a 400.
4. Shapes no test sent: ``messages: []``, a choice aborted before its first token, negative and
   huge choice indices.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.config import AppArgs
from serve_app.derender.parser import build_parser_service
from serve_app.derender.plain import build_plain_service
from serve_app.errors import envelope
from serve_app.render import RenderService
from tests.hostile import CHAT_REQUEST, EXAMPLES, MESSAGES, PROMPT, ROUTES, mutations, string_positions, with_surrogate

ARGS = AppArgs(model="qwen3-tiny", tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True)

# route -> (service, method): the routes these services answer in-process ("plain_chat": chat
# derender without parsers, the PlainDerender path).
METHODS = {
    "/v1/chat/completions/render": ("render", "chat"),
    "/v1/completions/render": ("render", "completion"),
    "/v1/messages/render": ("render", "messages"),
    "/v1/responses/render": ("render", "responses"),
    "/tokenize": ("render", "tokenize"),
    "/detokenize": ("render", "detokenize"),
    "/v1/chat/completions/derender": ("parser", "chat_async"),
    "/v1/completions/derender": ("plain", "completion_async"),
}
IN_PROCESS = [(route, body) for route, body in EXAMPLES if route in METHODS]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def services(loop) -> dict[str, Any]:
    model = ARGS.resolve()
    render = loop.run_until_complete(RenderService.create(ARGS, model))
    parser = loop.run_until_complete(build_parser_service(ARGS, model, render.state))
    plain = build_plain_service(AppArgs(model="qwen3-tiny"), AppArgs(model="qwen3-tiny").resolve())
    return {"render": render, "parser": parser, "plain": plain}


def _encode(body: Any) -> bytes:
    # As a client would send it: escaped to ASCII (a lone surrogate travels as "\ud800"), ints in full.
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return json.dumps(body).encode()
    finally:
        sys.set_int_max_str_digits(limit)


def _answer(loop, services, route: str, body: Any, service: str | None = None) -> tuple[int, dict[str, Any]]:
    """``(status, JSON body)`` as the ingress would answer; an exception that is not an ApiError is a 500."""
    name, method = METHODS[route]
    try:
        out = loop.run_until_complete(getattr(services[service or name], method)(_encode(body)))
    except Exception as exc:
        return envelope(exc)
    return 200, json.loads(out)


FUZZ = settings(
    max_examples=150, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize(("route", "body"), IN_PROCESS, ids=[f"{r}{' stream' if b.get('stream') else ''}" for r, b in IN_PROCESS])
def test_every_example_body_is_valid(loop, services, route, body):
    """What the generators below mutate is a request the route answers: a 4xx is the mutation's doing."""
    status, answer = _answer(loop, services, route, body)
    assert status == 200, answer


# --- 1. request text in vLLM's error messages ---------------------------------------------------------


def test_every_vllm_module_that_sanitises_messages_runs_ours(services):
    from serve_app._vllm import vllm_sanitize_message
    from serve_app.errors import sanitize_message

    modules = [(name, vars(m)) for name, m in list(sys.modules.items()) if name.startswith("vllm.")]
    bound = {name: names["sanitize_message"] for name, names in modules if "sanitize_message" in names}
    assert "vllm.entrypoints.serve.exception_handling.error_response" in bound
    assert all(fn is sanitize_message for fn in bound.values()), [n for n, fn in bound.items() if fn is not sanitize_message]
    assert vllm_sanitize_message() is not sanitize_message  # the original stays reachable, for comparison


LONG = "/a" * 50_000  # vLLM's own sanitize_message: ~55 s at 20 KB, quadratic beyond


def _long_texts() -> list[tuple[str, dict[str, Any]]]:
    """Every place request text ends up in one of vLLM's error messages, on every route that has it."""
    cases = [(route, {**body, "model": LONG}) for route, body in IN_PROCESS if not body.get("stream")]
    cases += [
        ("/v1/chat/completions/render", {"messages": MESSAGES, "tools": CHAT_REQUEST["tools"],
                                         "tool_choice": {"type": "function", "function": {"name": LONG}}}),
        ("/v1/responses/render", {"input": "Hi", "previous_response_id": LONG}),
        ("/v1/chat/completions/render", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": LONG}}),
        ("/v1/completions/render", {"prompt": "Hi", "suffix": LONG}),
        ("/v1/chat/completions/derender", {**ROUTES["/v1/chat/completions/derender"], "chat_request": {**CHAT_REQUEST, "tool_choice": {
            "type": "function", "function": {"name": LONG}}}}),
    ]
    return cases


@pytest.mark.parametrize(("route", "body"), _long_texts(), ids=lambda v: v if isinstance(v, str) else "")
def test_long_request_text_in_a_vllm_error_is_a_bounded_4xx(loop, services, route, body):
    status, answer = _answer(loop, services, route, body)
    assert 400 <= status < 500, answer
    assert len(answer["error"]["message"]) <= 16384 + len("...[truncated]")


# --- 2. lone surrogates ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("route", "body"), IN_PROCESS, ids=[f"{r}{' stream' if b.get('stream') else ''}" for r, b in IN_PROCESS])
def test_a_lone_surrogate_in_any_string_is_a_400_naming_it(loop, services, route, body):
    positions = string_positions(body)
    assert positions
    for path, where in positions:
        status, answer = _answer(loop, services, route, with_surrogate(body, path, where)[0])
        named = with_surrogate(body, path, where)[1]
        assert status == 400 and answer["error"]["param"] == named, (path, where, answer)
        assert "string_unicode" in answer["error"]["message"]


# --- 3. vLLM's validators on malformed values, at any depth -------------------------------------------

CHAT_RENDER = {**CHAT_REQUEST, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}


@FUZZ
@given(data=st.data())
def test_a_malformed_chat_request_at_any_depth_is_never_a_5xx(loop, services, data):
    request = data.draw(mutations(CHAT_RENDER))
    for route, body in [
        ("/v1/chat/completions/render", request),
        ("/tokenize", request),
        ("/v1/chat/completions/derender", {**ROUTES["/v1/chat/completions/derender"], "chat_request": request}),
        ("/v1/chat/completions/derender", {"stream": True,
                                           "generate_chunk": {"request_id": "m", "choices": [{"index": 0, "token_ids": [9707]}]},
                                           "prompt_token_ids": PROMPT, "chat_request": request}),
    ]:
        status, answer = _answer(loop, services, route, body)
        assert status < 500, (route, answer)


@pytest.mark.parametrize(
    "field",
    [
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "function", "function": {}}]},
        {"tools": [{"type": "function", "function": "get_weather"}]},
        {"tools": [{"type": "function", "function": {"name": None}}]},
        {"tools": [None]},
        {"tool_choice": {"type": "function"}},
        {"tool_choice": {"type": "function", "function": "get_weather"}},
        {"tool_choice": {"type": "function", "function": {}}},
        {"structured_outputs": 5},
        {"structured_outputs": [1]},
        {"structured_outputs": "json"},
        {"response_format": 5},
        {"response_format": {"type": "json_schema"}},
        {"stream_options": 5},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": None}}},  # fuzz-found
    ],
)
@pytest.mark.parametrize("where", ["render", "derender", "derender stream"])
def test_the_shapes_vllm_validators_crash_on_are_a_400(loop, services, field, where):
    request = {**CHAT_RENDER, **field}
    if where == "render":
        route, body = "/v1/chat/completions/render", request
    else:
        route, body = "/v1/chat/completions/derender", {**ROUTES["/v1/chat/completions/derender"], "chat_request": request}
        if where == "derender stream":
            body = {**body, "stream": True, "generate_chunk": {"request_id": "s", "choices": [{"index": 0, "token_ids": [9707]}]}}
            body.pop("generate_response")
    status, answer = _answer(loop, services, route, body)
    assert status == 400, answer
    assert answer["error"]["type"] in {"BadRequestError", "Bad Request"}


# --- 4. shapes no test sent ------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_conversation_derenders_as_vllm_does(loop, services, add_generation_prompt, stream):
    request = {"messages": [], "add_generation_prompt": add_generation_prompt}
    ids = [9707, 1879]
    if stream:
        body = {"stream": True, "generate_chunk": {"request_id": "e", "choices": [{"index": 0, "token_ids": ids}]},
                "prompt_token_ids": PROMPT, "chat_request": request}
    else:
        body = {"generate_response": {"request_id": "e", "choices": [{"index": 0, "token_ids": ids}]}, "chat_request": request}
    status, answer = _answer(loop, services, "/v1/chat/completions/derender", body)
    assert status == 200, answer
    choice = (answer["chunk"] if stream else answer)["choices"][0]
    assert (choice["delta"] if stream else choice["message"])["role"] == "assistant"  # vLLM's derender's role


@pytest.mark.parametrize("token_ids", [[], None])
@pytest.mark.parametrize("service", ["parser", "plain"])
@pytest.mark.parametrize("route", ["/v1/chat/completions/derender", "/v1/completions/derender"])
def test_a_choice_aborted_before_its_first_token_is_a_finished_choice(loop, services, token_ids, service, route):
    if route == "/v1/completions/derender" and service == "parser":
        pytest.skip("completions never parse")
    choice = {"index": 0, "token_ids": token_ids, "finish_reason": "abort"}
    gen = {"request_id": "a", "choices": [choice]}
    body = {"generate_response": gen, "chat_request": {"messages": MESSAGES}} if "chat" in route else {"generate_responses": [gen]}
    status, answer = _answer(loop, services, route, body, service)
    assert status == 200, answer
    out = answer["choices"][0]
    assert out["finish_reason"] == "abort"
    assert not (out["message"]["content"] if "chat" in route else out["text"])
    # Any other finish with no token is still vLLM's 400.
    status, answer = _answer(loop, services, route, json.loads(json.dumps(body).replace('"abort"', '"stop"')), service)
    assert status == 400 and "empty or null token_ids" in answer["error"]["message"]


@pytest.mark.parametrize("index", [-1, -(2**31), 2**31, 0])
@pytest.mark.parametrize("service", ["parser", "plain"])
def test_any_choice_index_streams_and_is_echoed(loop, services, index, service):
    """vLLM echoes a stream choice's index, whatever int it is. Two streams of one request, index 0
    finished and ``index`` live, never share a parser session (``-1`` was the finished slot)."""
    route = "/v1/chat/completions/derender"
    finished = {"stream": True, "prompt_token_ids": PROMPT, "chat_request": {"messages": MESSAGES},
                "generate_chunk": {"request_id": "i", "choices": [{"index": 0, "token_ids": [9707], "finish_reason": "stop"}]}}
    status, answer = _answer(loop, services, route, finished, service)
    assert status == 200, answer
    body = {**finished, "generate_chunk": {"request_id": "i", "choices": [{"index": index, "token_ids": [9707]}]}}
    first_status, first = _answer(loop, services, route, body, service)
    assert first_status == 200, first
    assert first["chunk"]["choices"][0]["index"] == index
    body = {**body, "stream_state": first["stream_state"],
            "generate_chunk": {"request_id": "i", "choices": [{"index": index, "token_ids": [1879], "finish_reason": "stop"}]}}
    status, answer = _answer(loop, services, route, body, service)
    assert status == 200, answer
    assert answer["chunk"]["choices"][0]["index"] == index
    assert answer["stream_state"]["role_sent"] is True

"""Hostile-input generators shared by the fuzz suite and the issue-19 tests.

A valid example body for every route, with a value at every depth a client can send (chat_request
tools and tool_choice, logprob entries, stream_state, prompt_logprobs), and strategies that mutate
any one of those values, wherever it sits, or put a lone surrogate into any string (value or key).
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from serve_app.errors import clean_loc
from tests.harness.payloads import MINIMAL_WEATHER_TOOLS

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
MESSAGES = [{"role": "user", "content": "Hi"}]
NAMED_TOOL_CHOICE = {"type": "function", "function": {"name": "get_weather"}}


def _entry(token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token_id": token_id,
        "logprob": logprob,
        "rank": 1,
        "top_logprobs": [{"token_id": token_id, "logprob": logprob, "rank": 1}, {"token_id": 1879, "logprob": -3.0, "rank": 2}],
    }


LOGPROBS = {"content": [_entry(9707, -0.5), _entry(1879, -1.0)]}
CHAT_REQUEST: dict[str, Any] = {
    "messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    ]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "tools": MINIMAL_WEATHER_TOOLS,
    "tool_choice": "auto",
    "stop": ["\n\n"],
    "logprobs": True,
    "top_logprobs": 2,
    "chat_template_kwargs": {"enable_thinking": False},
}
PARSER_STATE = {  # what the parser path carries after one chunk of two tokens
    "prev_tokens": [],
    "prefix_offset": 0,
    "read_offset": 0,
    "role_sent": True,
    "logprob_context_token_ids": [],
    "logprob_text_offset": 0,
    "output_token_ids": [9707, 1879],
    "output_chunk_lens": [2],
    "tools_streamed": False,
    "last_tool_call_ids": ["chatcmpl-tool-0123456789abcdef"],
}
PLAIN_STATE = {  # what the completions stream carries after "Hello"
    "prev_tokens": ["Hello"],
    "prefix_offset": 0,
    "read_offset": 1,
    "role_sent": False,
    "logprob_context_token_ids": [9707],
    "logprob_text_offset": 5,
    "output_token_ids": [],
    "output_chunk_lens": [],
    "tools_streamed": False,
    "last_tool_call_ids": [],
}
CHUNK = {
    "request_id": "fuzz",
    "choices": [{"index": 0, "token_ids": [9707, 1879], "finish_reason": None, "stop_reason": None, "logprobs": LOGPROBS}],
}
GENERATE_RESPONSE = {
    "request_id": "g",
    "prompt_logprobs": [None, {"872": {"logprob": -1.0, "rank": 1, "decoded_token": "user"}}],
    "choices": [{"index": 0, "token_ids": [9707, 1879, 151645], "finish_reason": "stop", "stop_reason": None, "logprobs": {
        "content": [*LOGPROBS["content"], _entry(151645, -0.1)]}}],
}

# route -> a valid body (engine routes get small max_tokens so a valid mutation stays cheap)
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions/render": {**CHAT_REQUEST, "tool_choice": NAMED_TOOL_CHOICE, "max_tokens": 4},
    "/v1/completions/render": {"prompt": ["Hi", "There"], "max_tokens": 4, "stop": ["\n"], "logit_bias": {"9707": 1.0}},
    "/v1/messages/render": {
        "model": "qwen3-tiny", "max_tokens": 4, "system": "Be brief.", "messages": MESSAGES,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    },
    "/v1/responses/render": {
        "input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 4, "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}],
    },
    "/tokenize": {"messages": MESSAGES, "tools": MINIMAL_WEATHER_TOOLS, "add_generation_prompt": True},
    "/detokenize": {"model": "qwen3-tiny", "tokens": [9707, 1879]},
    "/v1/chat/completions/derender": {
        "generate_response": GENERATE_RESPONSE,
        "prompt_token_ids": PROMPT,
        "prompt_tokens": len(PROMPT),
        "chat_request": CHAT_REQUEST,
    },
    "/v1/completions/derender": {
        "generate_responses": [GENERATE_RESPONSE],
        "prompt_token_ids": [PROMPT],
        "prompt_tokens": [len(PROMPT)],
        "completion_request": {"prompt": "Hi", "skip_special_tokens": True},
    },
    "/inference/v1/generate": {
        "token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0, "stop_token_ids": [151645]},
    },
    # (no stop strings: the tokens-only engine refuses them, as vLLM's)
    "/v1/chat/completions": {**{k: v for k, v in CHAT_REQUEST.items() if k != "stop"}, "max_tokens": 2, "temperature": 0},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "logprobs": 2},
    "/abort_requests": {"request_ids": ["fuzz-none"]},
}
STREAM_ROUTES: dict[str, dict[str, Any]] = {  # the derender stream bodies (same paths, "stream": true)
    "/v1/chat/completions/derender": {
        "stream": True, "generate_chunk": CHUNK, "stream_state": PARSER_STATE, "prompt_token_ids": PROMPT,
        "chat_request": CHAT_REQUEST,
    },
    "/v1/completions/derender": {
        "stream": True, "generate_chunk": CHUNK, "stream_state": PLAIN_STATE, "prompt_token_ids": PROMPT,
        "completion_request": {"prompt": "Hi"},
    },
}
EXAMPLES: list[tuple[str, dict[str, Any]]] = [*ROUTES.items(), *STREAM_ROUTES.items()]

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**5000, -1, -(2**31), 2**32, 2**64, 0.5, -0.0, "false", "true", "0"]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "x" * 100_000, "/a" * 10_000, "\ud800", "<|im_end|>", "<tool_call>", "../../etc/passwd"]),
    st.lists(st.integers(min_value=-5, max_value=2**33), max_size=20),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=4),
    st.sampled_from([[[[[[[[[[[]]]]]]]]]], {"a": {"b": {"c": {}}}}, [None] * 50, [], {}, [{}], {"name": 1}]),
)

Path = tuple[Any, ...]


def value_paths(body: Any, prefix: Path = ()) -> list[Path]:
    """The path (keys and list indices) to every value in ``body``, at every depth."""
    out: list[Path] = []
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += value_paths(value, (*prefix, key))
    return out


def string_positions(body: Any) -> list[tuple[Path, str]]:
    """Every string a client sends: ``(path, "value")`` for string values, ``(path, "key")`` for keys."""
    out: list[tuple[Path, str]] = []
    for path in value_paths(body):
        if isinstance(path[-1], str):
            out.append((path, "key"))
        if isinstance(get(body, path), str):
            out.append((path, "value"))
    return out


def get(body: Any, path: Path) -> Any:
    for key in path:
        body = body[key]
    return body


def mutate(body: Any, path: Path, value: Any, action: str) -> Any:
    """A copy of ``body`` with the value at ``path`` replaced, dropped, or a sibling added."""
    out = copy.deepcopy(body)
    holder = get(out, path[:-1])
    key = path[-1]
    if action == "drop":
        del holder[key]
    elif action == "extra":
        if isinstance(holder, dict):
            holder["fuzz_unknown_key"] = value
        else:
            holder.append(value)
    else:
        holder[key] = value
    return out


def mutations(body: dict[str, Any], values: st.SearchStrategy[Any] = HOSTILE) -> st.SearchStrategy[Any]:
    """One value anywhere in ``body`` (any depth) replaced, dropped, or a sibling added."""
    actions = st.sampled_from(["replace", "replace", "drop", "extra"])
    return st.builds(mutate, st.just(body), st.sampled_from(value_paths(body)), values, actions)


SURROGATE = "\ud800"


def with_surrogate(body: Any, path: Path, where: str, surrogate: str = SURROGATE) -> tuple[Any, str]:
    """``body`` with a lone surrogate in the string at ``path`` (its value, or its key), and the
    ``param`` the 400 must name: the string's own path, or for a key the object holding it."""
    out = copy.deepcopy(body)
    holder = get(out, path[:-1])
    key = path[-1]
    if where == "key":
        holder[key + surrogate] = holder.pop(key)
        named = path[:-1]
    else:
        holder[key] = holder[key] + surrogate
        named = path
    return out, clean_loc(("body", *named))  # as vLLM words a loc (internal names such as "arguments" dropped)


# --- byte-level headers (issue 19): what a raw socket can put in a header line ----------------------

# Every byte but CR, LF and NUL (which end or break the line): latin-1 range, 0x80-0xff, controls.
HEADER_BYTE = st.integers(min_value=1, max_value=255).filter(lambda b: b not in (10, 13))
HEADER_VALUE = st.one_of(
    st.lists(HEADER_BYTE, max_size=60).map(bytes),
    st.text(max_size=30).map(lambda s: s.encode("utf-8", "surrogatepass")),  # valid UTF-8 (and lone surrogates)
    st.sampled_from([b"\xff" * 3000, b"a" * 4000, b"\xc3\xa9t\xc3\xa9", b"\xe9t\xe9", b"-1", b"0", b"1e309", b"nan", b" "]),
)
# The headers the app, vLLM and Ray read (content-length mismatches are framing, not here).
READ_HEADERS = [
    b"x-request-id", b"x-session-id", b"x_session_id", b"content-type", b"authorization",
    b"x-request-timeout-seconds", b"x-data-parallel-rank", b"serve_multiplexed_model_id", b"x-request-disconnect-disabled",
]
NAME_BYTE = HEADER_BYTE.filter(lambda b: b != ord(":"))
HEADER_NAME = st.one_of(st.sampled_from(READ_HEADERS), st.lists(NAME_BYTE, min_size=1, max_size=20).map(bytes))
# Ray Serve's Python proxy decodes these as UTF-8 before the app is called (ray/serve/_private/proxy.py,
# ``_setup_request_context_and_handle``): every header *name*, and the values of the request id,
# session id and multiplexed-model id headers; http_util decodes the timeout and disconnect headers' values.
PROXY_DECODED_VALUES = {b"x-request-id", b"x-session-id", b"x_session_id", b"serve_multiplexed_model_id",
                        b"x-request-timeout-seconds", b"x-request-disconnect-disabled"}

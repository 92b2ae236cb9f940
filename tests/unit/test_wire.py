"""The wire helpers: the orjson fast paths give exactly what the json module (Starlette, FastAPI) gives."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.errors import ApiError, envelope
from serve_app.wire import (
    MAX_JSON_DEPTH,
    check_engine_ints,
    dump_json,
    dump_json_floatless,
    dump_json_ids,
    load_answer,
    load_body,
    parse_json,
    stream_flag,
)
from tests.hostile import string_positions, with_surrogate


def test_floatless_dump_equals_starlette_for_every_code_point():
    chars = "".join(chr(cp) for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF)
    for i in range(0, len(chars), 4096):
        content = {"prev_tokens": ["a" + chars[i : i + 4096] + "\\\"", ""], "ids": [0, 151645, -1], "ok": True, "x": None}
        assert dump_json_floatless(content) == dump_json(content)


def test_floatless_dump_falls_back_beyond_64_bit_ints():
    assert dump_json_floatless({"ids": [2**70]}) == dump_json({"ids": [2**70]})


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None, database=None)
@given(
    before=st.dictionaries(st.text(max_size=9), _ANY, max_size=3),
    after=st.dictionaries(st.text(max_size=9), _ANY, max_size=3),
    ids=st.lists(st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from([True, 1.5, 1e16, "7"]), min_size=60, max_size=90)
    | st.lists(st.integers(min_value=-1, max_value=300_000), min_size=60, max_size=300),
)
def test_ids_dump_equals_starlette(before, after, ids):
    """Whatever surrounds the list (floats and the key itself nested, before and after) and whatever it
    holds (big ints, bools, floats, strings: each written by json instead), the bytes are dump_json's."""
    content = {**{k: v for k, v in before.items() if k != "token_ids"}, "token_ids": ids,
               **{k: v for k, v in after.items() if k not in before and k != "token_ids"}}
    try:
        expected = dump_json(content)
    except ValueError:  # NaN and infinity: json refuses them, and so must the fast path
        with pytest.raises(ValueError):
            dump_json_ids(content, "token_ids")
        return
    assert dump_json_ids(content, "token_ids") == expected


@pytest.mark.parametrize("content", [
    {"request_id": "chatcmpl-x", "token_ids": list(range(100)), "sampling_params": {"temperature": 1e-5, "top_p": 0.95}},
    {"a": 'é\u2028"token_ids":null', "x": {"token_ids": None}, "token_ids": list(range(-5, 95)), "y": [1e16]},
    {1: "an int key", "token_ids": list(range(100))},
    {"token_ids": list(range(10))},  # short: all of it json
    {"token_ids": [2**63 + 1] * 70},  # past 64 bits: orjson refuses, json writes it
])
def test_ids_dump_equals_starlette_on_edge_cases(content):
    assert dump_json_ids(content, "token_ids") == dump_json(content)


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": 1, "a": 2}',
        b'{"big": 123456789012345678901234567890}',
        b'{"f": 1e308, "g": 0.1, "h": -0.0, "i": 12345678901234567890.5}',
        '{"u": "\u00e9\u6771"}'.encode("utf-16"),
        b'[1, 2, {"k": [true, false, null]}]',
    ],
)
def test_parse_equals_json_module(body):
    got, want = parse_json(body), json.loads(body)
    assert json.dumps(got) == json.dumps(want)


@pytest.mark.parametrize(
    "answer",
    [
        dump_json({"ids": [2**70, -(2**63) - 1, 2**64], "n": 10**30}),  # past 64 bits: orjson would read floats
        b'{"text":"\\ud800 lone","ok":true}',  # orjson refuses an escaped lone surrogate
        dump_json({"f": 1e308, "g": 0.1, "h": -0.0, "i": 5e-324, "u": "\u00e9\u6771\U0001f600", "x": None}),
        dump_json_floatless({"stream_state": {"output_token_ids": list(range(4000)), "prev_tokens": ["\u0120a", "\\\""]}}),
    ],
)
def test_load_answer_reads_what_json_reads(answer):
    got, want = load_answer(answer), json.loads(answer)
    assert json.dumps(got) == json.dumps(want) and type(got) is type(want)


@pytest.mark.parametrize("body", [b"{", b'{"a": }', b"\xff\xfe\xfd", b'{"a": 1} x'])
def test_malformed_bodies_keep_fastapi_errors(body):
    with pytest.raises(ApiError) as got:
        parse_json(body)
    try:
        json.loads(body)
    except json.JSONDecodeError as exc:
        assert "JSON decode error" in got.value.message and exc.msg in got.value.message
    except UnicodeDecodeError:
        assert got.value.message == "There was an error parsing the body"


# --- hostile bodies: 400s in vLLM's envelope, never a 500 from the parser or later -------------------


def _nested(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"a":' * (depth - 1) + b"[" + inner + b"]" + b"}" * (depth - 1)


def _bad_request(body) -> dict:
    with pytest.raises(ApiError) as got:
        load_body(body)
    status, env = envelope(got.value)
    assert status == 400 == env["error"]["code"]
    return env["error"]


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 1023, 1025, 5000, 100_000])
@pytest.mark.parametrize("inner", [b"1", b"12345678901234567890123"])  # orjson, and the json fallback
def test_deep_nesting_is_a_400(depth, inner):
    err = _bad_request(_nested(depth, inner))
    assert (err["type"], err["message"]) == ("BadRequestError", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    _bad_request(_nested(depth, inner).decode())  # a str body too


def test_deep_nesting_inside_a_chat_request_is_a_400():
    body = b'{"generate_response": {}, "chat_request": {"messages": [' + b"[" * 3000 + b"]" * 3000 + b"]}}"
    assert _bad_request(body)["message"] == f"JSON nested deeper than {MAX_JSON_DEPTH} levels"


def test_nesting_up_to_the_limit_parses():
    assert parse_json(_nested(MAX_JSON_DEPTH)) == json.loads(_nested(MAX_JSON_DEPTH))
    assert parse_json(_nested(MAX_JSON_DEPTH, b"12345678901234567890123")) is not None
    many = {"content": [{"token_id": i, "top_logprobs": [{"token_id": i}]} for i in range(500)]}  # many brackets, shallow
    assert parse_json(json.dumps(many).encode()) == many


def test_integers_past_4300_digits_are_a_400():
    assert parse_json(b'{"n": ' + b"9" * 4300 + b"}") == {"n": int("9" * 4300)}
    err = _bad_request(b'{"token_ids": [' + b"9" * 4301 + b"]}")
    assert (err["type"], err["message"]) == ("Bad Request", "There was an error parsing the body")  # FastAPI's words


@pytest.mark.parametrize(
    "body", [b'{"logprob": NaN}', b'{"logprob": Infinity}', b'{"logprob": -Infinity}', b'{"logprob": 1e999}', b"[-1e400]"]
)
def test_nan_and_infinity_are_a_400(body):
    err = _bad_request(body)
    assert (err["type"], err["message"]) == ("BadRequestError", "Out of range float values are not JSON compliant")


@pytest.mark.parametrize("value", [True, False, None])
def test_stream_flag_takes_json_booleans(value):
    assert stream_flag({"stream": value}) is bool(value)
    assert stream_flag({}) is False and stream_flag([{"stream": True}]) is False


@pytest.mark.parametrize("value", ["false", "true", "", 0, 1, [], {}, 0.0])
def test_stream_flag_rejects_anything_else(value):
    with pytest.raises(ApiError) as got:
        stream_flag({"stream": value})
    status, env = envelope(got.value)
    assert status == 400 and env["error"]["param"] == "body.stream"
    assert "Input should be a valid boolean" in env["error"]["message"]


# --- lone surrogates (issue 19): refused once, at the wire, naming the string ---------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)
_SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])


@settings(max_examples=300, deadline=None, database=None)
@given(doc=st.dictionaries(st.text(max_size=5), _JSON, min_size=1, max_size=4), data=st.data(), as_str=st.booleans())
def test_a_lone_surrogate_anywhere_is_a_400_naming_it(doc, data, as_str):
    positions = string_positions(doc)
    if not positions:
        return
    path, where = data.draw(st.sampled_from(positions))
    body, param = with_surrogate(doc, path, where, data.draw(_SURROGATES))
    text = json.dumps(body)
    with pytest.raises(ApiError) as got:
        parse_json(text if as_str else text.encode())
    status, envelope_body = envelope(got.value)
    assert status == 400 and envelope_body["error"]["param"] == param
    dump_json(envelope_body)  # the answer itself encodes


@settings(max_examples=300, deadline=None, database=None)
@given(doc=_JSON)
def test_valid_pairs_and_escaped_backslashes_still_parse(doc):
    text = json.dumps({"doc": doc, "pair": "\U0001f600", "literal": "\\ud800"})  # "\ud83d\ude00", "\\ud800"
    assert parse_json(text.encode()) == json.loads(text)


# --- integers the engine cannot carry (msgpack's 64 bits) ----------------------------------------------

_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=5))
_JSON = st.recursive(
    _JSON_LEAF, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3), max_leaves=12
)


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(st.text(max_size=4), _JSON, max_size=4))
def test_engine_ints_in_range_pass_and_msgpack_carries_them(body):
    import msgspec

    check_engine_ints(body)
    msgspec.msgpack.encode(body)  # what vLLM sends its EngineCore


@settings(max_examples=200, deadline=None)
@given(
    body=st.dictionaries(st.text(max_size=4), _JSON, min_size=1, max_size=4),
    big=st.one_of(st.integers(max_value=-(2**63) - 1), st.integers(min_value=2**64)),
    data=st.data(),
)
def test_an_engine_int_out_of_range_anywhere_is_a_400_naming_its_field(body, big, data):
    import msgspec

    # Put it at a random depth: under a key of the body, or inside a value that is an object or list.
    key = data.draw(st.sampled_from(sorted(body)))
    body = {**body, key: {"x": [big]} if data.draw(st.booleans()) else big}
    with pytest.raises(OverflowError):
        msgspec.msgpack.encode(body)  # vLLM's send to its EngineCore would fail after validation
    with pytest.raises(ApiError) as got:
        check_engine_ints(body)
    status, err = envelope(got.value)
    assert status == 400 and err["error"]["param"].startswith(key) and "out of range" in err["error"]["message"]


def test_engine_token_ids_are_left_to_their_own_check():
    check_engine_ints({"token_ids": [2**70], "sampling_params": {"seed": 2**63 - 1}})

"""The wire helpers: the orjson fast paths give exactly what the json module (Starlette, FastAPI) gives."""

from __future__ import annotations

import json

import pytest

from serve_app.errors import ApiError
from serve_app.wire import dump_json, dump_json_floatless, parse_json


def test_floatless_dump_equals_starlette_for_every_code_point():
    chars = "".join(chr(cp) for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF)
    for i in range(0, len(chars), 4096):
        content = {"prev_tokens": ["a" + chars[i : i + 4096] + "\\\"", ""], "ids": [0, 151645, -1], "ok": True, "x": None}
        assert dump_json_floatless(content) == dump_json(content)


def test_floatless_dump_falls_back_beyond_64_bit_ints():
    assert dump_json_floatless({"ids": [2**70]}) == dump_json({"ids": [2**70]})


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": 1, "a": 2}',
        b'{"x": NaN, "y": Infinity}',
        b'{"big": 123456789012345678901234567890}',
        b'{"f": 1e400, "g": 0.1, "h": -0.0}',
        '{"u": "\u00e9\u6771"}'.encode("utf-16"),
        b'[1, 2, {"k": [true, false, null]}]',
    ],
)
def test_parse_equals_json_module(body):
    got, want = parse_json(body), json.loads(body)
    assert json.dumps(got) == json.dumps(want)


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

"""JSON in and out at the wire, byte-compatible with vLLM's FastAPI server, and the HTTP edge's small
helpers: a stream chunk's routing key read from the raw body (:func:`stream_id`), the headers passed
on to the engine, and a JSON answer from ASGI middleware (:func:`send_json`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import orjson

from serve_app.errors import BadRequestError, RequestValidationFailed, invalid_request, validation_error

__all__ = [
    "MAX_JSON_DEPTH",
    "check_engine_ints",
    "check_json_content_type",
    "dump_json",
    "dump_json_floatless",
    "dump_json_ids",
    "forwarded_headers",
    "load_answer",
    "load_body",
    "parse_json",
    "send_json",
    "stream_flag",
    "stream_id",
    "validate_model",
]

MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects a body may have. Deeper values break later, as 500s:
pickling across Ray handles (~500 levels), pydantic and orjson serialisation (255), ``copy.deepcopy``."""


def dump_json(content: Any) -> bytes:
    """Exactly Starlette's ``JSONResponse.render``, which vLLM's routes use."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


_DIGITS_TO_NINE = bytes.maketrans(b"012345678", b"999999999")
_LONG_DIGIT_RUN = b"9" * 19


def _has_long_digit_run(body: bytes | bytearray) -> bool:
    # translate + find run in C: several times faster than a regex over a large state's id lists.
    return _LONG_DIGIT_RUN in body.translate(_DIGITS_TO_NINE)


def dump_json_floatless(content: Any) -> bytes:
    """``dump_json`` for content without floats (ids, strings, bools), several times faster.

    orjson writes strings, ints, bools and null exactly as ``dump_json`` does (checked over every
    code point in ``tests/unit/test_wire.py``); floats it formats differently, hence the name.
    """
    try:
        return orjson.dumps(content)
    except (TypeError, orjson.JSONEncodeError):  # e.g. an int beyond 64 bits: the reference path
        return dump_json(content)


_INT_LIST_BYTES = b"0123456789,-[]"


def dump_json_ids(content: dict[str, Any], key: str) -> bytes:
    """``dump_json(content)``, byte for byte, with ``content[key]`` (a prompt's token ids) written by
    orjson: ~15x faster on a long list of ints, which is most of a render answer's bytes.

    ``json.dumps`` writes a dict as ``{`` + the items joined by ``,`` + ``}``, in order, so the items
    before and after ``key`` are written by ``dump_json`` itself and only the list is orjson's. That
    list is used only when orjson's bytes are plain ints (digits, minus signs, commas, brackets: no
    float, bool or string, which the two write differently or not at all); else all of it is ``dump_json``.
    """
    ids = content.get(key)
    if type(ids) is list and len(ids) >= 64:
        try:
            fast = orjson.dumps(ids)
        except orjson.JSONEncodeError:  # an int past 64 bits
            fast = b""
        if fast and not fast.translate(None, _INT_LIST_BYTES):
            keys = list(content)
            at = keys.index(key)
            before = dump_json({k: content[k] for k in keys[:at]})[1:-1]
            after = dump_json({k: content[k] for k in keys[at + 1 :]})[1:-1]
            items = [part for part in (before, dump_json(key) + b":" + fast, after) if part]
            return b"{" + b",".join(items) + b"}"
    return dump_json(content)


def load_answer(raw: bytes | bytearray) -> Any:
    """JSON this app wrote (a deployment's answer) as ``json.loads`` reads it, by orjson where that is
    the same (:func:`_fast_loads`). Unlike a request body, no depth or finite-number check: an answer
    a client could not read would be a failure on a valid response."""
    data = _fast_loads(raw)
    return json.loads(raw) if data is _NOT_FAST else data


_NOT_FAST = object()  # not JSON's null: _fast_loads's "orjson may not read this as json.loads does"


def _fast_loads(body: bytes | bytearray) -> Any:
    """``body`` read by orjson, several times faster than ``json`` on a large carried stream state;
    :data:`_NOT_FAST` where orjson may not read it as ``json.loads`` does: a 19+ digit run (orjson reads
    ints past 64 bits as floats) or anything it refuses (NaN, 1e999, nesting past 1024, an escaped
    lone surrogate, malformed input), for the ``json`` module to decide."""
    if _has_long_digit_run(body):
        return _NOT_FAST
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return _NOT_FAST


def check_json_content_type(content_type: str | None) -> None:
    """vLLM's ``validate_json_request``: only ``application/json`` bodies, else a 400."""
    media_type = (content_type or "").lower().split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        raise RequestValidationFailed("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed")


class _NotFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e999
        raise _NotFinite(text)
    return value


def _no_constant(text: str) -> Any:  # NaN, Infinity, -Infinity
    raise _NotFinite(text)


def _too_deep() -> BadRequestError:
    return BadRequestError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels: level by level, no recursion."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
        if not level:
            return False
    return True


_ENGINE_INT_MIN, _ENGINE_INT_MAX = -(2**63), 2**64 - 1


def check_engine_ints(data: Any, skip: str = "token_ids") -> None:
    """Every integer in an engine request fits the msgpack vLLM sends to its EngineCore: outside it the
    send fails (``OverflowError``) after validation, a 500 in vLLM. Free-form fields (template kwargs a
    reasoning parser carries, ``vllm_xargs``) take any JSON integer, so the client's value is named in a
    400 here. ``skip``: a top-level key already bounded (token ids are u32). Iterative, linear."""
    pending: list[tuple[str, Any]] = [(k, v) for k, v in data.items() if k != skip] if isinstance(data, dict) else []
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            pending.extend((f"{path}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            pending.extend((f"{path}.{i}", v) for i, v in enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool) and not _ENGINE_INT_MIN <= value <= _ENGINE_INT_MAX:
            raise BadRequestError(f"{path}: integer out of range (the engine takes -2**63 to 2**64-1)", param=path)


def _check_depth(body: bytes | bytearray | str, data: Any) -> Any:
    # Counting brackets (in C) rules out deep nesting for most bodies without walking them.
    raw = body if isinstance(body, (bytes, bytearray)) else body.encode("utf-8", "surrogatepass")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(data, MAX_JSON_DEPTH):
        raise _too_deep()
    return data


# A lone surrogate reaches a parsed body only as a JSON escape ("\ud800"; raw bytes must be UTF-8),
# or, in a str body, as the code point itself (UTF-8 encoded with surrogatepass: 0xED 0xA0-0xBF).
# Each is searched only when its literal prefix is in the body at all (a C scan, ~1 ms for 17 MB:
# one regex with both branches took as long as parsing the body).
# A high surrogate not followed by a low one, or a low one not after a high one: a valid pair (an
# emoji as json.dumps writes it) is no reason to walk the body.
_SURROGATE_ESCAPE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]"
)
_SURROGATE_CODE_POINT = re.compile(rb"\xed[\xa0-\xbf]")


def _may_hold_surrogate(raw: bytes | bytearray, code_points: bool) -> bool:
    """``code_points``: the body came as a str (bytes that parsed are UTF-8, which has none)."""
    return (b"\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None) or (
        code_points and b"\xed" in raw and _SURROGATE_CODE_POINT.search(raw) is not None
    )


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_surrogates(raw: bytes | bytearray, data: Any, code_points: bool = False) -> Any:
    """A 400 naming the first string (value or key) that holds a lone surrogate.

    ``"\ud800"`` is valid JSON but no UTF-8 response can hold it: echoed anywhere (an id, a model
    name, a stop string, a carried tool-call id) it failed as a 500 while encoding the answer. It is
    refused here, once, as pydantic refuses a string it cannot decode (``string_unicode``); a valid
    pair (``"\ud83d\ude00"``) decodes to one character and is not affected.
    """
    if not _may_hold_surrogate(raw, code_points):
        return data
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                raise validation_error(
                    [{"type": "string_unicode", "loc": loc, "msg": _UNICODE_MSG, "input": _escaped(value)}]
                )
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                if _has_surrogate(key):
                    raise validation_error([{"type": "string_unicode", "loc": loc, "msg": _UNICODE_MSG, "input": _escaped(key)}])
                stack.append(((*loc, key), item))
        elif isinstance(value, list):
            stack.extend(((*loc, i), item) for i, item in reversed(list(enumerate(value))))
    return data


_UNICODE_MSG = "Input should be a valid string, unable to parse raw data as a unicode string"


def parse_json(body: bytes | bytearray | str) -> Any:
    """Parse a request body as FastAPI does: empty is ``None``, malformed JSON is a ``json_invalid`` 400.

    Beyond FastAPI, every input it would take but that fails later as a 500 is a 400 here: nesting
    deeper than ``MAX_JSON_DEPTH``, NaN or infinite numbers (no response could hold them), and lone
    surrogates (``_check_surrogates``).
    """
    if not body:
        return None
    if isinstance(body, (bytes, bytearray)):
        return _check_surrogates(body, _parse(body))
    return _check_surrogates(body.encode("utf-8", "surrogatepass"), _parse(body), code_points=True)


def _parse(body: bytes | bytearray | str) -> Any:
    # orjson where it reads as json does (large stream states); else json decides the result and the error text.
    if isinstance(body, (bytes, bytearray)) and (data := _fast_loads(body)) is not _NOT_FAST:
        return _check_depth(body, data)
    try:
        data = json.loads(body, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise validation_error(
            [{"type": "json_invalid", "loc": (exc.pos,), "msg": "JSON decode error", "input": {}, "ctx": {"error": exc.msg}}]
        ) from None
    except _NotFinite:
        raise BadRequestError("Out of range float values are not JSON compliant") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # not UTF-8, or an int past Python's 4300-digit limit: FastAPI's 400
        raise RequestValidationFailed("There was an error parsing the body") from None
    return _check_depth(body, data)


def load_body(body: bytes | bytearray | str | Any) -> Any:
    """A stage's input: raw JSON from the HTTP path, or an already-parsed object from a handle caller."""
    return parse_json(body) if isinstance(body, (bytes, bytearray, str)) else body


def stream_flag(body: Any) -> bool:
    """``body["stream"]`` of a raw request dict, for routes that branch on it before any schema runs.

    Only a JSON boolean (or null / absent: false) is taken: a truthy ``"false"`` must not answer
    with SSE, so anything else is a 400 worded as pydantic's strict ``bool``.
    """
    stream = body.get("stream") if isinstance(body, dict) else None
    if stream is None or isinstance(stream, bool):
        return bool(stream)
    raise validation_error([{"type": "bool_type", "loc": ("stream",), "msg": "Input should be a valid boolean", "input": stream}])


def validate_model(validator: Any, data: Any) -> Any:
    """Validate ``data`` with a pydantic model class or ``TypeAdapter``; errors are vLLM's 400.

    As FastAPI: a missing (or null) body is ``body: Field required``, and ``from_attributes`` is on,
    which decides the wording of the error for a body that is not an object. Anything else a
    validator raises is the request's fault too: a 400 (:func:`~serve_app.errors.invalid_request`),
    never a 500.
    """
    from pydantic import ValidationError

    if data is None:
        raise validation_error([{"type": "missing", "loc": (), "msg": "Field required", "input": None}])
    try:
        if hasattr(validator, "validate_python"):
            return validator.validate_python(data, from_attributes=True)
        return validator.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None
    except RecursionError:
        raise _too_deep() from None
    except Exception as exc:  # a validator that crashed on the request's shape
        raise invalid_request(exc) from None


# --- the HTTP edge's helpers: a stream's routing key, headers passed on, answers from middleware ---

_CHUNK_KEY, _ID_KEY = b'"generate_chunk"', b'"request_id"'
_MAX_STREAM_ID = 256  # characters of a usable id
_MAX_GAP = 64  # whitespace around a ':' or '{' that we look past


def _skip_to(body: bytes, i: int, token: bytes) -> int:
    """The index after ``token`` when only a little JSON whitespace precedes it at ``i``, else -1."""
    window = body[i : i + _MAX_GAP]
    i += len(window) - len(window.lstrip(b" \t\r\n"))
    return i + 1 if body[i : i + 1] == token else -1


def stream_id(body: bytes) -> str | None:
    """The generate request id of a streaming derender body, found without parsing the JSON.

    Only a routing hint: a body laid out otherwise just routes without affinity (and misses the
    session cache), never wrongly. It runs on the event loop before any validation, so it is a
    few ``bytes.find`` calls plus bounded slices: linear in the body, no regex backtracking.
    """
    start = body.find(_CHUNK_KEY)
    while start >= 0:  # the first "generate_chunk" key whose value is an object
        colon = _skip_to(body, start + len(_CHUNK_KEY), b":")
        brace = _skip_to(body, colon, b"{") if colon >= 0 else -1
        if brace >= 0:
            break
        start = body.find(_CHUNK_KEY, start + len(_CHUNK_KEY))
    else:
        return None
    key = body.find(_ID_KEY, brace)  # its first "request_id" key
    colon = _skip_to(body, key + len(_ID_KEY), b":") if key >= 0 else -1
    open_quote = _skip_to(body, colon, b'"') if colon >= 0 else -1
    if open_quote < 0:
        return None
    # The string up to its closing quote, looked for only as far as a 256-char id can reach (\uXXXX each).
    raw = body[open_quote - 1 : open_quote + 6 * _MAX_STREAM_ID + 1]
    end = raw.find(b'"', 1)
    while end >= 0 and (end - len(raw[:end].rstrip(b"\\"))) % 2:  # an escaped quote: look on
        end = raw.find(b'"', end + 1)
    if end < 0:
        return None
    try:  # unescaped exactly as the JSON parser will read it; a lone surrogate is no usable key
        value = json.loads(raw[: end + 1])
        value.encode()
    except ValueError:
        return None
    return value if 0 < len(value) <= _MAX_STREAM_ID else None


FORWARDED_HEADERS = ("x-request-id", "x-data-parallel-rank", "x-session-id")
"""The request headers ``/inference/v1/generate`` honours, passed on to the engine."""


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The request headers ``/inference/v1/generate`` honours (request id, DP rank, session)."""
    return {k: v for k in FORWARDED_HEADERS if (v := headers.get(k)) is not None}


async def send_json(send: Any, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer a request from ASGI middleware, before any route runs (a 401, 408, 413 envelope)."""
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})

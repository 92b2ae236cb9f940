"""JSON in and out at the wire, byte-compatible with vLLM's FastAPI server."""

from __future__ import annotations

import json
from typing import Any

import orjson

from serve_app.errors import RequestValidationFailed, validation_error

__all__ = ["check_json_content_type", "dump_json", "dump_json_floatless", "load_body", "parse_json", "validate_model"]


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


def check_json_content_type(content_type: str | None) -> None:
    """vLLM's ``validate_json_request``: only ``application/json`` bodies, else a 400."""
    media_type = (content_type or "").lower().split(";", maxsplit=1)[0].strip()
    if media_type != "application/json":
        raise RequestValidationFailed("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed")


def parse_json(body: bytes) -> Any:
    """Parse a request body as FastAPI does: empty is ``None``, malformed JSON is a ``json_invalid`` 400."""
    if not body:
        return None
    try:
        # orjson is the fast path (large stream states). It reads ints beyond 64 bits as floats, so
        # bodies with 19+ digit runs, and whatever it refuses (NaN, malformed input), go through
        # json, which then decides the result and the error text.
        if isinstance(body, (bytes, bytearray)) and not _has_long_digit_run(body):
            return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise validation_error(
            [{"type": "json_invalid", "loc": (exc.pos,), "msg": "JSON decode error", "input": {}, "ctx": {"error": exc.msg}}]
        ) from None
    except UnicodeDecodeError:
        raise RequestValidationFailed("There was an error parsing the body") from None


def load_body(body: bytes | bytearray | str | Any) -> Any:
    """A stage's input: raw JSON from the HTTP path, or an already-parsed object from a handle caller."""
    return parse_json(body) if isinstance(body, (bytes, bytearray, str)) else body


def validate_model(validator: Any, data: Any) -> Any:
    """Validate ``data`` with a pydantic model class or ``TypeAdapter``; errors are vLLM's 400.

    As FastAPI: a missing (or null) body is ``body: Field required``, and ``from_attributes`` is on,
    which decides the wording of the error for a body that is not an object.
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

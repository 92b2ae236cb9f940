"""Typed errors and vLLM's error envelope.

Core code raises an :class:`ApiError` subclass; the ingress turns any exception into vLLM 0.32's
envelope exactly once, at the edge::

    {"error": {"message": str, "type": str, "param": str | null, "code": int}}

The HTTP status always equals ``code``. Messages are sanitised as vLLM does (no file paths,
tracebacks or memory addresses).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "RETRY_AFTER_S",
    "ApiError",
    "BadRequestError",
    "EngineStreamError",
    "GatewayTimeoutError",
    "InvalidChatRequest",
    "NotFoundError",
    "PayloadTooLargeError",
    "RequestValidationFailed",
    "ServiceUnavailableError",
    "envelope",
    "error_body",
    "invalid_request",
    "sanitize_message",
    "validation_error",
]


class ApiError(Exception):
    """An error with an HTTP status, a vLLM ``type`` string and an optional ``param``."""

    # Class defaults per subclass; an instance may carry vLLM's own status and type instead.
    status_code: int = 500
    err_type: str = "InternalServerError"

    def __init__(
        self, message: str, param: str | None = None, *, status_code: int | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status_code is not None:  # an error vLLM reported with its own status and type
            self.status_code = status_code
        if err_type is not None:
            self.err_type = err_type

    def __reduce__(self) -> tuple[Any, ...]:  # keep every field across Ray's pickling between replicas
        return (_rebuild, (type(self), self.message, self.param, self.status_code, self.err_type))


def _rebuild(cls: type[ApiError], message: str, param: str | None, status_code: int, err_type: str) -> ApiError:
    return cls(message, param, status_code=status_code, err_type=err_type)


class BadRequestError(ApiError):
    status_code = 400
    err_type = "BadRequestError"


class RequestValidationFailed(BadRequestError):
    """Schema validation failed; vLLM reports these with the HTTP phrase as ``type``."""

    err_type = "Bad Request"


class NotFoundError(ApiError):
    status_code = 404
    err_type = "NotFoundError"


class PayloadTooLargeError(ApiError):
    status_code = 413
    err_type = "PayloadTooLargeError"


class GatewayTimeoutError(ApiError):
    status_code = 504
    err_type = "GatewayTimeoutError"


RETRY_AFTER_S = 2  # what every 503 (a stage down, the front door with no replica) asks a client to wait


class ServiceUnavailableError(ApiError):
    status_code = 503
    err_type = "ServiceUnavailableError"


class EngineStreamError(ApiError):
    """vLLM sent ``data: {"error": ...}`` in the middle of a stream (the stream is over); it keeps
    vLLM's status and type."""


# Messages echo user input (a model name, a path): bounded before any regex runs. Above the longest
# schema-validation message (~10 KB, see validation_error), so those stay byte-identical to vLLM's.
_MAX_MESSAGE_CHARS = 16384
_TRUNCATED = "...[truncated]"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")
# vLLM's patterns, rewritten so that no failed match is retried from inside the text it scanned:
# each match takes a whole whitespace run (or path chain) and a callback keeps it unless it
# qualifies. The originals were quadratic on long "/a/a/..." chains and whitespace runs.
_FRAME = r'File "[^"]+", line \d+, in \S+(?:\n\s+.*)?'
_WHITESPACE_OR_FRAME = re.compile(rf"\s+(?:{_FRAME})?|{_FRAME}")  # vLLM: \n?\s*{_FRAME}
_SYSTEM_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_PATH_CHAIN = re.compile(r"(?:/[\w\-]+)+(?:\.\w+)?")  # vLLM: (?:/[\w\-]+)+/[\w\-]+\.\w+


def _drop_frame(match: re.Match[str]) -> str:
    text = match.group()
    return text if text.isspace() else ""


def _hide_file_path(match: re.Match[str]) -> str:
    text = match.group()  # "/a/b.c" is a path; "/a", "/a.c" and "/a/b" are not
    return "<path>" if "." in text and text.count("/") >= 2 else text


def sanitize_message(message: str) -> str:
    """Strip memory addresses, tracebacks and file paths, as vLLM's ``sanitize_message`` does.

    Linear time, on at most ``_MAX_MESSAGE_CHARS`` characters (then a truncation marker).
    """
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + _TRUNCATED
    message = _ADDRESS.sub(">", message)
    if 'File "' in message:
        message = _WHITESPACE_OR_FRAME.sub(_drop_frame, message)
    message = _SYSTEM_PATH.sub("<path>", message)
    message = _PATH_CHAIN.sub(_hide_file_path, message)
    return message.strip()


def invalid_request(exc: Exception) -> ApiError:
    """The 400 for an exception that a request model's validator raised on malformed data.

    vLLM's ``mode="before"`` validators read the raw body (``tool["function"]["name"]``,
    ``structured_outputs.get(...)``) and crash with ``KeyError`` or ``AttributeError`` on the wrong
    shape; pydantic passes those through and vLLM answers them as 500s. Whatever a validator raises,
    the request is what is wrong: a 4xx. vLLM's own client errors (``VLLMValidationError``, ...: not
    ``ValueError`` subclasses, so pydantic passes them through too) keep vLLM's status and ``param``;
    its 400s (``ValueError``, ``TypeError``, ``OverflowError``) keep its message; the rest name the
    exception, as their text alone (``'function'``) says nothing.
    """
    if isinstance(exc, ApiError):
        return exc if 400 <= exc.status_code < 500 else BadRequestError(exc.message, exc.param)
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "VLLMClientError" in names:  # vLLM's own client errors keep its status and param (create_error_response)
        if "VLLMNotFoundError" in names:
            return NotFoundError(str(exc))
        if "VLLMUnprocessableEntityError" in names:
            return ApiError(str(exc), getattr(exc, "parameter", None), status_code=422, err_type="UnprocessableEntityError")
        return BadRequestError(str(exc), getattr(exc, "parameter", None))
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        return BadRequestError(str(exc))
    return BadRequestError(f"Invalid request: {type(exc).__name__}: {exc}")


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": sanitize_message(message), "type": err_type, "param": param, "code": code}}


def envelope(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Map any exception to ``(status, vLLM envelope)``.

    Errors raised inside a replica reach the ingress wrapped by Ray (``RayTaskError`` keeps the
    original as ``cause``); they are unwrapped first so their status survives the hop.
    """
    exc = getattr(exc, "cause", None) or exc
    if isinstance(exc, ApiError):
        return exc.status_code, error_body(exc.message, exc.err_type, exc.status_code, exc.param)
    if _is_backpressure(exc):
        return 503, error_body("Server is overloaded, retry later.", "ServiceUnavailableError", 503)
    if _is_replica_gone(exc):
        return 503, error_body("A stage's replica went away; retry later.", "ServiceUnavailableError", 503)
    return 500, error_body(f"{type(exc).__name__}: {exc}", "InternalServerError", 500)


def _is_backpressure(exc: BaseException) -> bool:
    return type(exc).__name__ in {"BackPressureError", "DeploymentUnavailableError"}


def _is_replica_gone(exc: BaseException) -> bool:
    # Ray's errors for a call whose replica died or restarted under it: the retry lands on a live one.
    return type(exc).__name__ in {"ActorDiedError", "ActorUnavailableError", "RayActorError"}


# --- schema validation errors, formatted as vLLM's RequestValidationError handler does -------------

_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
_BRACKETED = re.compile(r"[\[\]{}()]")
_INTERNAL_LOC_MARKERS = frozenset(
    """function-wrap function-after function-before function-plain json-or-python lax-or-strict chain
    default nullable tagged-union union call arguments is-instance is-subclass callable str int float
    bool bytes bytearray list tuple dict set frozenset complex none nonetype""".split()
)


def clean_loc(loc: tuple[Any, ...]) -> str:
    """``('body', 'function-wrap[...]', 'prompt')`` -> ``"body.prompt"``."""
    parts = [str(p) for p in loc if not (_BRACKETED.search(str(p)) or str(p).lower() in _INTERNAL_LOC_MARKERS)]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _summarize_input(value: object) -> object:
    if isinstance(value, str):
        return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_ERROR_INPUT_CHARS else value
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except Exception:  # an int past sys.get_int_max_str_digits(), say
        return f"<{type(value).__name__}>"
    return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_INPUT_CHARS else text


def _format_error(err: Mapping[str, Any]) -> str:
    err = dict(err)
    err.pop("url", None)
    if "input" in err:
        err["input"] = _summarize_input(err["input"])
    if isinstance(err.get("loc"), (tuple, list)):
        err["loc"] = clean_loc(tuple(err["loc"]))
    text = str(err)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def validation_error(errors: Sequence[Mapping[str, Any]], loc_prefix: tuple[str, ...] = ("body",)) -> BadRequestError:
    """Build vLLM's 400 for pydantic ``errors()``: ``"N validation error(s):\\n  {...}"``, ``param`` = first loc."""
    errors = [{**e, "loc": (*loc_prefix, *e.get("loc", ()))} for e in errors]
    if not errors:
        return RequestValidationFailed("Validation error")
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in errors[:_MAX_REPORTED_ERRORS])
    if count > _MAX_REPORTED_ERRORS:
        message += f"  ...and {count - _MAX_REPORTED_ERRORS} more {label}\n"
    return RequestValidationFailed(message.rstrip(), param=clean_loc(tuple(errors[0]["loc"])) or None)



class InvalidChatRequest(Exception):
    """A ``chat_request`` that failed vLLM's validation, carrying our 400 for it. Parser derender
    raises it deep down and answers it at its edge with vLLM's exact error for the whole body."""

    def __init__(self, error: ApiError) -> None:
        self.error = error

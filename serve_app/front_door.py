"""The front door: what a request meets before the Ingress's routes run, and the limits set there.

``make run`` puts HAProxy in front (``RAY_SERVE_ENABLE_HA_PROXY=1``): HAProxy forwards each request
to an Ingress replica's own HTTP server (Ray's direct ingress, ``Replica._direct_ingress_asgi``),
which runs Ray code, then our FastAPI app. Two gaps there are closed here; what Ray 2.60 does not
let us set in HAProxy is in docs/operations.md, "Front door".

* :func:`middlewares` is what ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names (the Makefile's
  ``SERVE_ENV``): Ray wraps the middlewares it returns around its replica HTTP server
  (``ray/serve/_private/http_util.py``: ``configure_http_middlewares``, ``start_asgi_http_server``),
  so :class:`StrictHeadersMiddleware` runs before Ray decodes any header, and
  :class:`ServeHintsMiddleware` sets the hint that spares a one-body answer Ray's disconnect watch.
* :class:`BodyDeadlineMiddleware` is in the Ingress's own stack: a body has to keep arriving.
* :data:`HAPROXY_BALANCE` is what ``make run`` sets ``RAY_SERVE_HAPROXY_BALANCE_ALGORITHM`` to: HAProxy
  hashes each parser-stream chunk's ``generate_chunk.request_id``, so every chunk of a stream reaches
  the Ingress replica holding its live parser, header or not (:func:`hashes_stream_id`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from ray.serve._private.constants import (
    SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER,
    SERVE_HTTP_REQUEST_ID_HEADER,
    SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER,
    SERVE_MULTIPLEXED_MODEL_ID,
    SERVE_SESSION_ID,
)

from serve_app.errors import RETRY_AFTER_S, ApiError, BadRequestError, error_body
from serve_app.wire import send_json

__all__ = [
    "HAPROXY_BALANCE",
    "BodyDeadlineMiddleware",
    "RequestTimeoutError",
    "ServeHintsMiddleware",
    "StrictHeadersMiddleware",
    "hashes_stream_id",
    "middlewares",
    "undecodable_header",
]

# Ray 2.60 writes RAY_SERVE_HAPROXY_BALANCE_ALGORITHM verbatim after `balance ` in HAProxy's `defaults`
# section (ray/serve/_private/haproxy_templates.py) and offers no other way to add a directive there,
# so the value carries two more lines. `req.body` is only there for `balance` once HAProxy has waited
# for the body (`option http-buffer-request`: without it chunks spread over the replicas), and it holds
# the first tune.bufsize bytes (16 KiB): json_query stops at the key, so the id is found in any body
# whose `generate_chunk` comes before the growing `stream_state`, the order of vLLM's request model and
# of its API document's example. Otherwise (no such key, or a body laid out state-first) HAProxy falls
# back to round-robin: still right, only a miss and a replay. A client's x-session-id plays no part.
# `hash-type consistent`: a replica joining or leaving moves only its own share of the streams.
# Waiting for the body also holds a client that trickles it, which `timeout client` (idle time) never
# ends: `timeout http-request` bounds the whole request's arrival (20 s, as BodyDeadlineMiddleware's
# first 20 s).
# HAProxy's own answers are vLLM's envelope, not its HTML pages: `http-error` lines, written inline so
# the setting names no file path (a KubeRay container installs the package elsewhere than `make run`).
# They come after Ray's `errorfile 502/503/504` (a plain-text 500) in `defaults`, and the later wins:
# no Ingress replica up is a 503 with Retry-After, as the Ingress answers for a stage that is down.
# A request that is not HTTP at all still gets HAProxy's HTML 400: its parser answers before any
# `http-error` applies (tests/unit/test_front_door_balance.py).
STREAM_ID_FIELD = "$.generate_chunk.request_id"
REQUEST_TIMEOUT_S = 20
FRONT_DOOR_ERRORS = {
    408: (
        f"The request did not arrive in time: HAProxy waited {REQUEST_TIMEOUT_S} s for its headers and body (timeout http-request).",
        "RequestTimeoutError",
    ),
    502: ("The Ingress replica failed before it answered.", "BadGatewayError"),
    503: ("No Ingress replica is available, retry later.", "ServiceUnavailableError"),
    504: ("The Ingress replica did not answer in time.", "GatewayTimeoutError"),
}


def _http_error(status: int, message: str, err_type: str) -> str:
    body = json.dumps(error_body(message, err_type, status))
    assert "'" not in body  # HAProxy's single-quoted string
    retry = f" hdr retry-after {RETRY_AFTER_S}" if status == 503 else ""
    return f"http-error status {status} content-type application/json hdr cache-control no-cache{retry} string '{body}'"


HAPROXY_BALANCE = "\n    ".join(
    [
        f"hash req.body,json_query('{STREAM_ID_FIELD}')",
        "option http-buffer-request",
        "hash-type consistent",
        f"timeout http-request {REQUEST_TIMEOUT_S}s",
        *(_http_error(status, *page) for status, page in FRONT_DOOR_ERRORS.items()),
    ]
)


def hashes_stream_id(env: Any = None) -> bool:
    """Whether this Serve's front door keeps a parser stream's chunks on one Ingress replica by the
    stream id in the body (HAProxy on, balanced by :data:`HAPROXY_BALANCE`). Ray starts the replicas
    with the environment ``serve run`` (or ``ray start``) had, where Ray's HAProxy reads the same."""
    env = os.environ if env is None else env
    return env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" and STREAM_ID_FIELD in env.get("RAY_SERVE_HAPROXY_BALANCE_ALGORITHM", "")


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


# The header values Ray 2.60's replica decodes as strict UTF-8 before any app code, where a stray byte
# is an uncaught UnicodeDecodeError, i.e. uvicorn's plain-text 500 (replica.py, _direct_ingress_asgi
# and get_asgi_tracing_context; http_util.py, parse_*_header). Ray matches the session and multiplexed
# ids with '-' and '_' alike, so all are compared that way; Ray's own constants keep the names in step
# (RAY_SERVE_SESSION_ID_HEADER_KEY renames the session header).
_STRICT = frozenset(
    _norm(n)
    for n in (
        SERVE_HTTP_REQUEST_ID_HEADER,
        SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER,
        SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER,
        SERVE_SESSION_ID,
        SERVE_MULTIPLEXED_MODEL_ID,
        "traceparent",  # decoded when tracing is on
        "tracestate",
    )
)


def undecodable_header(headers: Any) -> tuple[str | None, str] | None:
    """The first header Ray would fail to decode, as ``(name or None, message)``; None if there is none.

    Every name (Ray decodes names while looking for its own headers) and the values in ``_STRICT``.
    Other values stay bytes to Ray and latin-1 to Starlette, as in vLLM: they pass.
    """
    for raw_name, raw_value in headers:
        try:
            name = raw_name.decode()
        except UnicodeDecodeError:
            return None, "A request header name is not valid UTF-8."
        if _norm(name) in _STRICT:
            try:
                raw_value.decode()
            except UnicodeDecodeError:
                return name, f"The {name} header is not valid UTF-8."
    return None


class StrictHeadersMiddleware:
    """vLLM's 400 envelope for a header Ray would fail to decode, before Ray reads it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (bad := undecodable_header(scope.get("headers", ()))):
            name, message = bad
            await send_json(send, 400, error_body(message, BadRequestError.err_type, 400, name))
            return
        await self.app(scope, receive, send)


# The Ingress's POST routes whose answer is one JSON body computed on the CPU tier (render, derender,
# tokenize, abort): nothing for a client's disconnect to stop. The others (generate and the composed
# /v1/* routes) hold an engine request, which a disconnect must abort.
ONE_BODY_ROUTES = frozenset(
    {
        "/v1/chat/completions/derender",
        "/v1/completions/derender",
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v1/messages/render",
        "/v1/responses/render",
        "/tokenize",
        "/detokenize",
        "/inference/v1/abort_requests",
        "/abort_requests",
    }
)
_DISCONNECT_DISABLED = SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER.encode()
_HINT = (_DISCONNECT_DISABLED, b"?1")


def with_serve_hints(scope: dict[str, Any]) -> dict[str, Any]:
    """``scope`` with Serve's disconnect hint set by us alone: ``?1`` on a POST to a one-body route, absent
    elsewhere (a client's own value is dropped, so it cannot keep an engine request running after it left).

    Ray 2.60's replica watches every request for a disconnect with two extra tasks and an
    ``asyncio.wait`` (``Replica._direct_ingress_asgi``) unless this header says not to: on a one-token
    derender chunk that was ~0.25 ms of the Ingress's ~1.8 ms of CPU.
    """
    headers = [h for h in scope["headers"] if h[0].lower() != _DISCONNECT_DISABLED]
    if scope.get("method") == "POST" and scope["path"] in ONE_BODY_ROUTES:
        headers.append(_HINT)
    elif len(headers) == len(scope["headers"]):
        return scope
    return {**scope, "headers": headers}


class ServeHintsMiddleware:
    """Serve's per-request hints (:func:`with_serve_hints`) before Ray's replica reads them."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.app(with_serve_hints(scope) if scope["type"] == "http" else scope, receive, send)


def middlewares() -> list[Any]:
    """``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=serve_app.front_door.middlewares``: called by Ray in
    each process that starts an HTTP server (every ingress replica, and Serve's Python proxy)."""
    from starlette.middleware import Middleware

    # Ray wraps them in this order, so the last is outermost: the strict check meets the raw headers.
    return [Middleware(ServeHintsMiddleware), Middleware(StrictHeadersMiddleware)]


class RequestTimeoutError(ApiError):
    status_code = 408
    err_type = "RequestTimeoutError"


# Apache mod_reqtimeout's default body rule (body=20,MinRate=500): 20 s for the body, one more second
# for every 500 bytes received. A 32 MiB body (limits.max_body_bytes) needs ~500 B/s on average.
BODY_BASE_S = 20.0
BODY_MIN_RATE = 500  # bytes per second


class BodyDeadlineMiddleware:
    """A 408 in vLLM's envelope, and the connection closed, for a request body that stops arriving.

    The body gets ``base_s`` seconds plus one second per ``min_rate`` bytes received, counted from
    when the request reached this replica. HAProxy, as Ray 2.60 configures it, bounds only client
    inactivity (``timeout client``), so a client trickling its body would otherwise hold the
    connection and an Ingress request slot for as long as it likes. Once the body is complete
    nothing is bounded here (a stream then waits on the client's disconnect).
    """

    def __init__(self, app: Any, base_s: float = BODY_BASE_S, min_rate: float = BODY_MIN_RATE) -> None:
        self.app = app
        self.base_s = base_s
        self.min_rate = min_rate

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        received = 0
        complete = timed_out = False

        async def deadline_receive() -> dict[str, Any]:
            nonlocal received, complete, timed_out
            if complete:
                return await receive()
            remaining = start + self.base_s + received / self.min_rate - time.monotonic()
            try:
                async with asyncio.timeout(remaining):  # no extra task, unlike wait_for: this is every request
                    message = await receive()
            except TimeoutError:
                timed_out = True
                raise RequestTimeoutError(
                    f"The request body did not arrive in time ({received} bytes in {time.monotonic() - start:.0f} s); "
                    f"send it at {self.min_rate:.0f} bytes/s or more after the first {self.base_s:.0f} s."
                ) from None
            received += len(message.get("body", b""))
            complete = not (message["type"] == "http.request" and message.get("more_body", False))
            return message

        async def closing_send(message: dict[str, Any]) -> None:
            # The rest of a timed-out body would follow on this connection: close it after the 408.
            if timed_out and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, deadline_receive, closing_send)


if __name__ == "__main__":  # `make run`: RAY_SERVE_HAPROXY_BALANCE_ALGORITHM="$(python -m serve_app.front_door)"
    print(HAPROXY_BALANCE)

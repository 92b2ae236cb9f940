"""API keys, as ``vllm serve --api-key``: ``Authorization: Bearer <key>`` on every route that does work.

Guarded: ``/v1/*``, ``/inference/*``, ``/tokenize``, ``/detokenize`` and ``/abort_requests``. Open:
``/health``, ``/ready``, ``/metrics``, ``/version`` (probes and scrapers carry no key). Keys are
compared as SHA-256 digests with ``secrets.compare_digest`` against every configured key (constant
time, as vLLM), and are never logged: the config holds them as ``SecretStr``. A missing or wrong key
is a 401 in vLLM's error envelope (vLLM itself answers ``{"error": "Unauthorized"}``).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from typing import Any

from serve_app.errors import error_body
from serve_app.wire import send_json

__all__ = ["GUARDED_PREFIXES", "ApiKeyMiddleware"]

GUARDED_PREFIXES = ("/v1", "/inference", "/tokenize", "/detokenize", "/abort_requests")


class ApiKeyMiddleware:
    """Pure ASGI: a request to a guarded path needs one of ``keys`` as its bearer token."""

    def __init__(self, app: Any, keys: Iterable[str]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def authorized(self, authorization: bytes | None) -> bool:
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        digest = hashlib.sha256(token.strip()).digest()
        match = False
        for expected in self._digests:  # every key compared: no early exit to time
            match |= secrets.compare_digest(digest, expected)
        return match

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith(GUARDED_PREFIXES):
                authorization = dict(scope.get("headers", ())).get(b"authorization")
                if not self.authorized(authorization):
                    body = error_body("Unauthorized: a valid API key is required.", "Unauthorized", 401)
                    await send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])
                    return
        await self.app(scope, receive, send)

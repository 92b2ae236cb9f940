"""Request body limits enforced while the body streams in, before any JSON parsing."""

from __future__ import annotations

from typing import Any

from serve_app.errors import PayloadTooLargeError, error_body
from serve_app.wire import send_json

__all__ = ["BodySizeLimitMiddleware"]


class BodySizeLimitMiddleware:
    """Reject bodies over ``max_bytes`` with 413: at once on ``Content-Length``, else while reading."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"Request body exceeds the server maximum of {self.max_bytes} bytes."

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await send_json(send, 413, error_body(self._message(), PayloadTooLargeError.err_type, 413))
                return
        seen = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise PayloadTooLargeError(self._message())
            return message

        await self.app(scope, limited_receive, send)

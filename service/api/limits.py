"""Refuse request bodies above ``REMAT_MAX_BODY_BYTES`` with 413 before they are buffered.

A declared ``Content-Length`` over the limit is refused without reading anything. A body sent without one
(chunked) is counted as it arrives and the request is cut off at the limit; the handler that was reading
it never sees a partial body.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class _BodyTooLarge(HTTPException):
    """Raised from ``receive``; an HTTPException so that FastAPI's body reader passes it on as a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"body: more than the {limit} bytes accepted")


async def _send_error(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimitMiddleware:
    """Pure ASGI middleware (no per-request task or buffering, unlike BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _send_error(send, 400, "content-length: not an integer")
                return
            if length > limit:
                await _send_error(send, 413, f"body: {length} bytes is more than the {limit} accepted")
                return

        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge(limit)
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge as exc:
            if not started:
                await _send_error(send, exc.status_code, exc.detail)

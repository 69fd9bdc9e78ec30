"""ASGI middleware of the OpenAI server: a body over `max_bytes` (declared or streamed) answers 413 in
OpenAI's error shape before any of it is parsed or tokenized."""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .openai_errors import OpenAIError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Callable[[OpenAIError], None]) -> None:
        self.app, self.max_bytes, self.on_error = app, max_bytes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        seen, more = 0, not too_big
        while more and not too_big:  # buffer at most max_bytes, so a streamed body is limited too
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            seen += len(chunks[-1])
            more, too_big = msg.get("more_body", False), seen > self.max_bytes
        if too_big:
            err = OpenAIError(413, f"the request body exceeds {self.max_bytes} bytes (--max-body-bytes)",
                              "invalid_request_error", None, "payload_too_large")
            self.on_error(err)
            return await JSONResponse(err.to_body(), status_code=413)(scope, receive, send)
        body, sent = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

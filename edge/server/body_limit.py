"""ASGI middleware of the OpenAI server: a body over `max_bytes` (declared or streamed) answers 413 in
OpenAI's error shape before any of it is parsed or tokenized."""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.http_body import read_limited, replaying

from .openai_errors import OpenAIError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Callable[[OpenAIError], None]) -> None:
        self.app, self.max_bytes, self.on_error = app, max_bytes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        outcome, body = await read_limited(scope, receive, self.max_bytes)
        if outcome == "gone":
            return
        if outcome == "too_big":
            err = OpenAIError(413, f"the request body exceeds {self.max_bytes} bytes (--max-body-bytes)",
                              "invalid_request_error", None, "payload_too_large")
            self.on_error(err)
            return await JSONResponse(err.to_body(), status_code=413)(scope, receive, send)
        await self.app(scope, replaying(body, receive), send)

"""What runs before a REST route sees a body: the key, the size, and a bounded JSON parse.

Order for every request: `RequestIds` (the X-Request-Id: checked, echoed, set for the log lines of
the call; answers of /v1/ routes counted by status) -> `KeyFirst` (401 on /v1/ without a valid key, before a byte of the body
is read) -> `BodyLimit` (413 past max_body_bytes, declared or streamed) -> `CheckedRoute`'s JSON
parse, which refuses with 422 `invalid_argument` what is not strict UTF-8 JSON (invalid bytes,
lone surrogates, nesting deeper than the parser's limit, syntax errors) and a body with more
objects than a verify round can carry (counted as `{` bytes before parsing, so a body of a million
tiny objects costs a byte scan, not a parse). Pydantic then checks types and list lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloud.guards import bearer_key
from shared.errors import InvalidArgument, PayloadTooLarge, SpecSplitError
from shared.http_body import read_limited, replaying
from shared.request_id import CURRENT, REQUEST_ID_HEADER, check_request_id

# JSON objects a body may hold beyond max_k (the root, sampling_cfg, and slack for braces in strings)
OBJECT_SLACK = 64


def error_response(err: SpecSplitError) -> JSONResponse:
    """The one SpecSplitError -> REST answer: its status, its body, Retry-After when it has one."""
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.to_body(), status_code=err.http_status, headers=headers)


class BodyRejected(HTTPException):
    """A body that is not acceptable JSON: answered 422 invalid_argument (`as_error`). An HTTPException,
    so that FastAPI passes it on as it is instead of turning it into a 400."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(status_code=422, detail=f"malformed body: {reason}")
        self.reason, self.kind = reason, kind

    def as_error(self) -> InvalidArgument:
        return InvalidArgument(str(self.detail), problems=[{"loc": ["body"], "msg": self.reason, "type": self.kind}])


def parse_json_body(body: bytes, max_objects: int) -> Any:
    """Strict JSON (NaN / Infinity allowed: the checks downstream name them); BodyRejected otherwise."""
    objects = body.count(b"{")
    if objects > max_objects:
        raise BodyRejected(f"{objects} JSON objects, more than a request carries ({max_objects})", "too_many_objects")
    try:
        return pydantic_core.from_json(body)
    except ValueError as e:
        raise BodyRejected(f"not valid UTF-8 JSON: {e}", "json_invalid") from None


class CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body(), int(self.app.state.max_json_objects))
        return self._json


class CheckedRoute(APIRoute):
    """A FastAPI route whose JSON body is parsed by `parse_json_body`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(CheckedRequest(request.scope, request.receive))

        return checked


class RequestIds:
    """ASGI middleware: a request's X-Request-Id is checked (422 when malformed), set as the current
    one for the log lines written while serving it, and sent back on the answer; the status of every
    /v1/ answer goes to `on_response(status)`."""

    def __init__(self, app: ASGIApp, on_response: Callable[[int], None], on_error: Callable[[str], None]) -> None:
        self.app, self.on_response, self.on_error = app, on_response, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = scope["path"].startswith("/v1/")
        raw = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode())
        rid = raw.decode("latin-1") if raw is not None else ""

        async def sending(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                if rid:
                    msg["headers"] = [*msg.get("headers", []), (REQUEST_ID_HEADER.encode(), rid.encode())]
                if counted:
                    self.on_response(int(msg["status"]))
            await send(msg)

        if raw is not None:
            try:
                check_request_id(rid)
            except SpecSplitError as err:
                rid = ""
                self.on_error(err.code)
                return await error_response(err)(scope, receive, sending)
        token = CURRENT.set(rid)
        try:
            await self.app(scope, receive, sending)
        finally:
            CURRENT.reset(token)


class KeyFirst:
    """ASGI middleware: /v1/ requests (and /metrics when `protect_metrics`) without a valid key get 401
    before their body is read."""

    def __init__(self, app: ASGIApp, authenticate: Callable[[str | None], str], on_error: Callable[[str], None],
                 protect_metrics: bool = False) -> None:
        self.app, self.authenticate, self.on_error = app, authenticate, on_error
        self.protect_metrics = protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1/")
                                        or (self.protect_metrics and scope["path"] == "/metrics")):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            try:
                self.authenticate(bearer_key(header))
            except SpecSplitError as err:
                self.on_error(err.code)
                return await error_response(err)(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Callable[[str], None]) -> None:
        self.app, self.max_bytes, self.on_error = app, max_bytes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        outcome, body = await read_limited(scope, receive, self.max_bytes)
        if outcome == "gone":
            return
        if outcome == "too_big":
            err = PayloadTooLarge(f"request body exceeds max_body_bytes = {self.max_bytes}")
            self.on_error(err.code)
            return await error_response(err)(scope, receive, send)
        await self.app(scope, replaying(body, receive), send)

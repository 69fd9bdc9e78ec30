"""What runs before a REST route sees a body: the key, the size, and a bounded JSON parse.

Order for every request: `RequestIds` (the X-Request-Id: checked, echoed, set for the log lines of
the call; answers of /v1/ routes counted by status) -> `KeyFirst` (401 on /v1/ without a valid key, before a byte of the body
is read) -> `BodyLimit` (413 past max_body_bytes, declared or streamed) -> `CheckedRoute`'s JSON
parse, which refuses with 422 `invalid_argument` what is not strict UTF-8 JSON (invalid bytes,
lone surrogates, nesting deeper than the parser's limit, syntax errors) and a body with more
objects than a verify round can carry (counted as `{` bytes before parsing, so a body of a million
tiny objects costs a byte scan, not a parse). Pydantic then checks types and list lengths.

`error_responses` says the same in the OpenAPI schema: which statuses a route answers, each with the
error body of its code and the Retry-After header where one is sent.
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
from shared.errors import ERRORS_BY_STATUS, InvalidArgument, PayloadTooLarge, SpecSplitError
from shared.http_body import read_limited, replaying
from shared.request_id import CURRENT, REQUEST_ID_HEADER, REQUEST_ID_PATTERN, check_request_id

# JSON objects a body may hold beyond max_k (the root, sampling_cfg, and slack for braces in strings)
OBJECT_SLACK = 64
# what each error status means, as the OpenAPI schema says it (PROTOCOL.md, "Errors")
ERROR_MEANINGS = {
    401: "no key, a wrong key, or a key without the `Bearer` scheme (checked before the body is read)",
    403: "the session belongs to another API key",
    404: "unknown, closed, expired or evicted session: reopen it with the whole committed context",
    409: "`ctx_len` / `ctx_hash` disagree with the cloud's (`expected_ctx_len`, `expected_ctx_hash` in the body)",
    413: "the body is larger than `--max-body-bytes`",
    422: "malformed or invalid request: not UTF-8 JSON, wrong types, a value out of its range (`problems` lists "
         "pydantic's complaints; `reason`, `limit` name a context or limit refusal), or a malformed X-Request-Id",
    429: "over a limit (`limit` names the setting): the queue, the sessions, the sessions of one key, the KV budget",
    500: "a fault of the server (`error_id` names its log line with the traceback); not worth retrying as is",
    503: "not ready, draining, or a lost tensor-parallel rank; also plain text from the HTTP server past "
         "`--max-connections`",
}
# the statuses whose answers carry Retry-After (seconds; also `retry_after_s` in the body)
RETRY_AFTER_STATUSES = (429, 503)
# X-Request-Id, accepted on every route (PROTOCOL.md, "Request ids")
REQUEST_ID_PARAMETER: dict[str, Any] = {
    "name": "X-Request-Id", "in": "header", "required": False,
    "description": "the caller's id for this call: checked (422 when malformed), echoed on the answer, logged; on "
                   "an open, a retry with the same id and body joins the first attempt",
    "schema": {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN.pattern}$"},
}


def error_response(err: SpecSplitError) -> JSONResponse:
    """The one SpecSplitError -> REST answer: its status, its body, Retry-After when it has one."""
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.to_body(), status_code=err.http_status, headers=headers)


def error_body_schema(code: str) -> dict[str, Any]:
    """The JSON schema of an error answer whose code is `code`: `{"error": {"code", "message", ...details}}`."""
    detail = {"type": "object", "required": ["code", "message"], "additionalProperties": True,
              "properties": {"code": {"type": "string", "const": code}, "message": {"type": "string"},
                             "retry_after_s": {"type": "integer", "minimum": 0}}}
    return {"type": "object", "required": ["error"], "properties": {"error": detail}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error statuses a route answers: each one's body with its code, and the
    Retry-After header of 429 (always) and 503 (in the JSON answers; the HTTP server's plain 503 has none)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        content: dict[str, Any] = {"application/json": {"schema": error_body_schema(ERRORS_BY_STATUS[status].code)}}
        if status == 503:
            content["text/plain"] = {"schema": {"type": "string"}}
        out[status] = {"description": ERROR_MEANINGS[status], "content": content}
        if status in RETRY_AFTER_STATUSES:
            out[status]["headers"] = {"Retry-After": {
                "description": "seconds to wait before sending again", "required": status == 429,
                "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
    return out


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

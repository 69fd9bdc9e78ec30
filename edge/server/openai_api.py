"""The OpenAI-compatible REST routes of `specsplit-edge serve` (FastAPI).

GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /healthz, GET /readyz, GET /metrics.
With --server-api-key, every /v1 route needs one of the keys as a Bearer token (server_auth.py).
Bodies over --max-body-bytes answer 413 before they are read further; prompts are tokenized on a
worker thread, so a long one does not hold up the event loop (or /healthz).
Routes are thin: body -> TextRequest -> engine -> OpenAI JSON or server-sent events. Errors leave
in OpenAI's body (openai_errors.py) from one set of handlers. A streamed response first waits for
the generation's first event, so a request that fails before any text (a prompt too long, a cloud
that cannot be reached) still gets its proper status instead of a 200 stream carrying an error.
A client that goes away cancels its generation; the generation then closes its cloud session.
Every answer carries an X-Request-Id: the caller's, or a fresh one; a completion's `id` is
`cmpl-<it>` (chat: `chatcmpl-<it>`), and the generation sends it on each of its cloud calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.errors import SpecSplitError
from shared.request_id import CURRENT, REQUEST_ID_HEADER, check_request_id

from .body_limit import BodyLimit
from .chat import ChatTemplate, require
from .openai_bodies import ChatCompletionBody, CompletionBody
from .openai_engine import (
    Event,
    Finished,
    GenerationCancelled,
    GenerationStream,
    OpenAIEngine,
    TextDelta,
    TextRequest,
)
from .openai_errors import OpenAIError, from_specsplit, invalid, validation_error
from .openai_schema import (
    CLOUD_ERRORS,
    COMPLETION_SCHEMA,
    EVENTS_SCHEMA,
    MODEL_CARD,
    READY,
    TEXT_ROUTE_ERRORS,
    doc,
    finish_schema,
)
from .server_auth import ServerKeys

log = logging.getLogger(__name__)
# how often a waiting response checks whether its client is still there (seconds)
DISCONNECT_POLL_S = 0.1


@dataclass(frozen=True)
class ServeOptions:
    # the model id clients send and /v1/models lists; None: the cloud's model_id
    served_model_name: str | None = None
    # the chat template (the tokenizer's or --chat-template FILE); None: chat requests get a 400
    chat_template: ChatTemplate | None = None
    # chat completions without max_tokens / max_completion_tokens write at most this many tokens
    chat_default_max_tokens: int = 128


@dataclass(frozen=True)
class Shape:
    """How one endpoint writes its answers: completions' `text` or chat's `message` / `delta`."""

    # "completions" | "chat"
    endpoint: str
    # response id and object names
    id: str
    model: str
    created: int

    def full(self, done: Finished) -> dict[str, Any]:
        if self.endpoint == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": done.text},
                                      "logprobs": None, "finish_reason": done.finish_reason}
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}
        return {**self._head(chunk=False), "choices": [choice], "usage": usage(done), "specsplit": done.specsplit()}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.endpoint == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(chunk=True), "choices": [choice]}

    def usage_chunk(self, done: Finished) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": usage(done), "specsplit": done.specsplit()}

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.endpoint == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage(done: Finished) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _watch_disconnect(request: Request, stream: GenerationStream) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    log.info("client went away: cancelling its generation")
    stream.cancel()


async def respond(engine: OpenAIEngine, req: TextRequest, shape: Shape, stream_it: bool, include_usage: bool,
                  request: Request) -> Response:
    """Run the generation; one JSON answer or server-sent events."""
    stream = engine.start(req)
    watcher = asyncio.create_task(_watch_disconnect(request, stream))
    events = stream.events()
    try:
        first = await anext(events)
    except BaseException:
        watcher.cancel()
        stream.cancel()
        raise
    if isinstance(first, GenerationCancelled):
        return Response(status_code=499)  # nobody is listening any more
    if isinstance(first, SpecSplitError):
        watcher.cancel()
        raise first
    if not stream_it:
        try:
            done = first if isinstance(first, Finished) else None
            parts = [first.text] if isinstance(first, TextDelta) else []
            async for event in events:
                if isinstance(event, GenerationCancelled):
                    return Response(status_code=499)
                if isinstance(event, SpecSplitError):
                    raise event
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                else:
                    done = event
            assert done is not None
            return JSONResponse(shape.full(done))
        finally:
            watcher.cancel()
            stream.cancel()
    return StreamingResponse(_sse_events(first, events, shape, include_usage, stream, watcher),
                             media_type="text/event-stream")


async def _sse_events(first: Event, events: AsyncIterator[Event], shape: Shape, include_usage: bool,
                      stream: GenerationStream, watcher: asyncio.Task[None]) -> AsyncIterator[str]:
    """Chunks as OpenAI sends them: (chat: a role chunk,) text chunks, a chunk with finish_reason,
    with include_usage one more with `usage` and no choices, then `data: [DONE]`."""
    extra = {"usage": None} if include_usage else {}
    try:
        if shape.endpoint == "chat":
            yield sse({**shape.chunk(None, role=True), **extra})
        event: Event | None = first
        while event is not None:
            if isinstance(event, SpecSplitError):  # after text went out only the stream can say it
                yield sse(from_specsplit(event).to_body())
                return
            if isinstance(event, TextDelta):
                yield sse({**shape.chunk(event.text), **extra})
            else:
                yield sse({**shape.chunk(None, event.finish_reason), **extra, "specsplit": event.specsplit()})
                if include_usage:
                    yield sse(shape.usage_chunk(event))
                yield sse("[DONE]")
                return
            event = await anext(events, None)
    finally:  # normal end, or the client went away (the response task is cancelled)
        watcher.cancel()
        stream.cancel()


class RequestIds:
    """ASGI middleware: the request's X-Request-Id (400 when malformed) or a fresh one becomes the
    current id (routes read it from `CURRENT`) and goes back on the answer; /v1/ answers are counted
    by status."""

    def __init__(self, app: ASGIApp, on_response: Callable[[int], None], on_error: Callable[[OpenAIError], None]
                 ) -> None:
        self.app, self.on_response, self.on_error = app, on_response, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = scope["path"].startswith("/v1/")
        raw = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode())
        rid = uuid.uuid4().hex if raw is None else raw.decode("latin-1")

        async def sending(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                msg["headers"] = [*msg.get("headers", []), (REQUEST_ID_HEADER.encode(), rid.encode())]
                if counted:
                    self.on_response(int(msg["status"]))
            await send(msg)

        try:
            check_request_id(rid)
        except SpecSplitError as e:
            rid = uuid.uuid4().hex
            err = invalid(e.message, "X-Request-Id")
            self.on_error(err)
            return await JSONResponse(err.to_body(), status_code=err.status)(scope, receive, sending)
        token = CURRENT.set(rid)
        try:
            await self.app(scope, receive, sending)
        finally:
            CURRENT.reset(token)


def create_app(engine: OpenAIEngine, options: ServeOptions) -> FastAPI:
    app = FastAPI(title="specsplit edge (OpenAI-compatible)", version="1",
                  description="OpenAI completions and chat completions, drafted here and verified by the cloud.")
    prom = engine.prometheus
    app.add_middleware(BodyLimit, max_bytes=engine.settings.max_body_bytes,
                       on_error=lambda err: prom.errors.labels(err.type).inc())
    # the last added runs first: request id, then the key (before any body is read), then the body's size
    app.add_middleware(ServerKeys, keys=engine.settings.server_key_values(),
                       on_error=lambda err: prom.errors.labels(err.type).inc())

    app.add_middleware(RequestIds, on_response=lambda status: prom.responses.labels(str(status)).inc(),
                       on_error=lambda err: prom.errors.labels(err.type).inc())

    def answer(err: OpenAIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
        prom.errors.labels(err.type).inc()
        headers = dict(headers or {})
        if err.retry_after is not None:
            headers["Retry-After"] = str(err.retry_after)
        return JSONResponse(err.to_body(), status_code=err.status, headers=headers or None)

    @app.exception_handler(OpenAIError)
    async def on_openai(_: Request, err: OpenAIError) -> JSONResponse:
        return answer(err)

    @app.exception_handler(SpecSplitError)
    async def on_error(_: Request, err: SpecSplitError) -> JSONResponse:
        return answer(from_specsplit(err))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return answer(OpenAIError(exc.status_code, str(exc.detail), kind), exc.headers)  # a 405's Allow

    @app.exception_handler(Exception)
    async def on_crash(r: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", r.url.path)
        return answer(OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    async def model_name() -> str:
        if options.served_model_name:
            return options.served_model_name
        return (await asyncio.to_thread(engine.model_info)).model_id

    async def check_model(requested: str) -> str:
        name = await model_name()
        if requested != name:
            raise OpenAIError(404, f"The model `{requested}` does not exist; this server serves `{name}`",
                              "not_found_error", "model", "model_not_found")
        return name

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "specsplit"}

    keyed = bool(engine.settings.server_key_values())
    finish_schema(app, keyed)
    text_answer = {"application/json": {"schema": COMPLETION_SCHEMA}, "text/event-stream": {"schema": EVENTS_SCHEMA}}

    @app.get("/healthz", tags=["ops"], **doc("healthz", {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"const": "ok"}}}}}))
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    ready_doc = doc("readyz", {"application/json": {"schema": READY}})
    ready_doc["responses"][503] = {"description": "the cloud cannot be reached, refuses the key, or does not pair",
                                   "content": {"application/json": {"schema": READY}},
                                   "headers": {"Retry-After": {"required": True, "schema": {"type": "string"}}}}

    @app.get("/readyz", tags=["ops"], **ready_doc)
    async def readyz() -> JSONResponse:
        """200 once the cloud answered with this server's key and the pairing checks passed; else 503 with
        the reason (an unreachable cloud, a refused key, a draft or tokenizer the target does not speak)."""
        try:
            await asyncio.to_thread(engine.check_ready)
        except SpecSplitError as e:
            return JSONResponse({"ready": False, "reason": from_specsplit(e).message}, status_code=503,
                                headers={"Retry-After": "1"})
        return JSONResponse({"ready": True})

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse,
             **doc("metrics", {"text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}}))
    async def metrics() -> Response:
        return Response(prom.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", tags=["v1"], **doc("list_models", {"application/json": {"schema": {
        "type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_CARD}}}}},
        *CLOUD_ERRORS, keyed=keyed))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(await model_name())]}

    @app.get("/v1/models/{model_id:path}", tags=["v1"],
             **doc("get_model", {"application/json": {"schema": MODEL_CARD}}, 404, *CLOUD_ERRORS, keyed=keyed))
    async def model(model_id: str) -> dict[str, Any]:
        return model_card(await check_model(model_id))

    @app.post("/v1/completions", tags=["v1"], **doc("completions", text_answer, *TEXT_ROUTE_ERRORS, keyed=keyed))
    async def completions(body: CompletionBody, request: Request) -> Response:
        arrived = time.monotonic()
        body.check()
        name = await check_model(body.model)
        prompt = body.prompt_value()
        # tokenizing a long prompt takes a while: on a worker thread, so other requests go on meanwhile
        ids = await asyncio.to_thread(engine.encode, prompt) if isinstance(prompt, str) else await checked_ids(prompt)
        rid = CURRENT.get()
        req = TextRequest(ids, body.max_new_tokens(), body.sampling(), body.seed, body.stop_sequences(),
                          "completions", rid, arrived)
        shape = Shape("completions", f"cmpl-{rid}", name, int(time.time()))
        return await respond(engine, req, shape, body.stream, body.include_usage(), request)

    @app.post("/v1/chat/completions", tags=["v1"],
              **doc("chat_completions", text_answer, *TEXT_ROUTE_ERRORS, keyed=keyed))
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        arrived = time.monotonic()
        body.check()
        name = await check_model(body.model)
        template = require(engine.chat_template(options.chat_template))
        prompt = await asyncio.to_thread(template.render, body.chat_messages())
        ids = await asyncio.to_thread(engine.encode, prompt, False)  # the template placed its own specials
        rid = CURRENT.get()
        req = TextRequest(ids, body.max_new_tokens(options.chat_default_max_tokens), body.sampling(), body.seed,
                          body.stop_sequences(), "chat", rid, arrived)
        shape = Shape("chat", f"chatcmpl-{rid}", name, int(time.time()))
        return await respond(engine, req, shape, body.stream, body.include_usage(), request)

    async def checked_ids(ids: list[int]) -> list[int]:
        info = await asyncio.to_thread(engine.model_info)
        vocab = info.tokenizer_size or info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise invalid(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", "prompt")
        return ids

    return app

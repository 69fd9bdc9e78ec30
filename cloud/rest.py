"""REST boundary (FastAPI): pydantic bodies <-> shared.protocol dataclasses, errors -> status codes.

Routes stay thin: parse -> service -> serialise. `SpecSplitError` -> its REST status in one
handler (`rest_guards.error_response`, with Retry-After on 429 / 503); pydantic's validation
errors come out in the same body with 422. The key, the body size and the JSON parse are checked
before a route runs (cloud/rest_guards.py). Floats are strict (no strings, no booleans), like ints;
strings must be encodable text (no lone surrogates). Bodies and answers: cloud/rest_bodies.py. OpenAPI docs
at /docs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from cloud.guards import bearer_key
from cloud.rest_bodies import (
    BEARER,
    GENERATE_EVENTS,
    SSE_HEADERS,
    STREAM_EVENTS,
    CloseAnswer,
    EventStream,
    GenerateAnswer,
    GenerateBody,
    HealthAnswer,
    ModelAnswer,
    OpenSessionBody,
    ReadyAnswer,
    SessionAnswer,
    SessionCountersAnswer,
    SessionId,
    StreamSessionBody,
    VerifyAnswer,
    VerifyBody,
    encodable_text,
    session_links,
)
from cloud.rest_guards import (
    OBJECT_SLACK,
    REQUEST_ID_PARAMETER,
    BodyLimit,
    BodyRejected,
    CheckedRoute,
    KeyFirst,
    RequestIds,
    error_response,
    error_responses,
)
from cloud.service import GenerateEvent, GenerateRequest, VerifierService
from shared.errors import ERRORS_BY_STATUS, Internal, InvalidArgument, SpecSplitError
from shared.features import feature_to_json, states_to_json
from shared.protocol import (
    OpenSessionRequest,
    StreamDone,
    StreamedToken,
    StreamSessionRequest,
    VerifyResponse,
)
from shared.request_id import CURRENT

log = logging.getLogger(__name__)

def _document_keys(app: FastAPI, keyed: bool) -> None:
    """The schema names the bearer scheme when the cloud has keys (the routes that need one say so)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None and keyed:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = {BEARER: {
                "type": "http", "scheme": "bearer", "description": "one of the cloud's --api-key keys"}}
        return build()

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(service: VerifierService) -> FastAPI:
    app = FastAPI(title="specsplit cloud verifier", version="1",
                  description="Edge-cloud speculative decoding: the wire contract of docs/PROTOCOL.md.")
    app.router.route_class = CheckedRoute
    app.state.max_json_objects = max(service.settings.max_k, service.settings.max_tree_nodes) + OBJECT_SLACK
    app.add_middleware(BodyLimit, max_bytes=service.settings.max_body_bytes, on_error=service.count_error)
    app.add_middleware(KeyFirst, authenticate=service.authenticate, on_error=service.count_error,
                       protect_metrics=service.settings.metrics_auth)
    app.add_middleware(RequestIds, on_response=lambda status: service.count_response("rest", status),
                       on_error=service.count_error)  # outermost

    async def owner(request: Request) -> str:  # async: a sync dependency would cost a threadpool hop per call
        return service.authenticate(bearer_key(request.headers.get("authorization")))

    @app.exception_handler(SpecSplitError)
    async def on_error(_: Request, err: SpecSplitError) -> JSONResponse:
        service.count_error(err.code)
        return error_response(err)

    @app.exception_handler(Exception)
    async def on_crash(r: Request, exc: Exception) -> JSONResponse:
        err = Internal.of(exc)
        log.error("unexpected error %s on %s", err.details["error_id"], r.url.path, exc_info=exc)
        return await on_error(r, err)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                    for e in exc.errors()]
        first = problems[0] if problems else {"loc": [], "msg": "invalid body"}
        msg = f"malformed body: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}"
        return await on_error(_, ERRORS_BY_STATUS[422](msg, problems=problems))

    @app.exception_handler(BodyRejected)
    async def on_rejected(_: Request, exc: BodyRejected) -> JSONResponse:
        return await on_error(_, exc.as_error())

    @app.exception_handler(StarletteHTTPException)
    async def on_http(r: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = ERRORS_BY_STATUS[exc.status_code].code if exc.status_code in ERRORS_BY_STATUS else "http_error"
        service.count_error(code)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # `Allow` lists every method of the path (RFC 9110), not the first route's
            headers["Allow"] = _allowed_methods(app, r.scope)
        return JSONResponse({"error": {"code": code, "message": str(exc.detail)}}, status_code=exc.status_code,
                            headers=headers or None)

    keyed = bool(service.settings.api_keys)
    _document_keys(app, keyed)

    def doc(operation_id: str, answer: Any, *errors: int, links: dict[str, Any] | None = None,
            content: dict[str, Any] | None = None, key: bool = True) -> dict[str, Any]:
        """A route's OpenAPI side: its id, its 200 answer, the errors it answers (with 422 for a malformed
        X-Request-Id and 500 everywhere), the key it needs, and links to the operations on its session."""
        responses = error_responses(*sorted({*errors, 422, 500}))
        responses[200] = {"description": "OK", **({"model": answer} if answer is not None else {}),
                          **({"content": content} if content else {})}
        extra: dict[str, Any] = {"parameters": [REQUEST_ID_PARAMETER]}
        if key and keyed:
            extra["security"] = [{BEARER: []}]
        if links:
            extra["responses"] = {"200": {"links": links}}
        return {"operation_id": operation_id, "responses": responses, "openapi_extra": extra}

    @app.get("/healthz", tags=["ops"], response_model=None, **doc("healthz", HealthAnswer, key=False))
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    ready_doc = doc("readyz", ReadyAnswer, key=False)
    ready_doc["responses"][503] = {"model": ReadyAnswer, "description": "starting, draining, or a lost rank",
                                   "headers": error_responses(503)[503]["headers"]}

    @app.get("/readyz", tags=["ops"], response_model=None, **ready_doc)
    async def readyz() -> JSONResponse:
        ready = service.ready
        return JSONResponse({"ready": ready, "model_id": service.info.model_id}, status_code=200 if ready else 503,
                            headers=None if ready else {"Retry-After": "1"})

    metrics_keyed = service.settings.metrics_auth

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse,
             **doc("metrics", None, *((401,) if metrics_keyed else ()), key=metrics_keyed,
                   content={"text/plain": {"schema": {"type": "string", "description": "Prometheus text format"}}}))
    async def metrics() -> Response:
        return Response(service.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/model", tags=["v1"], response_model=None, **doc("model", ModelAnswer, 401))
    async def model(_: str = Depends(owner)) -> dict[str, Any]:
        return {**asdict(service.info), "forward_cost": service.forward_cost()}

    @app.post("/v1/sessions", tags=["v1"], response_model=None,
              **doc("open_session", SessionAnswer, 401, 413, 429, 503, links=session_links("$response.body#/ctx_id")))
    async def open_session(body: OpenSessionBody, request: Request, who: str = Depends(owner)
                           ) -> dict[str, Any] | Response:
        req = OpenSessionRequest(body.prompt_ids, body.sampling_cfg.to_cfg(), body.seed, body.correction,
                                 body.max_new_tokens, body.feature_encoding, body.feature_window)
        rid = CURRENT.get()  # with one, a retry joins this open (cloud/idempotent_opens.py)
        task = asyncio.ensure_future(service.open_session(req, who, rid))
        if await _done_before_disconnect(request, task) and not await request.is_disconnected():
            info = task.result()
            return {**{k: v for k, v in asdict(info).items() if k != "counters"},
                    "feature": feature_to_json(info.feature), "states": states_to_json(info.states)}
        # the client went away: without a request id its prefill left the queue, and a session opened meanwhile
        # is closed now (nobody learns its ctx_id), not at the TTL; with one, the session waits for the retry
        if not rid and not task.cancelled() and task.exception() is None:
            service.close_session(task.result().ctx_id, who)
        log.info("open abandoned: the client went away")
        return Response(status_code=499)

    @app.post("/v1/verify", tags=["v1"], response_model=None,
              **doc("verify", VerifyAnswer, 401, 403, 404, 409, 413, 429, 503,
                    links=session_links("$request.body#/ctx_id")))
    async def verify(body: VerifyBody, who: str = Depends(owner)) -> Response:
        body.check_counts(service)
        cfg = body.sampling_cfg.to_cfg() if body.sampling_cfg is not None else None
        return _json(verify_answer(await service.verify(body.to_request(), who, body.k, cfg)))

    @app.get("/v1/sessions/{ctx_id}", tags=["v1"], response_model=None,
             **doc("get_session", SessionCountersAnswer, 401, 403, 404, 503,
                   links=session_links("$response.body#/ctx_id")))
    async def get_session(ctx_id: SessionId, who: str = Depends(owner)) -> dict[str, Any]:
        return asdict(service.get_session(_path_text(ctx_id), who))

    @app.delete("/v1/sessions/{ctx_id}", tags=["v1"], response_model=None,
                **doc("close_session", CloseAnswer, 401, 403, 404, 503))
    async def close_session(ctx_id: SessionId, who: str = Depends(owner)) -> dict[str, Any]:
        service.close_session(_path_text(ctx_id), who)
        return {"closed": True, "ctx_id": ctx_id}

    @app.post("/v1/sessions/{ctx_id}/stream", tags=["v1"], response_model=None, response_class=EventStream,
              **doc("stream_session", None, 401, 403, 404, 409, 413, 429, 503, content=STREAM_EVENTS))
    async def stream_session(ctx_id: SessionId, body: StreamSessionBody, who: str = Depends(owner)
                             ) -> StreamingResponse:
        req = StreamSessionRequest(_path_text(ctx_id), body.ctx_len, body.ctx_hash, body.max_new_tokens,
                                   body.stop_at_eos)
        events = service.stream_session(req, who)  # a refused stream answers its status before any event
        return EventStream(_sse(events, _stream_frame, "a session stream"), headers=SSE_HEADERS)

    @app.post("/v1/generate", tags=["v1"], response_model=None,
              **doc("generate", GenerateAnswer, 401, 413, 429, 503, content=GENERATE_EVENTS))
    async def generate(body: GenerateBody, request: Request, who: str = Depends(owner)
                       ) -> dict[str, Any] | StreamingResponse | Response:
        req = GenerateRequest(body.prompt_ids, body.sampling_cfg.to_cfg(), body.seed, body.max_new_tokens,
                              body.stop_at_eos)
        events = service.start_generate(req, who)
        if body.stream:  # a disconnect cancels the stream (Starlette listens for it)
            return EventStream(_sse(events, _generate_frames(), "a generate stream"), headers=SSE_HEADERS)
        task = asyncio.ensure_future(_collect(events))
        if not await _done_before_disconnect(request, task):  # nobody to answer: the generation left the queue
            log.info("generate stopped: the client went away")
            return Response(status_code=499)
        return task.result()

    return app


async def _collect(events: AsyncIterator[GenerateEvent]) -> dict[str, Any]:
    ids: list[int] = []
    metrics: dict[str, Any] = {}
    try:
        async for e in events:
            if e.token_id is not None:
                ids.append(e.token_id)
            metrics = e.metrics or metrics
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    return {"token_ids": ids, "metrics": metrics}


async def _done_before_disconnect(request: Request, task: asyncio.Future[Any]) -> bool:
    """Wait for `task`; when the client disconnects first, cancel it (an open or a generation then leaves the
    model's queue, or stops after its forward in progress), wait until it has stopped, and return False."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return True
    task.cancel()
    await asyncio.wait({task})
    return False


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read before: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _allowed_methods(app: FastAPI, scope: Scope) -> str:
    """The methods of every route whose path matches the request's (its 405's `Allow` header)."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods or set()
    return ", ".join(sorted(methods))


def _path_text(value: str) -> str:
    try:
        return encodable_text(value)
    except ValueError as e:
        raise InvalidArgument(f"malformed path: {e}") from None


def _generate_frames() -> Callable[[GenerateEvent], str]:
    """/v1/generate's events: `data: {"token_id", "index"}` per token, then `event: done` with
    `{"token_ids", "metrics"}`."""
    ids: list[int] = []

    def frame(e: GenerateEvent) -> str:
        if e.token_id is not None:
            ids.append(e.token_id)
            return f"data: {json.dumps({'token_id': e.token_id, 'index': len(ids) - 1})}\n\n"
        return f"event: done\ndata: {json.dumps({'token_ids': ids, 'metrics': e.metrics})}\n\n"

    return frame


def _stream_frame(e: StreamedToken | StreamDone) -> str:
    """A session stream's events: `data: {"token_id", "ctx_len", "feature"?, "states"?}` per token (feature and
    states as in a verify answer, sent only for a session that asked for them), then `event: done` with
    `{"tokens", "ctx_len", "ctx_hash", "metrics"}`."""
    if isinstance(e, StreamDone):
        return f"event: done\ndata: {json.dumps(asdict(e))}\n\n"
    d: dict[str, Any] = {"token_id": e.token_id, "ctx_len": e.ctx_len}
    if e.node_budget:
        d["node_budget"] = e.node_budget
    if e.feature is not None:
        d["feature"] = feature_to_json(e.feature)
    if e.states is not None:
        d["states"] = states_to_json(e.states)
    return f"data: {json.dumps(d)}\n\n"


async def _sse(events: AsyncIterator[Any], frame: Callable[[Any], str], what: str) -> AsyncIterator[str]:
    """Server-sent events, one `frame` per event; a failure mid-stream ends with `event: error` and the error
    body. A disconnect cancels the stream (Starlette listens for it) and closes `events`."""
    try:
        async for e in events:
            yield frame(e)
    except SpecSplitError as err:
        yield f"event: error\ndata: {json.dumps(err.to_body())}\n\n"
    except Exception as exc:  # noqa: BLE001 - any other failure is a 500 of its own, said in the stream
        crash = Internal.of(exc)
        log.error("unexpected error %s in %s", crash.details["error_id"], what, exc_info=exc)
        yield f"event: error\ndata: {json.dumps(crash.to_body())}\n\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def verify_answer(resp: VerifyResponse) -> dict[str, Any]:
    """A verify answer's JSON object, built field by field (the hot path: no recursive conversion)."""
    return {"accepted_len": resp.accepted_len, "correction": resp.correction, "next_kind": resp.next_kind,
            "target_dist": None if resp.target_dist is None else asdict(resp.target_dist), "ctx_len": resp.ctx_len,
            "ctx_hash": resp.ctx_hash, "top_k_ids": resp.top_k_ids, "metrics": asdict(resp.metrics),
            "feature": feature_to_json(resp.feature), "accepted_nodes": resp.accepted_nodes,
            "states": states_to_json(resp.states), "node_budget": resp.node_budget}


def _json(d: dict[str, Any]) -> Response:
    """`d` as a JSON answer, serialised once (FastAPI would validate and encode a returned dict again)."""
    return Response(json.dumps(d, separators=(",", ":")).encode(), media_type="application/json")

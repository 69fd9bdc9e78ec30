"""REST boundary (FastAPI): pydantic bodies <-> shared.protocol dataclasses, errors -> status codes.

Routes stay thin: parse -> service -> serialise. `SpecSplitError` -> its REST status in one
handler (`_error_response`); pydantic's validation errors come out in the same body with 422.
OpenAPI docs at /docs.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloud.service import GenerateEvent, GenerateRequest, VerifierService
from shared.config import SamplingConfig
from shared.errors import ERRORS_BY_STATUS, PayloadTooLarge, SpecSplitError
from shared.protocol import DraftProposal, OpenSessionRequest, SparseDist, VerifyRequest

log = logging.getLogger(__name__)


class SamplingBody(BaseModel):
    """Processing applied alike to p (cloud) and q (edge); temperature 0 = greedy."""
    model_config = ConfigDict(extra="forbid")  # a misspelt field would silently split p from q
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = 0
    repetition_penalty: float = 1.0

    def to_cfg(self) -> SamplingConfig:
        return SamplingConfig.from_dict(self.model_dump())


class OpenSessionBody(BaseModel):
    prompt_ids: list[StrictInt]
    sampling_cfg: SamplingBody = Field(default_factory=SamplingBody)
    seed: StrictInt = 0
    correction: str = "strict"
    max_new_tokens: StrictInt = 256


class SparseDistBody(BaseModel):
    ids: list[StrictInt]
    probs: list[float]


class VerifyBody(BaseModel):
    ctx_id: str
    ctx_len: StrictInt
    ctx_hash: str
    append_ids: list[StrictInt] = Field(default_factory=list)
    draft_tokens: list[StrictInt]
    q_token_probs: list[float]
    q_dists: list[SparseDistBody] | None = None
    draft_kind: str = "sampled"
    hard_mask: list[StrictInt] | None = None
    k: StrictInt
    return_top_k: StrictInt = 0
    request_id: str = ""
    # optional: when sent it must equal the session's (422 otherwise)
    sampling_cfg: SamplingBody | None = None

    def to_request(self) -> VerifyRequest:
        dists = None if self.q_dists is None else [SparseDist(d.ids, d.probs) for d in self.q_dists]
        draft = DraftProposal(self.draft_tokens, self.q_token_probs, self.draft_kind, dists, self.hard_mask)
        return VerifyRequest(self.ctx_id, self.ctx_len, self.ctx_hash, self.append_ids, draft,
                             self.return_top_k, self.request_id)


class GenerateBody(BaseModel):
    prompt_ids: list[StrictInt]
    sampling_cfg: SamplingBody = Field(default_factory=SamplingBody)
    seed: StrictInt = 0
    max_new_tokens: StrictInt = 64
    # true: server-sent events, one `data: {"token_id", "index"}` per token, then `event: done`
    stream: bool = False
    stop_at_eos: bool = True


def _error_response(err: SpecSplitError) -> JSONResponse:
    retry_after = err.details.get("retry_after_s")
    headers = {"Retry-After": str(math.ceil(retry_after))} if isinstance(retry_after, (int, float)) else None
    return JSONResponse(err.to_body(), status_code=err.http_status, headers=headers)


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Any) -> None:
        self.app, self.max_bytes, self.on_error = app, max_bytes, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        err = PayloadTooLarge(f"request body exceeds max_body_bytes = {self.max_bytes}")
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        seen, more = 0, not too_big
        while more and not too_big:  # buffer the body (at most max_bytes) so a stream is limited too
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            seen += len(chunks[-1])
            more, too_big = msg.get("more_body", False), seen > self.max_bytes
        if too_big:
            self.on_error(err.code)
            return await _error_response(err)(scope, receive, send)
        body, sent = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def create_app(service: VerifierService) -> FastAPI:
    app = FastAPI(title="specsplit cloud verifier", version="1",
                  description="Edge-cloud speculative decoding: the wire contract of PROTOCOL.md.")
    app.add_middleware(BodyLimit, max_bytes=service.settings.max_body_bytes, on_error=service.count_error)

    def owner(request: Request) -> str:
        return service.authenticate(bearer(request))

    @app.exception_handler(SpecSplitError)
    async def on_error(_: Request, err: SpecSplitError) -> JSONResponse:
        service.count_error(err.code)
        return _error_response(err)

    @app.exception_handler(Exception)
    async def on_crash(r: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", r.url.path)
        return await on_error(r, SpecSplitError(f"internal error: {type(exc).__name__}"))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
                    for e in exc.errors()]
        first = problems[0] if problems else {"loc": [], "msg": "invalid body"}
        msg = f"malformed body: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}"
        return await on_error(_, ERRORS_BY_STATUS[422](msg, problems=problems))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = ERRORS_BY_STATUS[exc.status_code].code if exc.status_code in ERRORS_BY_STATUS else "http_error"
        service.count_error(code)
        return JSONResponse({"error": {"code": code, "message": str(exc.detail)}}, status_code=exc.status_code)

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz() -> JSONResponse:
        ready = service.ready
        return JSONResponse({"ready": ready, "model_id": service.info.model_id}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        return Response(service.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/model", tags=["v1"])
    async def model(_: str = Depends(owner)) -> dict[str, Any]:
        return asdict(service.info)

    @app.post("/v1/sessions", tags=["v1"])
    async def open_session(body: OpenSessionBody, who: str = Depends(owner)) -> dict[str, Any]:
        req = OpenSessionRequest(body.prompt_ids, body.sampling_cfg.to_cfg(), body.seed, body.correction,
                                 body.max_new_tokens)
        info = await service.open_session(req, who)
        return {k: v for k, v in asdict(info).items() if k != "counters"}

    @app.post("/v1/verify", tags=["v1"])
    async def verify(body: VerifyBody, who: str = Depends(owner)) -> dict[str, Any]:
        cfg = body.sampling_cfg.to_cfg() if body.sampling_cfg is not None else None
        return asdict(await service.verify(body.to_request(), who, body.k, cfg))

    @app.get("/v1/sessions/{ctx_id}", tags=["v1"])
    async def get_session(ctx_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        return asdict(service.get_session(ctx_id, who))

    @app.delete("/v1/sessions/{ctx_id}", tags=["v1"])
    async def close_session(ctx_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        service.close_session(ctx_id, who)
        return {"closed": True, "ctx_id": ctx_id}

    @app.post("/v1/generate", tags=["v1"], response_model=None)
    async def generate(body: GenerateBody, who: str = Depends(owner)) -> dict[str, Any] | StreamingResponse:
        req = GenerateRequest(body.prompt_ids, body.sampling_cfg.to_cfg(), body.seed, body.max_new_tokens,
                              body.stop_at_eos)
        events = service.start_generate(req, who)
        if body.stream:
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        ids: list[int] = []
        metrics: dict[str, Any] = {}
        async for e in events:
            if e.token_id is not None:
                ids.append(e.token_id)
            metrics = e.metrics or metrics
        return {"token_ids": ids, "metrics": metrics}

    return app


async def _sse(events: AsyncIterator[GenerateEvent]) -> AsyncIterator[str]:
    """Server-sent events: `data: {"token_id", "index"}` per token, then `event: done` with
    `{"token_ids", "metrics"}`; a failure mid-stream ends with `event: error` and the error body."""
    ids: list[int] = []
    try:
        async for e in events:
            if e.token_id is not None:
                ids.append(e.token_id)
                yield f"data: {json.dumps({'token_id': e.token_id, 'index': len(ids) - 1})}\n\n"
            else:
                yield f"event: done\ndata: {json.dumps({'token_ids': ids, 'metrics': e.metrics})}\n\n"
    except SpecSplitError as err:
        yield f"event: error\ndata: {json.dumps(err.to_body())}\n\n"

"""REST boundary (FastAPI): pydantic bodies <-> shared.protocol dataclasses, errors -> status codes.

Routes stay thin: parse -> service -> serialise. `SpecSplitError` -> its REST status in one
handler (`rest_guards.error_response`, with Retry-After on 429 / 503); pydantic's validation
errors come out in the same body with 422. The key, the body size and the JSON parse are checked
before a route runs (cloud/rest_guards.py). Floats are strict (no strings, no booleans), like ints;
strings must be encodable text (no lone surrogates). OpenAPI docs at /docs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Annotated, Any, Literal, get_type_hints

from fastapi import Depends, FastAPI, Request
from fastapi import Path as FastAPIPath
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictFloat, StrictInt, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from cloud.guards import bearer_key, check_dist_sizes, check_verify_counts
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
from shared.config import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingConfig,
)
from shared.errors import ERRORS_BY_STATUS, Internal, InvalidArgument, SpecSplitError
from shared.features import feature_to_json, states_to_json
from shared.protocol import (
    DraftProposal,
    ModelInfo,
    OpenSessionRequest,
    SparseDist,
    StreamDone,
    StreamedToken,
    StreamSessionRequest,
    VerifyRequest,
    VerifyResponse,
)
from shared.request_id import CURRENT

log = logging.getLogger(__name__)
# lists sized by k: no setting allows more (CloudSettings.max_k <= 256); the exact limit is checked after
K_LIST_MAX = 256
# server-sent events go out as they are made: a proxy that buffers (nginx does by default) holds them back
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _text(v: str) -> str:
    """Strings must be text that can be sent back (a lone surrogate cannot be encoded)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from None
    return v


Text = Annotated[str, AfterValidator(_text)]
KList = Field(max_length=K_LIST_MAX)
# a token id: >= 0 here; < the model's tokenizer_size (GET /v1/model) is checked by the service, a bound that
# depends on the model
TokenId = Annotated[StrictInt, Field(ge=0)]
# 16 lower-case hex digits: the FNV-1a hash of S[:ctx_len] (PROTOCOL.md, "Hash")
CtxHash = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$", description="hash of S[:ctx_len]: 16 lower-case hex "
                                                                      "digits (PROTOCOL.md, Hash)")]
Seed = Annotated[StrictInt, Field(ge=0, lt=2**64, description="keys every coin and sample: same seed and "
                                                                "requests, same text")]
PROMPT_IDS = "the prompt's token ids, each < tokenizer_size; at most --max-prompt-len (default: the model's context)"


def _schema(description: str | None = None, **keywords: Any) -> Any:
    """A bound stated in the schema alone: enforced after parsing by the shared checks, whose messages (for
    sampling, the field's name first, as PROTOCOL.md promises) a pydantic constraint would replace."""
    return Field(description=description, json_schema_extra=keywords)


class SamplingBody(BaseModel):
    """Processing applied alike to p (cloud) and q (edge); temperature 0 = greedy. The ranges are checked by
    shared/config.py (422, the message starts with the field's name)."""
    model_config = ConfigDict(extra="forbid")  # a misspelt field would silently split p from q
    temperature: Annotated[StrictFloat, _schema(
        anyOf=[{"const": 0}, {"minimum": MIN_TEMPERATURE, "maximum": MAX_TEMPERATURE}],
        description="0 is greedy (argmax, no randomness); else in [1e-6, 1e3]")] = 1.0
    top_p: Annotated[StrictFloat, _schema(minimum=MIN_TOP_P, maximum=1.0, description="1.0 disables")] = 1.0
    top_k: Annotated[StrictInt, _schema(minimum=0, description="0 disables")] = 0
    repetition_penalty: Annotated[StrictFloat, _schema(
        minimum=MIN_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY, description="1.0 disables")] = 1.0

    def to_cfg(self) -> SamplingConfig:
        return SamplingConfig.from_dict(self.model_dump())


class OpenSessionBody(BaseModel):
    prompt_ids: Annotated[list[TokenId], Field(min_length=1, description=PROMPT_IDS + "; a reopen sends the whole S")]
    sampling_cfg: SamplingBody = Field(default_factory=SamplingBody)
    seed: Seed = 0
    # "strict" is exact; "shortcut" draws corrections from p alone (faster, biased)
    correction: Literal["strict", "shortcut"] = "strict"
    # the generation budget the edge intends (reported, not enforced)
    max_new_tokens: Annotated[StrictInt, Field(ge=0)] = 256
    # "" (none), "float16" or "int8": the open answer and every verify answer carry the target's feature
    feature_encoding: Literal["", "float16", "int8"] = ""
    # > 0: states at every committed position, and this many of the prompt's last at the open
    feature_window: Annotated[StrictInt, Field(ge=0, description="at most max_feature_window (GET /v1/model); "
                                                                 "> 0 needs a feature_encoding")] = 0


class SparseDistBody(BaseModel):
    ids: Annotated[list[TokenId], Field(description="the support: distinct ids < tokenizer_size")]
    probs: Annotated[list[Annotated[StrictFloat, _schema(minimum=0)]], Field(
        description="one per id; a q_dists row sums to 1 within 1e-3")]


class VerifyBody(BaseModel):
    ctx_id: Annotated[Text, Field(description="the open answer's ctx_id")]
    ctx_len: Annotated[StrictInt, Field(ge=1, description="|S| as the edge holds it, append_ids included; "
                                                          "ctx_len + k + 1 <= max_context")]
    ctx_hash: CtxHash
    append_ids: Annotated[list[TokenId], Field(default_factory=list, description="the last tokens of S the cloud "
                                                                                 "may not have yet; at most ctx_len")]
    draft_tokens: Annotated[list[TokenId], KList]
    q_token_probs: Annotated[list[Annotated[StrictFloat, _schema(exclusiveMinimum=0, maximum=1)]], KList, Field(
        description="q_i in (0, 1] per draft token; 1.0 for a deterministic drafter and for a greedy one")]
    q_dists: Annotated[list[SparseDistBody], KList] | None = None
    draft_kind: Literal["sampled", "deterministic"] = "sampled"
    hard_mask: Annotated[list[Annotated[StrictInt, Field(ge=0, le=1)]], KList] | None = None
    k: Annotated[StrictInt, Field(ge=0, le=K_LIST_MAX, description="len(draft_tokens); at most max_k for a chain, "
                                                                   "max_tree_nodes for a tree (GET /v1/model)")]
    return_top_k: Annotated[StrictInt, Field(ge=0, description="at most --max-return-top-k (default 64)")] = 0
    request_id: Annotated[str, Field(max_length=128), AfterValidator(_text)] = ""
    # optional: when sent it must equal the session's (422 otherwise)
    sampling_cfg: SamplingBody | None = None
    # the last draft token is checked against p after the others instead of being run; no bonus
    check_last: bool = False
    # a token tree: each draft token's parent (-1: the committed context); absent: a chain
    tree_parents: Annotated[list[Annotated[StrictInt, Field(ge=-1)]], KList] | None = None

    def check_counts(self, service: VerifierService) -> None:
        """The list lengths against k and the limits, before anything is converted."""
        lim = service.limits
        check_verify_counts(declared_k=self.k, n_draft=len(self.draft_tokens), n_q=len(self.q_token_probs),
                            n_dists=None if self.q_dists is None else len(self.q_dists),
                            n_hard=len(self.hard_mask or ()), n_append=len(self.append_ids), max_k=lim.max_k,
                            max_context=lim.max_context,
                            n_parents=None if self.tree_parents is None else len(self.tree_parents),
                            max_tree_nodes=lim.max_tree_nodes)
        check_dist_sizes(((len(d.ids), len(d.probs)) for d in self.q_dists or ()), lim.vocab_size)

    def to_request(self) -> VerifyRequest:
        dists = None if self.q_dists is None else [SparseDist(d.ids, d.probs) for d in self.q_dists]
        draft = DraftProposal(self.draft_tokens, self.q_token_probs, self.draft_kind, dists, self.hard_mask,
                              self.tree_parents)
        return VerifyRequest(self.ctx_id, self.ctx_len, self.ctx_hash, self.append_ids, draft,
                             self.return_top_k, self.request_id, self.check_last)


class GenerateBody(BaseModel):
    prompt_ids: Annotated[list[TokenId], Field(min_length=1, description=PROMPT_IDS)]
    sampling_cfg: SamplingBody = Field(default_factory=SamplingBody)
    seed: Seed = 0
    max_new_tokens: Annotated[StrictInt, Field(ge=0, description="at most max_generate_tokens (GET /v1/model)")] = 64
    # true: server-sent events, one `data: {"token_id", "index"}` per token, then `event: done`
    stream: bool = False
    stop_at_eos: bool = True


class StreamSessionBody(BaseModel):
    # |S| the client holds; the cloud keeps S[:ctx_len] (it may hold more, from a stream the client left)
    ctx_len: Annotated[StrictInt, Field(ge=1)]
    ctx_hash: CtxHash
    max_new_tokens: Annotated[StrictInt, Field(ge=1, description="at most max_generate_tokens (GET /v1/model)")] = 64
    stop_at_eos: bool = True


# --- what the routes answer: schemas for the OpenAPI document only (the routes build their JSON themselves) ---
class FeatureAnswer(BaseModel):
    """The target's state for feature-fed drafting (PROTOCOL.md, "Feature-fed drafting")."""
    prefix_len: int
    encoding: Literal["float16", "int8"]
    data: str = Field(description="the vector's bytes, base64")
    scale: float


class StatesAnswer(BaseModel):
    """The target's states at consecutive positions (PROTOCOL.md, "States for every committed position")."""
    first: int
    count: int
    encoding: Literal["float16", "int8"]
    data: str = Field(description="count vectors one after another, base64")
    scales: list[float]


class NodeAcceptanceAnswer(BaseModel):
    """The key's recent draft nodes by tenth of their q: tried and kept (decayed)."""
    kept: list[float]
    tried: list[float]


class SessionAnswer(BaseModel):
    """The open answer (PROTOCOL.md, "Opening a session")."""
    ctx_id: str = Field(description="the session's unguessable id")
    ctx_len: int
    ctx_hash: str
    vocab_size: int = Field(description="the ids accepted on the wire: 0 .. vocab_size - 1")
    numerics: str
    node_budget: int
    tokenizer_fingerprint: str
    node_acceptance: NodeAcceptanceAnswer | None
    feature: FeatureAnswer | None
    states: StatesAnswer | None
    forward_cost: dict[str, float | int | bool] | None = Field(
        description="the open answer: the cloud's fitted forward cost as of the open (GET /v1/model's); else null")


class SessionCountersAnswer(SessionAnswer):
    """GET /v1/sessions/{ctx_id}: the session's committed length and hash, and its counters."""
    counters: dict[str, Any] = Field(description="rounds, drafted, accepted, emitted, replayed, prefill_ms, streamed, "
                                                 "prompt_len, kv_len, kv_bytes, idle_s, age_s, seed, correction, "
                                                 "max_new_tokens, sampling_cfg, feature_encoding, feature_window")


class RoundMetricsAnswer(BaseModel):
    alpha_mean: float
    la_over_k: float
    prefill_ms: float
    queue_ms: float
    la_over_depth: float
    row_ms: float


class VerifyAnswer(BaseModel):
    """A verify round's answer (PROTOCOL.md, "A verify round")."""
    accepted_len: int
    correction: int | None = Field(description="the next token for correction and bonus; null for residual, none")
    next_kind: Literal["correction", "bonus", "residual", "none"]
    target_dist: SparseDistBody | None = Field(description="residual only: the processed p_j")
    ctx_len: int
    ctx_hash: str
    top_k_ids: list[list[int]]
    metrics: RoundMetricsAnswer
    feature: FeatureAnswer | None
    accepted_nodes: list[int] | None
    states: StatesAnswer | None
    node_budget: int


class CloseAnswer(BaseModel):
    closed: bool
    ctx_id: str


class GenerateMetricsAnswer(BaseModel):
    tokens: int
    prefill_ms: float
    decode_ms: float
    queue_ms: float
    total_ms: float
    stop_reason: Literal["length", "eos", "context"]


class GenerateAnswer(BaseModel):
    token_ids: list[int]
    metrics: GenerateMetricsAnswer


class HealthAnswer(BaseModel):
    status: Literal["ok"]


class ReadyAnswer(BaseModel):
    ready: bool
    model_id: str


# GET /v1/model: ModelInfo's fields (shared/protocol.py), the fitted forward cost as the cloud says it now
_MODEL_FIELDS: dict[str, Any] = {name: (kind, ...) for name, kind in get_type_hints(ModelInfo).items()}
_MODEL_FIELDS["forward_cost"] = (dict[str, float | int | bool], Field(description="the fitted forward cost "
                                                                          "(PROTOCOL.md, Model info)"))
ModelAnswer = create_model("ModelAnswer", **_MODEL_FIELDS)


def _event_stream(data: dict[str, Any]) -> dict[str, Any]:
    """The schema of one server-sent event as a client reads it: `event` (message, done, error) and `data`, JSON
    text of the schema `data` (an annotation: JSON Schema does not parse the text)."""
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"event": {"type": "string", "enum": ["message", "done", "error"]},
                       "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data}}}}}


GENERATE_EVENTS = _event_stream({"oneOf": [
    {"type": "object", "required": ["token_id", "index"], "description": "event message: one token",
     "properties": {"token_id": {"type": "integer"}, "index": {"type": "integer"}}},
    {"type": "object", "required": ["token_ids", "metrics"], "description": "event done: the whole text",
     "properties": {"token_ids": {"type": "array", "items": {"type": "integer"}}, "metrics": {"type": "object"}}},
    {"type": "object", "required": ["error"], "description": "event error: the error body"}]})
STREAM_EVENTS = _event_stream({"oneOf": [
    {"type": "object", "required": ["token_id", "ctx_len"], "description": "event message: one k = 0 round's token",
     "properties": {"token_id": {"type": "integer"}, "ctx_len": {"type": "integer"},
                    "node_budget": {"type": "integer"}, "feature": {"type": "object"}, "states": {"type": "object"}}},
    {"type": "object", "required": ["tokens", "ctx_len", "ctx_hash", "metrics"],
     "description": "event done: the session's committed context after the stream",
     "properties": {"tokens": {"type": "integer"}, "ctx_len": {"type": "integer"}, "ctx_hash": {"type": "string"},
                    "metrics": {"type": "object"}}},
    {"type": "object", "required": ["error"], "description": "event error: the error body"}]})


# the security scheme the /v1/ routes name when the cloud has keys: `Authorization: Bearer KEY`
BEARER = "bearer"
# a session's id in a path
SessionId = Annotated[str, FastAPIPath(description="the open answer's ctx_id")]


class EventStream(StreamingResponse):
    """Server-sent events (the answer's media type, and what the schema says the route answers)."""
    media_type = "text/event-stream"


def session_links(ctx_id: str) -> dict[str, Any]:
    """OpenAPI links from an answer that names a session (its ctx_id at the runtime expression `ctx_id`, and its
    committed `ctx_len`, `ctx_hash` in the answer) to the operations on that session. A link's requestBody is a
    whole body whose values may be runtime expressions (`x-schemathesis` tells that fuzzer to send it whole
    rather than merge some of its fields into a body it made up)."""
    ctx = {"ctx_len": "$response.body#/ctx_len", "ctx_hash": "$response.body#/ctx_hash"}
    path = {"path.ctx_id": ctx_id}
    whole = {"x-schemathesis": {"merge_body": False}}
    return {
        "verify": {"operationId": "verify", "requestBody": {"ctx_id": ctx_id, **ctx, "append_ids": [],
                                                            "draft_tokens": [], "q_token_probs": [], "k": 0},
                   "description": "the session's next round on its committed context: a k = 0 round (the target's "
                                  "own next token) unless the client puts its draft in", **whole},
        "stream_session": {"operationId": "stream_session", "parameters": path, "requestBody": ctx, **whole,
                           "description": "stream the target's own tokens on the session"},
        "get_session": {"operationId": "get_session", "parameters": path},
        "close_session": {"operationId": "close_session", "parameters": path},
    }


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
        rid = CURRENT.get()  # with one, a retry joins this open (cloud/opens.py)
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
        return _text(value)
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

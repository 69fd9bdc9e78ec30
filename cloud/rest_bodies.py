"""The REST wire's bodies and answers: pydantic models whose bounds are the API's, and the OpenAPI pieces (event
streams, links from an open to the operations on its session) that cloud/rest.py's routes declare.

Bounds a body breaks are refused at parse (422) before any session is looked up; bounds that depend on the model
or the settings (a token id below tokenizer_size, k within max_k) are checked after parsing by the shared checks,
and the schema states them (`_schema`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, get_type_hints

from fastapi import Path as FastAPIPath
from fastapi.responses import StreamingResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    create_model,
)

from cloud.guards import check_dist_sizes, check_verify_counts
from shared.config import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingConfig,
)
from shared.protocol import DraftProposal, ModelInfo, SparseDist, VerifyRequest

if TYPE_CHECKING:
    from cloud.service import VerifierService

# lists sized by k: no setting allows more (CloudSettings.max_k <= 256); the exact limit is checked after
K_LIST_MAX = 256
# server-sent events go out as they are made: a proxy that buffers (nginx does by default) holds them back
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encodable_text(v: str) -> str:
    """Strings must be text that can be sent back (a lone surrogate cannot be encoded)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (no lone surrogates)") from None
    return v


Text = Annotated[str, AfterValidator(encodable_text)]
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
    request_id: Annotated[str, Field(max_length=128), AfterValidator(encodable_text)] = ""
    # optional: when sent it must equal the session's (422 otherwise)
    sampling_cfg: SamplingBody | None = None
    # the last draft token is checked against p after the others instead of being run; no bonus
    check_last: StrictBool = False
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
    stream: StrictBool = False
    stop_at_eos: StrictBool = True


class StreamSessionBody(BaseModel):
    # |S| the client holds; the cloud keeps S[:ctx_len] (it may hold more, from a stream the client left)
    ctx_len: Annotated[StrictInt, Field(ge=1)]
    ctx_hash: CtxHash
    max_new_tokens: Annotated[StrictInt, Field(ge=1, description="at most max_generate_tokens (GET /v1/model)")] = 64
    stop_at_eos: StrictBool = True


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

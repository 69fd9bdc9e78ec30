"""An in-process cloud for edge unit tests: PROTOCOL.md's verify semantics on a local target model.

It implements the edge's Transport interface directly (no sockets) with the shared verify rule, so
the client's round logic, recovery and bookkeeping can be tested fast and deterministically.
Faults are scripted per method: `fail(method, error, times, apply_first=False)`; with apply_first
the request is applied before the error is raised (a lost or late answer).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from edge.transport.base import GenerateResult, ModelInfo, Traffic
from shared.config import SamplingConfig
from shared.errors import ContextMismatch, InvalidArgument, NotFound, SpecSplitError
from shared.hashing import ctx_hash
from shared.protocol import (
    DraftProposal,
    ForwardCostInfo,
    NodeAcceptance,
    OpenSessionRequest,
    RoundMetrics,
    SessionInfo,
    SparseDist,
    StreamDone,
    StreamedToken,
    VerifyRequest,
    VerifyResponse,
)
from shared.rng import SAMPLE, position_uniform, sample_index
from shared.sampling import processed_probs
from shared.verify import dense_from_sparse, verify_round


@dataclass
class _Session:
    ids: list[int]
    cfg: SamplingConfig
    seed: int
    correction: str


@dataclass
class _Fault:
    error: SpecSplitError
    times: int
    apply_first: bool


@dataclass
class FakeCloud:
    model_dir: Path
    eos_ids: list[int] = field(default_factory=list)
    sessions: dict[str, _Session] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    requests: list[VerifyRequest] = field(default_factory=list)
    supports_generate: bool = True
    # streams target-only tokens on a session (PROTOCOL.md "Streaming on a session")
    supports_session_stream: bool = True
    # tokens a stream yields before it fails with the next `stream` fault (None: the fault comes first)
    stream_fail_after: int | None = None
    # the cloud's --max-generate-tokens (0: not announced, no limit): a longer stream is refused with 422
    max_generate_tokens: int = 0
    # max_new_tokens of each stream asked for
    stream_sizes: list[int] = field(default_factory=list)
    # routing keys and request ids the client asked for, one per routed() view
    route_keys: list[str] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)
    # ModelInfo.numerics the open answers carry (a test changes it to play a failover to other numerics)
    numerics: str = "pytorch float32 invariant tp1 avx2 weights:fake"
    # the node budget the open answers carry (0: none said)
    open_budget: int = 0
    # the tokenizer fingerprint the model info and the open answers carry ("": none, as an older cloud)
    tokenizer_fingerprint: str = ""
    # the pooled node acceptance the open answers carry (None: none said)
    open_acceptance: NodeAcceptance | None = None
    # the fitted forward cost the open answers / the model info carry, as GET /v1/model's `forward_cost` (base_ms,
    # row_ms, forwards); None: none said, as an older cloud
    open_forward_cost: dict[str, Any] | None = None
    model_forward_cost: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir).eval()
        self.vocab = int(self.model.get_output_embeddings().out_features)
        self.max_context = int(self.model.config.n_positions)
        self.traffic = Traffic()
        self._faults: dict[str, list[_Fault]] = {}

    # -- scripting ------------------------------------------------------------------------------

    def fail(self, method: str, error: SpecSplitError, times: int = 1, apply_first: bool = False) -> None:
        self._faults.setdefault(method, []).append(_Fault(error, times, apply_first))

    def evict_all(self) -> None:
        self.sessions.clear()

    def _fault(self, method: str) -> _Fault | None:
        queue = self._faults.get(method) or []
        if not queue:
            return None
        f = queue[0]
        f.times -= 1
        if f.times <= 0:
            queue.pop(0)
        return f

    def _enter(self, method: str) -> _Fault | None:
        self.calls.append(method)
        self.traffic.calls += 1
        self.traffic.bytes_up += 10
        self.traffic.bytes_down += 10
        f = self._fault(method)
        if f is not None and not f.apply_first:
            raise f.error
        return f

    # -- model ----------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, ids: list[int], n_last: int) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long)  # [1, n]
        return self.model(input_ids=x).logits[0, -n_last:]  # [n_last, vocab]

    # -- Transport ------------------------------------------------------------------------------

    def routed(self, route_key: str, request_id: str | None = None) -> FakeCloud:
        self.route_keys.append(route_key)
        self.request_ids.append(request_id)
        return self

    def open_session(self, req: OpenSessionRequest, timeout: float) -> SessionInfo:
        f = self._enter("open")
        ctx_id = uuid.uuid4().hex
        self.sessions[ctx_id] = _Session(list(req.prompt_ids), req.sampling_cfg, req.seed, req.correction)
        if f is not None:
            raise f.error
        info = SessionInfo(ctx_id, len(req.prompt_ids), ctx_hash(req.prompt_ids), self.vocab, numerics=self.numerics,
                           node_budget=self.open_budget, tokenizer_fingerprint=self.tokenizer_fingerprint,
                           node_acceptance=self.open_acceptance)
        if self.open_forward_cost is not None:
            info.forward_cost = ForwardCostInfo.from_mapping(self.open_forward_cost)
        return info

    def verify(self, req: VerifyRequest, timeout: float, sampling: SamplingConfig | None = None) -> VerifyResponse:
        f = self._enter("verify")
        self.requests.append(req)
        s = self.sessions.get(req.ctx_id)
        if s is None:
            raise NotFound(f"no session {req.ctx_id}")
        if sampling is not None and sampling != s.cfg:
            raise InvalidArgument("sampling_cfg differs from the session's")
        base = req.ctx_len - len(req.append_ids)
        if base < 0 or base > len(s.ids):
            raise ContextMismatch("ctx_len disagrees", expected_ctx_len=len(s.ids))
        new = s.ids[:base] + list(req.append_ids)
        if ctx_hash(new) != req.ctx_hash:
            raise ContextMismatch("ctx_hash disagrees", expected_ctx_len=len(s.ids))
        d = req.draft
        if req.k > 12:
            raise InvalidArgument("k too large")
        k = len(d.draft_tokens)
        p = processed_probs(self.logits(new + d.draft_tokens, k + 1), s.cfg, new, d.draft_tokens)  # [k + 1, vocab]
        q_dists = None
        if d.q_dists:
            q_dists = torch.stack([dense_from_sparse(q.ids, q.probs, self.vocab) for q in d.q_dists])  # [k, vocab]
        out = verify_round(p, d.draft_tokens, d.q_token_probs, seed=s.seed, ctx_len=req.ctx_len,
                           greedy=s.cfg.greedy, correction=s.correction,  # type: ignore[arg-type]
                           draft_kind=d.draft_kind, q_dists=q_dists)  # type: ignore[arg-type]
        s.ids = new + d.draft_tokens[:out.accepted_len] + ([out.next_token] if out.next_token is not None else [])
        top = [torch.topk(p[i], req.return_top_k).indices.tolist() for i in range(out.accepted_len + 1)] \
            if req.return_top_k else []
        dist = None
        if out.target_ids is not None and out.target_probs is not None:
            dist = SparseDist(out.target_ids.tolist(), out.target_probs.tolist())
        resp = VerifyResponse(out.accepted_len, out.next_token, out.next_kind, dist, len(s.ids), ctx_hash(s.ids),
                              top, RoundMetrics(alpha_mean=sum(out.alphas) / k if k else 0.0,
                                                la_over_k=out.accepted_len / k if k else 0.0))
        if f is not None:
            raise f.error
        return resp

    def stream_session(self, ctx_id: str, ctx_len: int, ctx_hash_: str, max_new_tokens: int, stop_at_eos: bool,
                       timeout: float) -> Iterator[StreamedToken | StreamDone]:
        """Each token is a k = 0 round on the session, as the cloud streams them."""
        self.calls.append("stream")
        self.traffic.calls += 1
        self.stream_sizes.append(max_new_tokens)
        if 0 < self.max_generate_tokens < max_new_tokens:
            raise InvalidArgument(f"max_new_tokens {max_new_tokens} over --max-generate-tokens {self.max_generate_tokens}")
        fault = self._fault("stream")
        if fault is not None and self.stream_fail_after is None:
            raise fault.error
        s = self.sessions.get(ctx_id)
        if s is None:
            raise NotFound(f"no session {ctx_id}")
        n = 0
        while n < max_new_tokens:
            if fault is not None and n == self.stream_fail_after:
                raise fault.error
            if n == 0:
                req = VerifyRequest(ctx_id, ctx_len, ctx_hash_, [], DraftProposal([], []))
            else:
                req = VerifyRequest(ctx_id, len(s.ids), ctx_hash(s.ids), [], DraftProposal([], []))
            resp = self.verify(req, timeout)
            self.calls.pop()  # counted as the stream's
            n += 1
            yield StreamedToken(int(resp.correction or 0), resp.ctx_len)
            if stop_at_eos and resp.correction in self.eos_ids:
                break
        yield StreamDone(n, len(s.ids), ctx_hash(s.ids), {"decode_ms": 0.0, "stop_reason": "length"})

    def get_session(self, ctx_id: str, timeout: float) -> SessionInfo:
        self._enter("get")
        s = self.sessions.get(ctx_id)
        if s is None:
            raise NotFound(ctx_id)
        return SessionInfo(ctx_id, len(s.ids), ctx_hash(s.ids), self.vocab)

    def close_session(self, ctx_id: str, timeout: float) -> None:
        self._enter("close")
        self.sessions.pop(ctx_id, None)

    def get_model(self, timeout: float) -> ModelInfo:
        self._enter("model")
        info = ModelInfo("fake", self.vocab, list(self.eos_ids), self.max_context,
                         session_stream=self.supports_session_stream,
                         tokenizer_fingerprint=self.tokenizer_fingerprint)
        if self.max_generate_tokens:  # set whether or not ModelInfo has the field yet
            object.__setattr__(info, "max_generate_tokens", self.max_generate_tokens)
        if self.model_forward_cost is not None:
            info.forward_cost = ForwardCostInfo.from_mapping(self.model_forward_cost)
        return info

    def generate(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                 timeout: float, stop_at_eos: bool = True) -> GenerateResult:
        self._enter("generate")
        ids, out = list(prompt_ids), []
        for _ in range(max_new_tokens):
            p = processed_probs(self.logits(ids, 1), cfg, ids)[0]  # [vocab]
            tok = int(p.argmax()) if cfg.greedy else sample_index(p, position_uniform(seed, len(ids) + 1, SAMPLE))
            ids.append(tok)
            out.append(tok)
            if stop_at_eos and tok in self.eos_ids:
                break
        return GenerateResult(out)

    def generate_stream(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                        timeout: float, stop_at_eos: bool = True) -> Iterator[int | GenerateResult]:
        out = self.generate(prompt_ids, cfg, seed, max_new_tokens, timeout, stop_at_eos)
        yield from out.token_ids
        yield out

    def close(self) -> None:
        return None

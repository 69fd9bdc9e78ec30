"""Verify rounds on a session: checked, admitted, run as a scheduler job, counted and logged.

The round itself (plan, forward row, the verify rule, commit) is cloud/engine.py's; this module takes a
request through the service's order of checks (cloud/core.py) to the model thread and back. An admitted
round is applied even if its caller goes away, so the edge's retry is answered from the replay cache.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from cloud.core import ServiceCore
from cloud.engine import (
    RoundPlan,
    RoundResult,
    check_request,
    fingerprint,
    finish_round,
    plan_round,
    round_sampling,
)
from cloud.jobs import PENDING, ROUND, Job, Pending
from cloud.session import Session
from shared.config import SamplingConfig
from shared.protocol import VerifyRequest, VerifyResponse
from shared.rows import Row
from shared.sampling import RowSampling
from shared.tree import depths

round_log = logging.getLogger("specsplit.cloud.rounds")


async def verify(core: ServiceCore, req: VerifyRequest, owner: str, declared_k: int,
                 sampling_cfg: SamplingConfig | None = None) -> VerifyResponse:
    core.refuse_when_unhealthy()
    s = core.lookup(req.ctx_id, owner)
    q_dense = check_request(req, declared_k, core.limits, s.sampling_cfg, sampling_cfg)
    k = len(req.draft.draft_tokens)
    core.eviction.loop = asyncio.get_running_loop()
    with core.admission.round():
        admitted = core.clock()
        s.inflight += 1
        try:
            async with s.lock:
                core.store.make_room(core.kv_bytes(req.ctx_len + k), s)
                job = asyncio.ensure_future(core.scheduler.submit(RoundJob(core, s, req, q_dense), since=admitted))
                try:
                    res, queue_ms = await asyncio.shield(job)
                except asyncio.CancelledError:
                    # the caller went away (deadline, disconnect): an admitted round is still applied,
                    # so the edge's retry with the same request_id is answered from the replay cache
                    await asyncio.wait({job})
                    raise
        finally:
            s.inflight -= 1
            s.last_used = core.clock()
    resp = res.response
    if res.replayed:
        core.metrics.replayed.inc()
    else:
        resp.metrics.queue_ms = queue_ms
        assert res.outcome is not None
        core.metrics.record_round(res.outcome, k, resp.metrics.prefill_ms, queue_ms)
        parents = req.draft.tree_parents if req.draft.tree_parents is not None else list(range(-1, k - 1))
        depth = max(depths(parents), default=0)
        kept = set(resp.accepted_nodes if resp.accepted_nodes is not None else range(resp.accepted_len))
        resp.node_budget = core.node_budget(s, resp.accepted_len, depth, resp.accepted_len
                                            + int(resp.next_kind != "none"), list(parents),
                                            list(req.draft.q_token_probs), [j in kept for j in range(k)])
        entry = s.replies.get(req.request_id) if req.request_id else None
        resp.metrics.row_ms = core.row_ms()
        if entry is not None:  # a retry is answered with the budget and row cost first given (the same answer)
            entry.response.node_budget = resp.node_budget
            entry.response.metrics.row_ms = resp.metrics.row_ms
    log_round(req, resp, k, res.replayed)
    return resp


class RoundJob(Job[RoundResult]):
    """One verify round as a scheduler job: planned on the model thread, run in a batch, finished alone."""

    def __init__(self, core: ServiceCore, s: Session, req: VerifyRequest, q_dense: Any) -> None:
        super().__init__(ROUND, key=s.ctx_id, owner=s.owner)
        self.core, self.session, self.req, self.q_dense = core, s, req, q_dense
        self.fp = fingerprint(req)
        # made on its first forward (later ones continue a chunked resync)
        self.planned: RoundPlan | None = None
        # the row planned for the forward being built
        self.row: Row | None = None
        # forward ms of its resync chunks
        self.spent = 0.0

    def plan(self, budget: int) -> Row | None:
        s, req = self.session, self.req
        if self.planned is None:  # the first forward: check and plan
            p = plan_round(s, req, self.fp)
            if isinstance(p, VerifyResponse):
                return None
            self.planned = p
        elif s.closed or s.seq_id is None:
            plan_round(s, req, self.fp)  # raises NotFound
        self.row = self.planned.next_row(budget)
        return self.row

    def answer(self) -> RoundResult:
        self.session.counters.replayed += 1
        cached = plan_round(self.session, self.req, self.fp)
        assert isinstance(cached, VerifyResponse)
        return RoundResult(cached, None, replayed=True)

    def sampling(self, row: Row) -> RowSampling:
        assert self.planned is not None
        return round_sampling(self.session, self.req, self.planned)

    def finish(self, logits: Any, ms: float) -> RoundResult | Pending:
        row, planned = self.row, self.planned
        assert row is not None and planned is not None
        if row.num_logits == 0:  # a chunk of a long resync: its KV is written, the verify row comes next
            planned.fed = row.num_cached_tokens + len(row.ids)
            self.spent += ms
            return PENDING
        return finish_round(self.core.model, self.session, self.req, self.q_dense, planned, logits,
                            ms + self.spent, self.core.settings.replay_cache_size, self.p)

    def abort(self) -> None:
        if self.planned is not None:
            self.session.set_kv_len(self.core.model.pool, min(self.session.kv_len, self.planned.num_cached_tokens))


def log_round(req: VerifyRequest, resp: VerifyResponse, k: int, replayed: bool) -> None:
    m = resp.metrics
    fields = {"event": "verify_round", "request_id": req.request_id, "ctx_id": req.ctx_id, "k": k,
              "accepted_len": resp.accepted_len, "la_over_k": round(m.la_over_k, 4),
              "alpha_mean": round(m.alpha_mean, 4), "next_kind": resp.next_kind,
              "prefill_ms": round(m.prefill_ms, 3), "queue_ms": round(m.queue_ms, 3),
              "ctx_len": resp.ctx_len, "replayed": replayed}
    if req.draft.tree_parents is not None:
        fields["la_over_depth"] = round(m.la_over_depth, 4)
    if req.draft.hard_mask:
        fields["hard_ratio"] = round(sum(req.draft.hard_mask) / max(k, 1), 4)
    round_log.info("verify round", extra={"fields": fields})

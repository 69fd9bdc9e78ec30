"""The verifier service: what REST and gRPC both call. Transport-free, async, on the event loop.

Order of checks for every call: auth (401) -> session lookup (404) and owner (403) -> request
checks (422) -> admission (429) -> per-session lock -> context check (409) and the round on the
model worker. Every rejection happens before anything is written, so a rejected request never
changes a session.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cloud.admission import Admission
from cloud.engine import (
    DecodeState,
    Prefill,
    RoundLimits,
    RoundPlan,
    RoundResult,
    check_ids,
    check_request,
    fingerprint,
    finish_round,
    plan_round,
    round_sampling,
)
from cloud.metrics import CloudMetrics
from cloud.model import ModelInfo, TargetModel
from cloud.opens import OpenJoiner
from cloud.scheduler import DECODE, PENDING, PREFILL, ROUND, WAIT, BatchStats, Job, Pending, Scheduler, Wait
from cloud.session import Context, Session
from cloud.settings import CloudSettings
from cloud.store import CLOSED, KV_BUDGET, SessionStore
from cloud.streaming import first_round, stream_rounds
from shared.config import SamplingConfig
from shared.errors import Internal, InvalidArgument, NotFound, Unauthenticated, Unavailable
from shared.features import ENCODINGS, encode_feature, encode_states
from shared.kvpool import Row
from shared.protocol import (
    OpenSessionRequest,
    SessionInfo,
    StreamDone,
    StreamedToken,
    StreamSessionRequest,
    VerifyRequest,
    VerifyResponse,
)
from shared.sampling import RowSampling

log = logging.getLogger(__name__)
# seconds an answered open stays joinable by a retry with the same request id (cloud/opens.py)
OPEN_JOIN_S = 60.0
round_log = logging.getLogger("specsplit.cloud.rounds")
CORRECTIONS = ("strict", "shortcut")


@dataclass
class GenerateRequest:
    # prompt token ids
    prompt_ids: list[int]
    # processing of p before each draw
    sampling_cfg: SamplingConfig = field(default_factory=SamplingConfig)
    # keys the draws: token at position t uses (seed, t), as a k = 0 bonus would
    seed: int = 0
    # tokens to generate at most
    max_new_tokens: int = 64
    # stop after an end-of-sequence token (it is included)
    stop_at_eos: bool = True


@dataclass
class GenerateEvent:
    # the next token; None on the final event
    token_id: int | None = None
    # the final event: {"prefill_ms", "decode_ms", "queue_ms", "total_ms", "tokens", "stop_reason"}
    metrics: dict[str, float | int | str] | None = None


def key_owner(key: str) -> str:
    """What a session stores about its API key: a fingerprint, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class VerifierService:
    def __init__(self, settings: CloudSettings, model: TargetModel, *, clock: Callable[[], float] = time.monotonic,
                 new_id: Callable[[], str] = lambda: secrets.token_urlsafe(24)) -> None:
        self.settings, self.model, self.clock, self.new_id = settings, model, clock, new_id
        model.use_pool(settings.kv_budget_bytes, settings.kv_block_size, settings.prefix_cache)
        offer = settings.features and model.feature_size > 0
        self.info: ModelInfo = replace(model.info, max_k=settings.max_k, max_tree_nodes=settings.max_tree_nodes,
                                       feature_size=model.feature_size if offer else 0,
                                       feature_encodings=list(ENCODINGS) if offer else [],
                                       max_feature_window=settings.max_feature_window if offer else 0,
                                       session_stream=True, max_generate_tokens=settings.max_generate_tokens)
        self.prompt_limit = settings.prompt_limit(model.info.max_context)
        self.limits = RoundLimits(max_k=settings.max_k, max_return_top_k=settings.max_return_top_k,
                                  max_context=model.info.max_context, vocab_size=model.support,
                                  max_tree_nodes=settings.max_tree_nodes)
        self.metrics = CloudMetrics.create(max(settings.max_k, settings.max_tree_nodes), settings.kv_budget_bytes)
        self.metrics.model_dtype.labels(self.info.dtype, self.info.dtype_reason,
                                        str(self.info.batch_invariant).lower()).set(1)
        self.store = SessionStore(max_sessions=settings.max_sessions, ttl_s=settings.session_ttl_s,
                                  kv_budget_bytes=settings.kv_budget_bytes, clock=clock, on_remove=self._removed,
                                  max_sessions_per_owner=settings.sessions_per_key_limit())
        self.admission = Admission(max_new=settings.max_queue_depth,
                                   max_new_per_key=settings.queue_depth_per_key_limit(),
                                   max_total=settings.max_queue_depth + settings.max_sessions)
        self.worker = Scheduler(clock, max_batch_size=settings.max_batch_size,
                                max_batch_tokens=settings.max_batch_tokens, batch_wait_ms=settings.batch_wait_ms,
                                max_prefill_tokens_with_rounds=settings.max_prefill_tokens_with_rounds,
                                active_s=settings.session_active_ms / 1000.0,
                                torch_threads=settings.torch_threads,
                                forward=lambda rows: self.model.forward(rows),
                                on_batch=self._batched,
                                blocks_needed=lambda row: self.model.pool.blocks_needed(row),
                                blocks_available=lambda: self.model.pool.manager.available(),
                                make_room=self._make_room)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.opens = OpenJoiner(OPEN_JOIN_S, max_per_owner=settings.sessions_per_key_limit()
                                + settings.queue_depth_per_key_limit())
        self._hits_seen = self._evicted_seen = 0
        # prefills under way (model thread only): an open sharing a full block they are computing waits
        self._prefilling: list[Prefill] = []
        # /v1/generate prompts half prefilled, waiting for their next chunk (model thread only)
        self._gen_prefilling: list[DecodeState] = []
        # prefills whose row is in the forward being built or run (model thread only): never evicted for blocks
        self._in_forward: set[int] = set()
        self._keys = settings.api_key_values()
        self._ready = True
        # set at SIGTERM (cloud.app.drain): new sessions and generations are refused, verify is still served
        self.draining = False

    @classmethod
    def load(cls, settings: CloudSettings, **kw) -> VerifierService:  # type: ignore[no-untyped-def]
        # the service sizes its pool
        model = TargetModel(settings.model, settings.device, settings.dtype, invariant=settings.batch_invariant)
        return cls(settings, model, **kw)

    @property
    def ready(self) -> bool:
        """Serving (/readyz 200): not draining, and no tensor-parallel rank lost."""
        return self._ready and self.model.healthy()

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value

    # --- auth ---------------------------------------------------------------------------------
    def authenticate(self, key: str | None) -> str:
        """The caller's owner id; Unauthenticated when keys are configured and `key` is not one."""
        if not self._keys:
            return ""
        if not key:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer KEY'")
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in self._keys):
            raise Unauthenticated("wrong API key")
        return key_owner(key)

    # --- sessions -----------------------------------------------------------------------------
    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidArgument("prompt_ids is empty: a session needs at least one token")
        if len(ids) > self.prompt_limit:
            raise InvalidArgument(f"the prompt has {len(ids)} tokens, more than the limit of {self.prompt_limit} "
                                  f"(model context {self.info.max_context})", limit=self.prompt_limit)
        check_ids(ids, self.model.support, "prompt_ids")

    async def open_session(self, req: OpenSessionRequest, owner: str, request_id: str = "") -> SessionInfo:
        """A new session. With a `request_id` (the call's X-Request-Id) a retry joins the first attempt
        (cloud/opens.py); without, an open whose caller goes away leaves the queue (or stops after its
        chunk in progress) and leaves nothing behind."""
        self._check_open(req)
        if request_id:
            return await self.opens.join(owner, request_id, req, lambda: self._open(req, owner),
                                         alive=lambda ctx_id: self.store.holds(ctx_id))
        return await self._open(req, owner)

    def _check_open(self, req: OpenSessionRequest) -> None:
        self._refuse_when_draining("sessions")
        self._check_prompt(req.prompt_ids)
        if req.correction not in CORRECTIONS:
            raise InvalidArgument(f"correction must be 'strict' or 'shortcut', not {req.correction!r}")
        if not 0 <= req.seed < 2**64:
            raise InvalidArgument("seed must be in [0, 2**64)")
        if req.max_new_tokens < 0:
            raise InvalidArgument("max_new_tokens must be >= 0")
        if req.feature_encoding not in ("", *ENCODINGS):
            raise InvalidArgument(f"feature_encoding must be '', 'float16' or 'int8', not {req.feature_encoding!r}")
        most = self.info.max_feature_window
        if not (isinstance(req.feature_window, int) and 0 <= req.feature_window <= max(most, 0)) \
                or (req.feature_window and not req.feature_encoding):
            raise InvalidArgument(f"feature_window must be in [0, {most}] (max_feature_window) and needs a "
                                  f"feature_encoding, not {req.feature_window!r}", limit="max_feature_window")

    async def _open(self, req: OpenSessionRequest, owner: str) -> SessionInfo:
        # a cloud that does not offer features answers without them, as an older cloud would
        encoding = req.feature_encoding if self.info.feature_size else ""
        need = self._kv_bytes(len(req.prompt_ids) + 1)  # the prompt and its first round's token
        self._loop = asyncio.get_running_loop()
        # the limits count the opens already admitted, before any compute (cloud/admission.py)
        self.store.check_room(need, owner, self.admission.opening(owner), self.admission.opening())
        with self.admission.new_work(owner, opening=True):
            admitted = self.clock()
            # the prompt's prefix hashes (pure Python, per token) on a worker thread, during the prefill
            hashed = asyncio.ensure_future(asyncio.to_thread(Context.of, req.prompt_ids))
            # with a feature the whole prompt is run (its last position's state is the first feature); without,
            # S[:-1] (the first round feeds the last token)
            ids = req.prompt_ids if encoding else req.prompt_ids[:-1]
            window = req.feature_window if encoding else 0
            pre = Prefill(ids, chunk=self.settings.max_batch_tokens, salt=self._salt(owner),
                          keep_last=max(window, 1) if encoding else 0)
            first: list[torch.Tensor] = []
            prefill = self._prefill_job(pre, owner, encoding, first)
            job = asyncio.ensure_future(self.worker.submit(prefill, since=admitted))
            try:
                (ms, queue_ms) = await asyncio.shield(job)
            except BaseException:
                # gone before the session exists (disconnect, failure): the prefill leaves the queue or stops
                # after its chunk in progress, and its slot goes back to the pool
                await self._abandon(prefill, job)
                self._release(pre.slot)
                raise
            try:
                context = await hashed
            except BaseException:
                self._release(pre.slot)
                raise
            now = self.clock()
            s = Session(ctx_id=self.new_id(), owner=owner, sampling_cfg=req.sampling_cfg, seed=req.seed,
                        correction=req.correction, max_new_tokens=req.max_new_tokens,
                        prompt_len=len(req.prompt_ids), context=context, slot=pre.slot,
                        kv_bytes_per_token=self.model.kv_bytes_per_token, last_used=now, created=now,
                        kv_len=len(pre.ids), replay_bytes_limit=self.settings.replay_cache_bytes,
                        feature_encoding=encoding, feature_window=window)
            self.store.add(s)
        self.metrics.prompt_prefill_ms.observe(ms)
        self.metrics.queue_ms.observe(queue_ms)
        log.info("session opened", extra={"fields": {"event": "open", "ctx_id": s.ctx_id,
                                                     "prompt_len": len(req.prompt_ids), "prefill_ms": round(ms, 3)}})
        info = self._info(s)
        if first:  # the prompt's last states: the whole window's, or the last one as the feature
            h = torch.cat(first)[-max(window, 1):]  # [n, d]
            if window:
                info.states = encode_states(h, encoding, len(ids) - h.shape[0] + 1)
            else:
                info.feature = encode_feature(h[-1], encoding, len(ids))
        return info

    async def _abandon(self, job: Job[Any], task: asyncio.Future[Any]) -> None:
        """Nobody waits for `job` (its caller left, or it failed): it runs no further forward; returns once the
        model thread has let go of it."""
        self.worker.cancel(job)
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: the caller has its own error

    def _kv_bytes(self, positions: int) -> int:
        """The KV bytes a sequence of `positions` takes in whole blocks, with one block more for a
        copy-on-write: what the never-fits check compares with the budget (the pool holds whole blocks)."""
        size = self.model.pool.block_size
        return (-(-positions // size) + 1) * size * self.model.kv_bytes_per_token

    def _refuse_when_draining(self, what: str) -> None:
        if self.draining:
            raise Unavailable(f"this replica is shutting down and takes no new {what}: retry (elsewhere)")
        self._refuse_when_unhealthy()

    def _refuse_when_unhealthy(self) -> None:
        if not self.model.healthy():
            raise Unavailable("this verifier lost a tensor-parallel rank and is restarting: retry (elsewhere)")

    def _salt(self, owner: str) -> bytes:
        """The prefix-cache salt of an owner's sequences: blocks are shared within one API key only,
        unless the operator shares them across keys."""
        return b"" if self.settings.share_prefix_across_keys else owner.encode()

    def _shares_a_running_prefill(self, pre: Prefill) -> bool:
        """Whether another prefill under way, under the same salt, is still computing a full block that
        `pre` would need too: `pre` then waits and takes those blocks from the prefix cache instead of
        computing them again."""
        if not self.settings.prefix_cache:
            return False
        size = self.model.pool.block_size
        for other in self._prefilling:
            if other is pre or other.salt != pre.salt or other.slot is None:
                continue
            if pre.ids[:size] != other.ids[:size]:  # no full block in common: the usual case, at a block's cost
                continue
            n = 0
            for a, b in zip(pre.ids, other.ids, strict=False):
                if a != b:
                    break
                n += 1
            if n // size * size > other.done:  # a shared full block is not computed yet
                return True
        return False

    def _prefill_job(self, pre: Prefill, owner: str, encoding: str = "",
                     states: list[torch.Tensor] | None = None) -> Job[float]:
        """KV of a prompt's S[:-1] (all of S with `encoding`: then the states of its last `pre.keep_last`
        positions go into `states`, chunk by chunk), in chunks; the result is the forward time (ms) summed."""
        spent = [0.0]
        rows: list[Row] = []

        def plan(budget: int) -> Row | None | Wait:
            if pre.slot is None:
                if self._shares_a_running_prefill(pre):
                    return WAIT
                self._prefilling.append(pre)
            row = pre.plan(self.model.pool, budget)
            rows[:] = [row] if row is not None else []
            if row is None:
                self._forget_prefill(pre)
            else:
                self._in_forward.add(id(pre))
            return row

        def finish(_: object, ms: float) -> float | Pending:
            self._in_forward.discard(id(pre))
            spent[0] += ms
            hidden = self.model.hidden_of(rows[0]) if encoding and rows[0].keep else None
            if hidden is not None and states is not None:
                if not bool(torch.isfinite(hidden).all()):  # checked before the session exists
                    raise Internal.of(FloatingPointError("the target's state at the end of the prompt is not "
                                                         "finite: no feature (nor session) can be made of it"))
                states.append(hidden.detach().clone())
            if pre.advance(self.model.pool, rows[0]):
                self._forget_prefill(pre)
                return spent[0]
            return PENDING

        def abort() -> None:
            self._in_forward.discard(id(pre))
            self._forget_prefill(pre)
            if pre.slot is not None:
                self.model.pool.crop(pre.slot, pre.done)

        def unplan() -> None:
            self._in_forward.discard(id(pre))
            pre.unplan(self.model.pool)
            if pre.slot is None:
                self._forget_prefill(pre)

        return Job(plan=plan, finish=finish, abort=abort, answer=lambda: spent[0], kind=PREFILL, owner=owner,
                   unplan=unplan)

    def _forget_generate(self, st: DecodeState) -> None:
        self._gen_prefilling = [g for g in self._gen_prefilling if g is not st]

    def _end_generate(self, st: DecodeState) -> None:
        """A generation is over (model thread, between forwards): its blocks go back."""
        self._forget_generate(st)
        self._in_forward.discard(id(st))
        st.give_back(self.model.pool)

    def _forget_prefill(self, pre: Prefill) -> None:
        """`pre` is done, failed or gave its slot back: no open waits for it any more (model thread)."""
        self._prefilling = [p for p in self._prefilling if p is not pre]

    def _make_room(self, blocks: int, progressing: bool = False) -> None:
        """On the model thread, when a forward needs `blocks` more KV blocks than are left (cached prefix
        blocks already count as available): first half-finished prefills (of opens and of /v1/generate)
        waiting for a later forward give their blocks back (their full blocks stay in the prefix cache, so they resume from there), then
        least recently used idle sessions are evicted until the blocks fit, sparing those opened within
        `eviction_grace_s` that have not run a round yet and those used within `eviction_active_s`
        (`progressing`, always set by the scheduler): the work that lacks blocks then waits for a later
        forward (or answers 429), instead of evicting a session whose edge is mid-generation. Each evicted
        session answers 404 afterwards; its edge reopens it with the full context."""
        pool = self.model.pool
        goal = pool.manager.available() + blocks
        for pre in list(self._prefilling):
            if pool.manager.available() >= goal:
                return
            if id(pre) not in self._in_forward and pre.slot is not None and pre.done > pre.reused:
                self._forget_prefill(pre)
                pool.release(pre.slot)
                pre.slot, pre.done, pre.reused = None, 0, 0  # plans again: allocate, match the prefix cache
        for st in list(self._gen_prefilling):  # /v1/generate prompts alike
            if pool.manager.available() >= goal:
                return
            if id(st) not in self._in_forward and st.slot is not None and st.kv_len > st.matched:
                self._forget_generate(st)
                st.give_back(pool)
        now = self.clock()
        fresh_since = now - self.settings.eviction_grace_s
        active_since = now - self.settings.eviction_active_s if progressing else now + 1.0
        for s in self.store.lru():
            if pool.manager.available() >= goal:
                return
            if s.inflight > 0 or s.closed or s.slot is None:
                continue
            if s.counters.rounds == 0 and s.created > fresh_since:
                continue  # just opened or reopened: evicting it now would only make its edge reopen again
            if s.last_used > active_since:
                continue  # mid-generation, and this forward runs other work: the newcomer waits
            slot, s.slot = s.slot, None
            s.closed = True
            pool.release(slot)
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self.store.drop, s, KV_BUDGET)
            else:
                self.store.drop(s, KV_BUDGET)

    def _release(self, slot: int | None) -> None:
        if slot is not None:
            self.worker.between_batches(lambda: self.model.pool.release(slot))

    def _batched(self, b: BatchStats) -> None:
        self.metrics.batch_size.observe(b.rows)
        self.metrics.batch_tokens.observe(b.tokens)
        self.metrics.padded_tokens.inc(b.padded_tokens)
        self.metrics.forward_ms.observe(b.ms)
        for kind, waited in b.waits:
            self.metrics.queue_wait.labels(kind=kind).observe(waited)

    def _info(self, s: Session, counters: bool = False) -> SessionInfo:
        ctx = s.context
        return SessionInfo(ctx_id=s.ctx_id, ctx_len=len(ctx), ctx_hash=ctx.hash_at(len(ctx)),
                           vocab_size=self.model.support,
                           counters=s.describe(self.clock()) if counters else {})

    def get_session(self, ctx_id: str, owner: str) -> SessionInfo:
        return self._info(self._session(ctx_id, owner), counters=True)

    def close_session(self, ctx_id: str, owner: str) -> None:
        self._session(ctx_id, owner)
        self.store.close(ctx_id, owner)

    def _session(self, ctx_id: str, owner: str) -> Session:
        """The session; while draining, one this replica does not hold is Unavailable (503), not NotFound:
        it may live on another replica, where a load balancer sends the call next."""
        try:
            return self.store.get(ctx_id, owner)
        except NotFound:
            if self.draining:
                raise Unavailable(f"this replica is shutting down and holds no session {ctx_id!r}: retry "
                                  "(elsewhere)") from None
            raise

    def _removed(self, s: Session, reason: str) -> None:
        slot, s.slot = s.slot, None
        self._release(slot)  # on the model thread, after any batch that still uses it
        self.worker.forget(s.ctx_id)
        if reason != CLOSED:
            self.metrics.evictions.labels(reason=reason).inc()
        log.info("session removed", extra={"fields": {"event": "remove", "ctx_id": s.ctx_id, "reason": reason}})

    # --- verify -------------------------------------------------------------------------------
    async def verify(self, req: VerifyRequest, owner: str, declared_k: int,
                     sampling_cfg: SamplingConfig | None = None) -> VerifyResponse:
        self._refuse_when_unhealthy()
        s = self._session(req.ctx_id, owner)
        q_dense = check_request(req, declared_k, self.limits, s.sampling_cfg, sampling_cfg)
        k = len(req.draft.draft_tokens)
        self._loop = asyncio.get_running_loop()
        with self.admission.round():
            admitted = self.clock()
            s.inflight += 1
            try:
                async with s.lock:
                    self.store.make_room(self._kv_bytes(req.ctx_len + k), s)
                    job = asyncio.ensure_future(self.worker.submit(self._round_job(s, req, q_dense),
                                                                   since=admitted))
                    try:
                        res, queue_ms = await asyncio.shield(job)
                    except asyncio.CancelledError:
                        # the caller went away (deadline, disconnect): an admitted round is still applied,
                        # so the edge's retry with the same request_id is answered from the replay cache
                        await asyncio.wait({job})
                        raise
            finally:
                s.inflight -= 1
                s.last_used = self.clock()
        resp = res.response
        if res.replayed:
            self.metrics.replayed.inc()
        else:
            resp.metrics.queue_ms = queue_ms
            assert res.outcome is not None
            self.metrics.record_round(res.outcome, k, resp.metrics.prefill_ms, queue_ms)
        self._log_round(req, resp, k, res.replayed)
        return resp

    def _round_job(self, s: Session, req: VerifyRequest, q_dense: Any) -> Job[RoundResult]:
        """One verify round as a scheduler job: plan on the model thread, run in a batch, finish alone."""
        fp = fingerprint(req)
        planned: list[RoundPlan] = []
        rows: list[Row] = []

        def plan(budget: int) -> Row | None:
            if not planned:  # the first forward: check and plan (later ones continue a chunked resync)
                p = plan_round(s, req, fp)
                if isinstance(p, VerifyResponse):
                    return None
                planned.append(p)
            elif s.closed or s.slot is None:
                plan_round(s, req, fp)  # raises NotFound
            rows[:] = [planned[0].next_row(budget)]
            return rows[0]

        def answer() -> RoundResult:
            s.counters.replayed += 1
            cached = plan_round(s, req, fp)
            assert isinstance(cached, VerifyResponse)
            return RoundResult(cached, None, replayed=True)

        def finish(logits: Any, ms: float) -> RoundResult | Pending:
            row = rows[0]
            if row.keep == 0:  # a chunk of a long resync: its KV is written, the verify row comes next
                planned[0].fed = row.past + len(row.ids)
                spent[0] += ms
                return PENDING
            return finish_round(self.model, s, req, q_dense, planned[0], logits, ms + spent[0],
                                self.settings.replay_cache_size, job.p)

        def abort() -> None:
            if planned:
                s.set_kv_len(self.model.pool, min(s.kv_len, planned[0].past))

        spent = [0.0]
        job: Job[RoundResult] = Job(plan=plan, finish=finish, abort=abort, answer=answer, key=s.ctx_id, kind=ROUND,
                                    owner=s.owner, sampling=lambda _: round_sampling(s, req, planned[0]))
        return job

    def _log_round(self, req: VerifyRequest, resp: VerifyResponse, k: int, replayed: bool) -> None:
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

    # --- session streams ------------------------------------------------------------------------
    def stream_session(self, req: StreamSessionRequest, owner: str) -> AsyncIterator[StreamedToken | StreamDone]:
        """Check the request now (errors before any compute leave the session as it was), then stream the
        target's own tokens on the session, one k = 0 verify round each (cloud/streaming.py)."""
        self._refuse_when_unhealthy()
        s = self._session(req.ctx_id, owner)
        first = first_round(req, s, self.settings.max_generate_tokens)
        return stream_rounds(self, s, first, req, owner)

    # --- target-only generation -----------------------------------------------------------------
    def start_generate(self, req: GenerateRequest, owner: str) -> AsyncIterator[GenerateEvent]:
        """Check the request now (errors before any output), then stream tokens as they come."""
        self._refuse_when_draining("generations")
        self._check_prompt(req.prompt_ids)
        if not 0 <= req.max_new_tokens <= self.settings.max_generate_tokens:
            raise InvalidArgument(f"max_new_tokens must be in [0, {self.settings.max_generate_tokens}]")
        if not 0 <= req.seed < 2**64:
            raise InvalidArgument("seed must be in [0, 2**64)")
        self.store.make_room(self._kv_bytes(len(req.prompt_ids) + 1))  # a prompt that can never fit: 422
        self.admission.check_new(owner)  # fail fast when full; the generation itself is admitted when it starts
        return self._generate(req, owner)

    async def _generate(self, req: GenerateRequest, owner: str = "") -> AsyncIterator[GenerateEvent]:
        t_start = self.clock()
        st = DecodeState(list(req.prompt_ids), salt=self._salt(owner))
        limit = min(req.max_new_tokens, self.info.max_context - len(st.ids))
        reason, prefill_ms, decode_ms, queue_ms = "length", 0.0, 0.0, 0.0
        try:
            with self.admission.new_work(owner):
                for i in range(max(limit, 0)):
                    step = self._decode_job(st, req, owner, i == 0)
                    job = asyncio.ensure_future(self.worker.submit(step, since=t_start if i == 0 else None))
                    try:
                        (tok, ms), waited = await asyncio.shield(job)
                    except BaseException:
                        await self._abandon(step, job)  # the slot is released once the model let go of it
                        raise
                    prefill_ms, decode_ms = (ms, decode_ms) if i == 0 else (prefill_ms, decode_ms + ms)
                    queue_ms += waited
                    self.metrics.generated.inc()
                    yield GenerateEvent(token_id=tok)
                    if req.stop_at_eos and tok in self.info.eos_ids:
                        reason = "eos"
                        break
                else:
                    if limit < req.max_new_tokens:
                        reason = "context"
        finally:
            self.worker.between_batches(lambda: self._end_generate(st))
            self.worker.forget(f"generate-{id(st)}")
        self.metrics.prompt_prefill_ms.observe(prefill_ms)
        yield GenerateEvent(metrics={"tokens": len(st.ids) - len(req.prompt_ids), "prefill_ms": prefill_ms,
                                     "decode_ms": decode_ms, "queue_ms": queue_ms,
                                     "total_ms": (self.clock() - t_start) * 1000.0, "stop_reason": reason})

    def _decode_job(self, st: DecodeState, req: GenerateRequest, owner: str, first: bool) -> Job[tuple[int, float]]:
        """One target-only token (a long prompt first runs in chunks); result (token, forward ms)."""
        rows: list[Row] = []
        spent = [0.0]

        def plan(budget: int) -> Row:
            rows[:] = [st.plan(self.model.pool, budget)]
            self._in_forward.add(id(st))
            return rows[0]

        def finish(logits: Any, ms: float) -> tuple[int, float] | Pending:
            self._in_forward.discard(id(st))
            spent[0] += ms
            tok = st.step(self.model.pool, rows[0], logits, req.sampling_cfg, req.seed, job.p)
            if tok is None and st not in self._gen_prefilling:  # its next chunk waits for a later forward
                self._gen_prefilling.append(st)
            elif tok is not None:
                self._forget_generate(st)
            return PENDING if tok is None else (tok, spent[0])

        def abort() -> None:
            self._in_forward.discard(id(st))
            if rows and st.slot is not None:
                st.kv_len = min(st.kv_len, rows[0].past)
                self.model.pool.crop(st.slot, st.kv_len)

        def unplan() -> None:
            self._in_forward.discard(id(st))
            st.unplan(self.model.pool)

        job: Job[tuple[int, float]] = Job(
            plan=plan, finish=finish, abort=abort, key=f"generate-{id(st)}", kind=PREFILL if first else DECODE,
            owner=owner, unplan=unplan, sampling=lambda _: RowSampling(req.sampling_cfg, st.ids))
        return job

    # --- housekeeping -------------------------------------------------------------------------
    def render_metrics(self) -> bytes:
        self.metrics.open_sessions.set(len(self.store))
        self.metrics.kv_bytes.set(self.store.kv_bytes)
        self.metrics.kv_pool_bytes.set(self.model.pool.allocated_bytes)
        m = self.model.pool.manager
        self.metrics.kv_blocks.labels(state="used").set(m.used)
        self.metrics.kv_blocks.labels(state="cached").set(len(m.cached))
        self.metrics.kv_blocks.labels(state="free").set(m.available() - len(m.cached)
                                                        if m.max_blocks is not None else len(m.free))
        self.metrics.prefix_hit_tokens.inc(m.hit_tokens - self._hits_seen)
        self.metrics.cached_block_evictions.inc(m.evicted_blocks - self._evicted_seen)
        self._hits_seen, self._evicted_seen = m.hit_tokens, m.evicted_blocks
        self.metrics.queue_depth.set(self.admission.depth)
        return self.metrics.render()

    def count_error(self, code: str) -> None:
        self.metrics.errors.labels(code=code).inc()

    def count_response(self, transport: str, status: int) -> None:
        self.metrics.responses.labels(transport=transport, status=str(status)).inc()

    async def sweep_forever(self) -> None:
        """Expire idle sessions in the background (lookups also expire them lazily)."""
        period = min(self.settings.session_ttl_s / 2, 5.0)
        while True:
            await asyncio.sleep(period)
            self.store.expire()

    def close(self) -> None:
        self.ready = False
        self.store.clear()
        self.worker.shutdown()


"""Opening a session: the checks, then the prompt's prefill in chunks on the model thread.

With a `request_id` (the call's X-Request-Id) a retry joins the first attempt (cloud/idempotent_opens.py); without,
an open whose caller goes away leaves the queue (or stops after its chunk in progress) and leaves nothing
behind. The limits count the opens already admitted, before any compute (cloud/admission.py).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from cloud.core import ServiceCore
from cloud.jobs import PENDING, PREFILL, WAIT, Job, Pending, Wait
from cloud.prefill import Prefill
from cloud.session import Context, Session
from shared.errors import Internal, InvalidArgument
from shared.features import ENCODINGS, encode_feature, encode_states
from shared.protocol import ForwardCostInfo, OpenSessionRequest, SessionInfo
from shared.rows import Row

# the service's log lines keep the logger name they have always had
log = logging.getLogger("cloud.service")
CORRECTIONS = ("strict", "shortcut")


async def open_session(core: ServiceCore, req: OpenSessionRequest, owner: str, request_id: str = "") -> SessionInfo:
    """A new session; a retry with the same `request_id` joins the first attempt (cloud/idempotent_opens.py)."""
    check_open(core, req)
    if request_id:
        return await core.opens.join(owner, request_id, req, lambda: open_new(core, req, owner),
                                     alive=lambda ctx_id: core.store.holds(ctx_id))
    return await open_new(core, req, owner)


def check_open(core: ServiceCore, req: OpenSessionRequest) -> None:
    core.refuse_when_draining("sessions")
    core.check_prompt(req.prompt_ids)
    if req.correction not in CORRECTIONS:
        raise InvalidArgument(f"correction must be 'strict' or 'shortcut', not {req.correction!r}")
    if not 0 <= req.seed < 2**64:
        raise InvalidArgument("seed must be in [0, 2**64)")
    if req.max_new_tokens < 0:
        raise InvalidArgument("max_new_tokens must be >= 0")
    if req.feature_encoding not in ("", *ENCODINGS):
        raise InvalidArgument(f"feature_encoding must be '', 'float16' or 'int8', not {req.feature_encoding!r}")
    most = core.info.max_feature_window
    if not (isinstance(req.feature_window, int) and 0 <= req.feature_window <= max(most, 0)) \
            or (req.feature_window and not req.feature_encoding):
        raise InvalidArgument(f"feature_window must be in [0, {most}] (max_feature_window) and needs a "
                              f"feature_encoding, not {req.feature_window!r}", limit="max_feature_window")


async def open_new(core: ServiceCore, req: OpenSessionRequest, owner: str) -> SessionInfo:
    """The session of a checked request: admitted, its prompt prefilled, then added to the store."""
    # a cloud that does not offer features answers without them, as an older cloud would
    encoding = req.feature_encoding if core.info.feature_size else ""
    need = core.kv_bytes(len(req.prompt_ids) + 1)  # the prompt and its first round's token
    core.eviction.loop = asyncio.get_running_loop()
    core.store.check_room(need, owner, core.admission.opening(owner), core.admission.opening())
    with core.admission.new_work(owner, opening=True):
        admitted = core.clock()
        # the prompt's prefix hashes (pure Python, per token) on a worker thread, during the prefill
        hashed = asyncio.ensure_future(asyncio.to_thread(Context.of, req.prompt_ids))
        # with a feature the whole prompt is run (its last position's state is the first feature); without,
        # S[:-1] (the first round feeds the last token)
        ids = req.prompt_ids if encoding else req.prompt_ids[:-1]
        window = req.feature_window if encoding else 0
        pre = Prefill(ids, chunk=core.settings.max_batch_tokens, salt=core.salt(owner),
                      keep_last=max(window, 1) if encoding else 0)
        # the session's id keys its prefill: once that is answered the session counts as active on the model
        # thread at once (its first round is on its way), so the next forward already gives prefills only their
        # slice instead of a whole forward the round would wait behind
        ctx_id = core.new_id()
        prefill = PrefillJob(core, pre, owner, encoding, key=ctx_id)
        job = asyncio.ensure_future(core.scheduler.submit(prefill, since=admitted))
        try:
            (ms, queue_ms) = await asyncio.shield(job)
        except BaseException:
            # gone before the session exists (disconnect, failure): the prefill leaves the queue or stops
            # after its chunk in progress, and its sequence goes back to the pool
            await core.abandon(prefill, job)
            core.release(pre.seq_id)
            core.scheduler.forget(ctx_id)
            raise
        try:
            context = await hashed
        except BaseException:
            core.release(pre.seq_id)
            core.scheduler.forget(ctx_id)
            raise
        now = core.clock()
        s = Session(ctx_id=ctx_id, owner=owner, sampling_cfg=req.sampling_cfg, seed=req.seed,
                    correction=req.correction, max_new_tokens=req.max_new_tokens,
                    prompt_len=len(req.prompt_ids), context=context, seq_id=pre.seq_id,
                    kv_bytes_per_token=core.model.kv_bytes_per_token, last_used=now, created=now,
                    kv_len=len(pre.ids), replay_bytes_limit=core.settings.replay_cache_bytes,
                    feature_encoding=encoding, feature_window=window)
        core.store.add(s)
    core.metrics.prompt_prefill_ms.observe(ms)
    core.metrics.queue_ms.observe(queue_ms)
    log.info("session opened", extra={"fields": {"event": "open", "ctx_id": s.ctx_id,
                                                 "prompt_len": len(req.prompt_ids), "prefill_ms": round(ms, 3)}})
    info = core.session_info(s)
    info.node_budget = core.open_budget(s)
    info.node_acceptance = core.open_acceptance(s)
    # the fit as of this open, fresher than GET /v1/model's: the edge's first speculate-or-stream decision reads it
    info.forward_cost = ForwardCostInfo.from_mapping(core.forward_cost())
    if prefill.states:  # the prompt's last states: the whole window's, or the last one as the feature
        h = torch.cat(prefill.states)[-max(window, 1):]  # [n, d]
        if window:
            info.states = encode_states(h, encoding, len(ids) - h.shape[0] + 1)
        else:
            info.feature = encode_feature(h[-1], encoding, len(ids))
    return info


class PrefillJob(Job[float]):
    """KV of a prompt's S[:-1] (all of S with `encoding`: then the states of its last `pre.keep_last` positions
    go into `states`, chunk by chunk), in chunks; the result is the forward time (ms) summed."""

    def __init__(self, core: ServiceCore, pre: Prefill, owner: str, encoding: str = "",
                 key: str | None = None) -> None:
        super().__init__(PREFILL, key=key, owner=owner)
        self.eviction, self.model, self.pre, self.encoding = core.eviction, core.model, pre, encoding
        # the prompt's last states ([n, d] a chunk), with `encoding`
        self.states: list[torch.Tensor] = []
        # forward ms of its chunks so far
        self.spent = 0.0
        # the chunk planned for the forward being built
        self.row: Row | None = None

    def plan(self, budget: int) -> Row | None | Wait:
        pre, eviction = self.pre, self.eviction
        if pre.seq_id is None:
            if eviction.shares_a_running_prefill(pre):
                return WAIT
            eviction.prefilling.append(pre)
        self.row = pre.plan(self.model.pool, budget)
        if self.row is None:
            eviction.forget_prefill(pre)
        else:
            eviction.in_forward.add(id(pre))
        return self.row

    def answer(self) -> float:
        return self.spent

    def finish(self, logits: torch.Tensor, ms: float) -> float | Pending:
        row = self.row
        assert row is not None
        self.eviction.in_forward.discard(id(self.pre))
        self.spent += ms
        hidden = self.model.hidden_of(row) if self.encoding and row.num_logits else None
        if hidden is not None:
            if not bool(torch.isfinite(hidden).all()):  # checked before the session exists
                raise Internal.of(FloatingPointError("the target's state at the end of the prompt is not "
                                                     "finite: no feature (nor session) can be made of it"))
            self.states.append(hidden.detach().clone())
        if self.pre.advance(self.model.pool, row):
            self.eviction.forget_prefill(self.pre)
            return self.spent
        return PENDING

    def abort(self) -> None:
        self.eviction.in_forward.discard(id(self.pre))
        self.eviction.forget_prefill(self.pre)
        if self.pre.seq_id is not None:
            self.model.pool.crop(self.pre.seq_id, self.pre.done)

    def unplan(self) -> None:
        self.eviction.in_forward.discard(id(self.pre))
        self.pre.unplan(self.model.pool)
        if self.pre.seq_id is None:
            self.eviction.forget_prefill(self.pre)

"""Target-only generation (POST /v1/generate): no session, one token a scheduler job.

The prompt is prefilled in chunks, then each token is the target's draw at its position, keyed by
(seed, position) as a k = 0 bonus would be. The generation is admitted as new work when it starts; its
blocks go back between forwards when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cloud.core import ServiceCore
from cloud.engine import DecodeState
from cloud.jobs import DECODE, PENDING, PREFILL, Job, Pending
from shared.config import SamplingConfig
from shared.errors import InvalidArgument
from shared.kvpool import Row
from shared.sampling import RowSampling


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


def start_generate(core: ServiceCore, req: GenerateRequest, owner: str) -> AsyncIterator[GenerateEvent]:
    """Check the request now (errors before any output), then stream tokens as they come."""
    core.refuse_when_draining("generations")
    core.check_prompt(req.prompt_ids)
    if not 0 <= req.max_new_tokens <= core.settings.max_generate_tokens:
        raise InvalidArgument(f"max_new_tokens must be in [0, {core.settings.max_generate_tokens}]")
    if not 0 <= req.seed < 2**64:
        raise InvalidArgument("seed must be in [0, 2**64)")
    core.store.make_room(core.kv_bytes(len(req.prompt_ids) + 1))  # a prompt that can never fit: 422
    core.admission.check_new(owner)  # fail fast when full; the generation itself is admitted when it starts
    return generate(core, req, owner)


async def generate(core: ServiceCore, req: GenerateRequest, owner: str = "") -> AsyncIterator[GenerateEvent]:
    t_start = core.clock()
    st = DecodeState(list(req.prompt_ids), salt=core.salt(owner))
    limit = min(req.max_new_tokens, core.info.max_context - len(st.ids))
    reason, prefill_ms, decode_ms, queue_ms = "length", 0.0, 0.0, 0.0
    try:
        with core.admission.new_work(owner):
            for i in range(max(limit, 0)):
                step = decode_job(core, st, req, owner, i == 0)
                job = asyncio.ensure_future(core.worker.submit(step, since=t_start if i == 0 else None))
                try:
                    (tok, ms), waited = await asyncio.shield(job)
                except BaseException:
                    await core.abandon(step, job)  # the slot is released once the model let go of it
                    raise
                prefill_ms, decode_ms = (ms, decode_ms) if i == 0 else (prefill_ms, decode_ms + ms)
                queue_ms += waited
                core.metrics.generated.inc()
                core.budget.committed(1)
                yield GenerateEvent(token_id=tok)
                if req.stop_at_eos and tok in core.info.eos_ids:
                    reason = "eos"
                    break
            else:
                if limit < req.max_new_tokens:
                    reason = "context"
    finally:
        core.worker.between_batches(lambda: core.room.end_generate(st))
        core.worker.forget(f"generate-{id(st)}")
    core.metrics.prompt_prefill_ms.observe(prefill_ms)
    yield GenerateEvent(metrics={"tokens": len(st.ids) - len(req.prompt_ids), "prefill_ms": prefill_ms,
                                 "decode_ms": decode_ms, "queue_ms": queue_ms,
                                 "total_ms": (core.clock() - t_start) * 1000.0, "stop_reason": reason})


def decode_job(core: ServiceCore, st: DecodeState, req: GenerateRequest, owner: str,
               first: bool) -> Job[tuple[int, float]]:
    """One target-only token (a long prompt first runs in chunks); result (token, forward ms)."""
    room, model = core.room, core.model
    rows: list[Row] = []
    spent = [0.0]

    def plan(budget: int) -> Row:
        rows[:] = [st.plan(model.pool, budget)]
        room.in_forward.add(id(st))
        return rows[0]

    def finish(logits: Any, ms: float) -> tuple[int, float] | Pending:
        room.in_forward.discard(id(st))
        spent[0] += ms
        tok = st.step(model.pool, rows[0], logits, req.sampling_cfg, req.seed, job.p)
        if tok is None and st not in room.gen_prefilling:  # its next chunk waits for a later forward
            room.gen_prefilling.append(st)
        elif tok is not None:
            room.forget_generate(st)
        return PENDING if tok is None else (tok, spent[0])

    def abort() -> None:
        room.in_forward.discard(id(st))
        if rows and st.slot is not None:
            st.kv_len = min(st.kv_len, rows[0].past)
            model.pool.crop(st.slot, st.kv_len)

    def unplan() -> None:
        room.in_forward.discard(id(st))
        st.unplan(model.pool)

    job: Job[tuple[int, float]] = Job(
        plan=plan, finish=finish, abort=abort, key=f"generate-{id(st)}", kind=PREFILL if first else DECODE,
        owner=owner, unplan=unplan, sampling=lambda _: RowSampling(req.sampling_cfg, st.ids))
    return job

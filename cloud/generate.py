"""Target-only generation (POST /v1/generate): no session, one scheduler job for the whole generation.

The prompt is prefilled in chunks, then each token is the target's draw at its position, keyed by
(seed, position) as a k = 0 bonus would be. The job stays queued from token to token: its finish hands each token
to the event loop and asks for the next forward itself, so the model thread never waits for the event loop to
send a token and submit the next step (a job a token left the model thread idle about 5 % of a one-token
llama.cpp step, BENCHMARKS "cloud_only against llama.cpp's own loop"). The generation is admitted as new work
when it starts; its blocks go back between forwards when it ends, however it ends (a caller that leaves cancels
the job before its next forward).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cloud.core import ServiceCore
from cloud.jobs import DECODE, PENDING, PREFILL, Job, Pending
from cloud.prefill import DecodeState
from shared.config import SamplingConfig
from shared.errors import InvalidArgument
from shared.rows import Row
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
            if limit > 0:
                loop = asyncio.get_running_loop()
                tokens: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
                step = DecodeJob(core, st, req, owner, limit,
                                 lambda tok, ms: loop.call_soon_threadsafe(tokens.put_nowait, (tok, ms)))
                job = asyncio.ensure_future(core.scheduler.submit(step, since=t_start))
                got: asyncio.Future[tuple[int, float]] | None = None
                try:
                    i = 0
                    while True:
                        got = asyncio.ensure_future(tokens.get())
                        await asyncio.wait({got, job}, return_when=asyncio.FIRST_COMPLETED)
                        if not got.done():  # the job ended: its last tokens are already queued
                            got.cancel()
                            if tokens.empty():
                                (_, waited) = job.result()  # raises the job's error
                                queue_ms = waited
                                break
                            got = asyncio.ensure_future(tokens.get())
                            await got
                        tok, ms = got.result()
                        prefill_ms, decode_ms = (ms, decode_ms) if i == 0 else (prefill_ms, decode_ms + ms)
                        i += 1
                        core.metrics.generated.inc()
                        core.budget.committed(1)
                        yield GenerateEvent(token_id=tok)
                        if req.stop_at_eos and tok in core.info.eos_ids:
                            reason = "eos"
                except BaseException:
                    if got is not None and not got.done():
                        got.cancel()
                    if not job.done():
                        await core.abandon(step, job)  # the sequence is released once the model let go of it
                    raise
                if reason != "eos" and limit < req.max_new_tokens:
                    reason = "context"
            elif limit < req.max_new_tokens:
                reason = "context"
    finally:
        core.scheduler.between_batches(lambda: core.eviction.end_generate(st))
        core.scheduler.forget(f"generate-{id(st)}")
    core.metrics.prompt_prefill_ms.observe(prefill_ms)
    yield GenerateEvent(metrics={"tokens": len(st.ids) - len(req.prompt_ids), "prefill_ms": prefill_ms,
                                 "decode_ms": decode_ms, "queue_ms": queue_ms,
                                 "total_ms": (core.clock() - t_start) * 1000.0, "stop_reason": reason})


class DecodeJob(Job[int]):
    """The whole generation as one job: the prompt in chunks, then a token a forward, each handed to `emit`
    (token, ms of the forwards since the last token) on the model thread; it stays queued (PENDING) until
    `limit` tokens or an eos token with stop_at_eos, then answers the token count."""

    def __init__(self, core: ServiceCore, st: DecodeState, req: GenerateRequest, owner: str, limit: int,
                 emit: Callable[[int, float], object]) -> None:
        # a prefill until its first token, running work from then on
        super().__init__(PREFILL, key=f"generate-{id(st)}", owner=owner)
        self.core, self.st, self.req, self.limit, self.emit = core, st, req, limit, emit
        # the row planned for the forward being built
        self.row: Row | None = None
        # forward ms since the last token, and tokens made
        self.spent = 0.0
        self.made = 0

    def plan(self, budget: int) -> Row:
        self.row = self.st.plan(self.core.model.pool, budget)
        self.core.eviction.in_forward.add(id(self.st))
        return self.row

    def sampling(self, row: Row) -> RowSampling:
        st, req = self.st, self.req
        return RowSampling(req.sampling_cfg, st.ids, seed=req.seed, positions=[len(st.ids) + 1])

    def finish(self, logits: Any, ms: float) -> int | Pending:
        eviction, st, req = self.core.eviction, self.st, self.req
        assert self.row is not None
        eviction.in_forward.discard(id(st))
        self.spent += ms
        tok = st.step(self.core.model.pool, self.row, logits, req.sampling_cfg, req.seed, self.p)
        if tok is None:  # its next chunk waits for a later forward
            if st not in eviction.gen_prefilling:
                eviction.gen_prefilling.append(st)
            return PENDING
        if self.made == 0:
            eviction.forget_generate(st)
            self.kind = DECODE  # running work from now on
        self.made += 1
        self.emit(tok, self.spent)
        self.spent = 0.0
        if self.made >= self.limit or (req.stop_at_eos and tok in self.core.info.eos_ids):
            return self.made
        return PENDING

    def abort(self) -> None:
        st = self.st
        self.core.eviction.in_forward.discard(id(st))
        if self.row is not None and st.seq_id is not None:
            st.kv_len = min(st.kv_len, self.row.num_cached_tokens)
            self.core.model.pool.crop(st.seq_id, st.kv_len)

    def unplan(self) -> None:
        self.core.eviction.in_forward.discard(id(self.st))
        self.st.unplan(self.core.model.pool)

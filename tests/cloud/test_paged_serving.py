"""The serving core on the paged cache: scheduling under a token budget, prefix sharing, running out
of blocks. Forwards are counted (the model runner's `on_batch`: the service's), never timed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from cloud.jobs import DECODE, PREFILL, ROUND, BatchStats, Job
from cloud.scheduler import Scheduler
from cloud.service import VerifierService
from shared.config import SamplingConfig
from shared.errors import NotFound, ResourceExhausted
from shared.kvpool import Row
from shared.protocol import OpenSessionRequest, VerifyResponse
from tests.cloud.conftest import FakeClock
from tests.cloud.fake_runner import ChunkedPrefill, FakeRunner, FnJob
from tests.cloud.reference import CausalLM
from tests.cloud.test_batching import gated, greedy_continuation
from tests.cloud.test_service import draft_request

GREEDY = SamplingConfig(0.0)


@pytest.fixture(scope="module")
def text_ids(tiny_pair: tuple[Path, Path]) -> Callable[[int, int], list[int]]:
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    base = list(tok.encode("def main(argv):\n    for line in open(argv[1]):\n        print(line.strip())\n" * 20))

    def make(n: int, seed: int) -> list[int]:
        """n tokens of code text, distinct per seed from the first token on."""
        return [100 + seed] + base[seed: seed + n - 1]

    return make


def record_forwards(svc: VerifierService) -> list[BatchStats]:
    seen: list[BatchStats] = []
    inner = svc.on_batch

    def hook(b: BatchStats) -> None:
        seen.append(b)
        inner(b)

    svc.on_batch = hook
    return seen


def test_a_round_waits_at_most_one_forward_behind_a_burst_of_prefills(
        make_service: Callable[..., VerifierService], text_ids: Callable[[int, int], list[int]],
        tiny_reference: CausalLM) -> None:
    """Eight 120-token opens queue before a round (budget 32 tokens per forward: the opens need about
    30 forwards); the round runs in the first forward. A second round sent while the burst is running
    runs in the forward after the one in progress."""
    svc = make_service(max_batch_tokens=32, batch_wait_ms=0)
    prompt = text_ids(12, 0)
    truth = greedy_continuation(tiny_reference, prompt, 2)

    async def main() -> None:
        a = (await svc.open_session(OpenSessionRequest(prompt, GREEDY), "")).ctx_id
        forwards = record_forwards(svc)
        opens = [svc.open_session(OpenSessionRequest(text_ids(120, i + 1), GREEDY), "") for i in range(8)]
        round1 = svc.verify(draft_request(a, prompt, [truth[0]], q=1.0), "", 1)
        got = await gated(svc, [*opens, round1])
        assert all(not isinstance(g, BaseException) for g in got), got
        first_round = next(i for i, b in enumerate(forwards) if any(k == ROUND for k, _ in b.waits))
        assert first_round == 0 and len(forwards) > 20
        assert max(b.tokens for b in forwards) <= 32  # the budget holds with prefills chunked
        # a round sent while the burst runs
        ctx = prompt + truth[:1] + [got[-1].correction]
        before = len(forwards)
        burst = [asyncio.ensure_future(svc.open_session(OpenSessionRequest(text_ids(120, i + 20), GREEDY), ""))
                 for i in range(8)]
        while len(forwards) < before + 3:
            await asyncio.sleep(0.001)
        sent_at = len(forwards)  # forwards finished when the round is sent
        await svc.verify(draft_request(a, ctx, [], q=1.0), "", 0)
        ran = next(i for i in range(sent_at, len(forwards)) if any(k == ROUND for k, _ in forwards[i].waits))
        assert ran <= sent_at + 1  # the forward in progress, then the round's
        assert not all(t.done() for t in burst)  # the burst was still queued behind it
        await asyncio.gather(*burst)

    asyncio.run(main())


def test_one_keys_burst_of_opens_does_not_starve_another_key(
        make_service: Callable[..., VerifierService], text_ids: Callable[[int, int], list[int]]) -> None:
    """Key a queues six 120-token opens, then key b one: prefills are taken round-robin over keys, so
    b's open finishes before a's second one."""
    svc = make_service(max_batch_tokens=32, batch_wait_ms=0)
    done: list[str] = []

    async def open_(owner: str, ids: list[int]) -> None:
        await svc.open_session(OpenSessionRequest(ids, GREEDY), owner)
        done.append(owner)

    async def main() -> None:
        await gated(svc, [*[open_("a", text_ids(120, i)) for i in range(6)], open_("b", text_ids(120, 9))])

    asyncio.run(main())
    assert done.index("b") <= 1, done


def test_shared_prefix_is_reused_within_a_key_and_answers_exactly(
        make_service: Callable[..., VerifierService], text_ids: Callable[[int, int], list[int]],
        tiny_reference: CausalLM) -> None:
    """Two sessions whose prompts share 100 tokens: the second reuses 6 full blocks (96 positions)
    and its greedy rounds are the target's; another key reuses nothing unless sharing is turned on."""
    base = text_ids(100, 1)
    first, second = base + [7, 8, 9], base + [11, 12]
    truth = greedy_continuation(tiny_reference, second, 6)

    def hits(svc: VerifierService) -> float:
        svc.render_metrics()
        return svc.metrics.registry.get_sample_value("specsplit_cloud_prefix_cache_hit_tokens_total") or 0.0

    async def run(svc: VerifierService, owners: tuple[str, str]) -> float:
        await svc.open_session(OpenSessionRequest(first, GREEDY), owners[0])
        before = hits(svc)
        b = (await svc.open_session(OpenSessionRequest(second, GREEDY), owners[1])).ctx_id
        got = hits(svc) - before
        resp = await svc.verify(draft_request(b, second, truth[:4], q=1.0), owners[1], 4)
        assert (resp.accepted_len, resp.correction) == (4, truth[4])
        return got

    assert asyncio.run(run(make_service(), ("k1", "k1"))) == 96
    assert asyncio.run(run(make_service(), ("k1", "k2"))) == 0
    assert asyncio.run(run(make_service(share_prefix_across_keys=True), ("k1", "k2"))) == 96
    assert asyncio.run(run(make_service(prefix_cache=False), ("k1", "k1"))) == 0


def test_when_blocks_run_out_the_least_recently_used_idle_session_goes(
        make_service: Callable[..., VerifierService], text_ids: Callable[[int, int], list[int]],
        tiny_target: Any, tiny_reference: CausalLM) -> None:
    """A pool of 12 blocks of 4 positions: two 20-token sessions fit (each has run a round), a third
    evicts the least recently used one (404) once both are idle (past eviction_active_s: a session mid-generation
    is never evicted), and the pool never holds more than the budget; the survivor answers exactly."""
    budget = 12 * 4 * tiny_target.kv_bytes_per_token
    clock = FakeClock()
    svc = make_service(clock=clock, kv_budget_bytes=budget, kv_block_size=4)
    p = [text_ids(20, i) for i in range(3)]

    async def main() -> None:
        a = (await svc.open_session(OpenSessionRequest(p[0], GREEDY), "")).ctx_id
        b = (await svc.open_session(OpenSessionRequest(p[1], GREEDY), "")).ctx_id
        await svc.verify(draft_request(b, p[1], [], q=1.0), "", 0)  # both have run a round (evictable) ...
        clock.advance(0.5)
        await svc.verify(draft_request(a, p[0], [], q=1.0), "", 0)  # ... and a is now more recent than b
        clock.advance(2.0)  # both idle
        c = (await svc.open_session(OpenSessionRequest(p[2], GREEDY), "")).ctx_id
        with pytest.raises(NotFound):
            await svc.verify(draft_request(b, p[1], [], q=1.0), "", 0)
        resp = await svc.verify(draft_request(c, p[2], [], q=1.0), "", 0)
        assert isinstance(resp, VerifyResponse)
        assert resp.correction == greedy_continuation(tiny_reference, p[2], 1)[0]

    asyncio.run(main())
    assert svc.model.pool.allocated_bytes <= budget
    assert svc.metrics.evictions.labels(reason="kv_budget")._value.get() == 1
    svc.model.pool.manager.check()


def test_a_job_that_cannot_get_its_blocks_even_alone_is_refused_with_429() -> None:
    """The scheduler alone, with a fake runner: 3 blocks left, a row needing 4, nothing to evict."""
    asked: list[int] = []
    calls: list[list[Row]] = []

    def forward(rows: list[Row]) -> list[torch.Tensor]:
        calls.append(rows)
        return [torch.zeros(r.num_logits, 4) for r in rows]

    runner = FakeRunner(forward, blocks_needed=lambda r: len(r.ids) // 4, blocks_available=lambda: 3,
                        make_room=lambda n, _: asked.append(n))
    sched = Scheduler(lambda: 0.0, runner, batch_wait_ms=0)

    async def main() -> None:
        big = FnJob(lambda _: Row(0, 0, [1] * 16, 0), lambda _, __: 0.0, kind=PREFILL)
        small = FnJob(lambda _: Row(1, 0, [1] * 4, 1), lambda _, __: 1.0)
        got = await asyncio.gather(sched.submit(big), sched.submit(small), return_exceptions=True)
        assert isinstance(got[0], ResourceExhausted) and got[0].http_status == 429
        assert got[0].retry_after_s is not None
        assert got[1][0] == 1.0  # type: ignore[index]

    try:
        asyncio.run(main())
    finally:
        sched.shutdown()
    assert asked and all(len(rows) == 1 and len(rows[0].ids) == 4 for rows in calls)


def run_queued_together(jobs: list[Job[Any]], calls: list[list[Row]], **scheduler: Any) -> list[list[Row]]:
    """The scheduler alone with a fake runner: every job queued while the model thread is held, then let go;
    the rows of each forward go into `calls` (the jobs' finish() may read it) and are returned."""
    gate = threading.Event()

    def forward(rows: list[Row]) -> list[torch.Tensor]:
        calls.append(rows)
        return [torch.zeros(r.num_logits, 4) for r in rows]

    sched = Scheduler(lambda: 0.0, FakeRunner(forward), batch_wait_ms=0, **scheduler)

    async def main() -> None:
        blocker = asyncio.ensure_future(sched.run(gate.wait))
        await asyncio.sleep(0.01)
        futures = [asyncio.ensure_future(sched.submit(j)) for j in jobs]
        # all queued while the blocker holds the model thread (it may or may not still be in the queue)
        while not all(any(q is j for q in list(sched._queue)) for j in jobs):
            await asyncio.sleep(0.001)
        gate.set()
        await blocker
        await asyncio.gather(*futures)

    try:
        asyncio.run(main())
    finally:
        sched.shutdown()
    return calls


def test_decode_steps_and_rounds_go_first_and_prefills_fill_the_rest() -> None:
    """The scheduler alone, with a fake runner and a 32-token budget: three 100-token prefills queued
    before a decode step and a 5-token round; the first forward runs the decode step and the round,
    then prefill chunks up to the budget."""
    calls: list[list[Row]] = []
    jobs = [*(ChunkedPrefill(i, 100, owner=f"k{i}") for i in range(3)),
            FnJob(lambda _: Row(10, 7, [2], 1), lambda _, __: 2.0, kind=DECODE),
            FnJob(lambda _: Row(11, 9, [3] * 5, 5), lambda _, __: 3.0, kind=ROUND)]
    got = run_queued_together(jobs, calls, max_batch_tokens=32)
    first = got[0]
    assert [r.seq_id for r in first[:2]] == [10, 11]  # the decode step and the round, before any prefill
    assert sum(len(r.ids) for r in first) == 32 and all(r.num_logits == 0 for r in first[2:])
    assert all(sum(len(r.ids) for r in c) <= 32 for c in got)


def test_a_long_resync_runs_in_chunks_and_answers_exactly(
        make_service: Callable[..., VerifierService], text_ids: Callable[[int, int], list[int]],
        tiny_reference: CausalLM) -> None:
    """A round whose append_ids carry 60 tokens under a 16-token budget: its context runs in prefill
    chunks (several forwards, none above the budget), then the verify row; the answer is the target's."""
    svc = make_service(max_batch_tokens=16, batch_wait_ms=0)
    prompt = text_ids(6, 2)
    resync = prompt + text_ids(60, 4)
    truth = greedy_continuation(tiny_reference, resync, 4)

    async def main() -> VerifyResponse:
        a = (await svc.open_session(OpenSessionRequest(prompt, GREEDY), "")).ctx_id
        req = draft_request(a, resync, truth[:3], q=1.0)
        req.append_ids = resync[len(prompt):]
        return await svc.verify(req, "", 3)

    forwards = record_forwards(svc)
    resp = asyncio.run(main())
    assert (resp.accepted_len, resp.correction, resp.ctx_len) == (3, truth[3], len(resync) + 4)
    assert len(forwards) >= 5 and max(b.tokens for b in forwards) <= 16


def test_an_open_that_matches_cached_blocks_cannot_take_the_blocks_a_round_was_promised(
        make_service: Callable[..., VerifierService], text_ids: Callable[[int, int], list[int]],
        tiny_target: Any, tiny_reference: CausalLM) -> None:
    """The race of a tight budget, driven deterministically (both requests queued behind a held model
    thread, then one forward is built): 8 blocks of 4 positions; two cached prefix blocks (a closed
    session's 8-position prompt) are the only ones left while session A (6 blocks) sends a k = 3 round
    that needs one more block, and an open whose prompt is wholly in the prefix cache arrives with it.
    The open's prefix match must not take the block the round was promised: no forward fails for
    memory, the round answers with the target's greedy token, and the pool stays within its budget.
    The open then lacks one block and session A has just run a round: A is not evicted for it (the open
    answers 429 kv_budget_bytes, to be retried) or the open fits."""
    budget = 8 * 4 * tiny_target.kv_bytes_per_token
    svc = make_service(kv_budget_bytes=budget, kv_block_size=4)
    cached_prompt, a_prompt = text_ids(9, 1), text_ids(24, 2)
    failed: list[int] = []
    real_forward = svc.forward

    def counting(rows: list[Row]) -> list[torch.Tensor]:
        try:
            assert real_forward is not None
            return real_forward(rows)
        except Exception:
            failed.append(len(rows))
            raise

    svc.forward = counting

    async def main() -> None:
        p = await svc.open_session(OpenSessionRequest(cached_prompt, GREEDY), "")
        svc.close_session(p.ctx_id, "")
        a = await svc.open_session(OpenSessionRequest(a_prompt, GREEDY), "")
        await asyncio.sleep(0.05)  # the closed session's sequence is released on the model thread
        m = svc.model.pool.manager
        assert len(m.cached) == 2 and m.available() == 2
        truth = greedy_continuation(tiny_reference, a_prompt, 4)
        got = await gated(svc, [svc.verify(draft_request(a.ctx_id, a_prompt, truth[:3], q=1.0), "", 3),
                                svc.open_session(OpenSessionRequest(cached_prompt, GREEDY), "")])
        assert isinstance(got[0], VerifyResponse), got
        assert got[0].accepted_len == 3 and got[0].correction == truth[3]
        assert not isinstance(got[1], BaseException) or (isinstance(got[1], ResourceExhausted)
                                                         and got[1].details["limit"] == "kv_budget_bytes"), got
        assert svc.get_session(a.ctx_id, "").ctx_len == len(a_prompt) + 4  # a mid-generation session stays

    asyncio.run(main())
    assert failed == []
    assert svc.model.pool.allocated_bytes <= budget
    svc.model.pool.manager.check()


def test_a_session_that_has_not_run_a_round_yet_is_not_evicted(
        make_service: Callable[..., VerifierService], text_ids: Callable[[int, int], list[int]],
        tiny_target: Any) -> None:
    """12 blocks of 4 positions, two 20-token sessions opened and idle, no round yet: a third open finds
    nothing it may evict and answers 429 (the two keep their caches); once one of them has run a round
    it may go, and the third opens."""
    budget = 12 * 4 * tiny_target.kv_bytes_per_token
    clock = FakeClock()
    svc = make_service(clock=clock, kv_budget_bytes=budget, kv_block_size=4)
    p = [text_ids(20, i) for i in range(3)]

    async def main() -> None:
        a = (await svc.open_session(OpenSessionRequest(p[0], GREEDY), "")).ctx_id
        b = (await svc.open_session(OpenSessionRequest(p[1], GREEDY), "")).ctx_id
        with pytest.raises(ResourceExhausted):
            await svc.open_session(OpenSessionRequest(p[2], GREEDY), "")
        assert {svc.get_session(x, "").ctx_id for x in (a, b)} == {a, b}
        await svc.verify(draft_request(a, p[0], [], q=1.0), "", 0)
        clock.advance(2.0)  # a idle since its round (a session mid-generation is never evicted)
        await svc.open_session(OpenSessionRequest(p[2], GREEDY), "")  # a has run a round: a may go
        with pytest.raises(NotFound):
            svc.get_session(a, "")

    asyncio.run(main())
    assert svc.model.pool.allocated_bytes <= budget


def test_a_forward_with_rounds_gives_prefills_only_their_share() -> None:
    """The scheduler alone, a fake runner, a 256-token budget and a prefill share of 32: a 5-token round and
    a 600-token prefill queued together run as the round plus 32 prefill tokens; the forwards after the
    round give the prefill the whole budget (its throughput with no round running is unchanged)."""
    calls: list[list[Row]] = []
    jobs = [ChunkedPrefill(1, 600), FnJob(lambda _: Row(2, 9, [3] * 5, 5), lambda _, __: 3.0, kind=ROUND)]
    run_queued_together(jobs, calls, max_batch_tokens=256, max_prefill_tokens_with_rounds=32)
    assert [(r.seq_id, len(r.ids)) for r in calls[0]] == [(2, 5), (1, 32)]
    assert [len(c[0].ids) for c in calls[1:]] == [256, 256, 56]


def test_an_open_sharing_a_prefix_with_a_running_prefill_waits_for_its_blocks(
        make_service: Callable[..., VerifierService], text_ids: Callable[[int, int], list[int]],
        tiny_reference: CausalLM) -> None:
    """Two opens queued together (one forward is built while both wait), their 25-token prompts sharing the
    first 16 tokens (four blocks of 4): the second sits the first forward out and then takes the four
    shared blocks from the prefix cache instead of computing them again; both answer exactly."""
    svc = make_service(kv_block_size=4)
    base = text_ids(30, 3)
    a_prompt, b_prompt = base[:16] + text_ids(9, 4), base[:16] + text_ids(9, 5)

    async def main() -> None:
        got = await gated(svc, [svc.open_session(OpenSessionRequest(p, GREEDY), "") for p in (a_prompt, b_prompt)])
        assert not any(isinstance(g, BaseException) for g in got), got
        for info, p in zip(got, (a_prompt, b_prompt), strict=True):
            resp = await svc.verify(draft_request(info.ctx_id, p, [], q=1.0), "", 0)
            assert resp.correction == greedy_continuation(tiny_reference, p, 1)[0]

    asyncio.run(main())
    assert svc.model.pool.manager.hit_tokens == 16

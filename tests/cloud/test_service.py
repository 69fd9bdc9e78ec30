"""The service on the event loop: admission, ordering, limits, clocks, logs, auth, generate."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from transformers import AutoTokenizer

from cloud.logs import JsonFormatter
from cloud.rest import VerifyBody
from cloud.runners.torch_runner import TargetModel
from cloud.service import GenerateRequest, VerifierService, key_owner
from shared.config import SamplingConfig
from shared.errors import (
    ContextMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from shared.hashing import ctx_hash
from shared.protocol import OpenSessionRequest, VerifyRequest
from shared.rng import SAMPLE, position_uniform, sample_index
from shared.sampling import processed_probs
from tests.cloud.conftest import FakeClock
from tests.cloud.reference import CausalLM

T = TypeVar("T")
CFG = SamplingConfig(1.0, 0.9, 0, 1.1)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def prompt(tiny_pair: tuple[Path, Path]) -> list[int]:
    return list(AutoTokenizer.from_pretrained(tiny_pair[0]).encode("import numpy as np\n"))


def k0_request(ctx_id: str, ids: list[int], request_id: str = "") -> VerifyRequest:
    """A round with no draft: the cloud answers one bonus token."""
    return VerifyBody(ctx_id=ctx_id, ctx_len=len(ids), ctx_hash=ctx_hash(ids), draft_tokens=[], q_token_probs=[],
                      k=0, request_id=request_id).to_request()


def draft_request(ctx_id: str, ids: list[int], tokens: list[int], q: float = 0.5) -> VerifyRequest:
    return VerifyBody(ctx_id=ctx_id, ctx_len=len(ids), ctx_hash=ctx_hash(ids), draft_tokens=tokens,
                      q_token_probs=[q] * len(tokens), k=len(tokens)).to_request()


async def open_(svc: VerifierService, prompt: list[int], seed: int = 1, owner: str = "") -> str:
    return (await svc.open_session(OpenSessionRequest(prompt, CFG, seed), owner)).ctx_id


def test_full_queue_refuses_new_work_and_still_serves_rounds(make_service: Callable[..., VerifierService],
                                                             prompt: list[int]) -> None:
    """max_queue_depth = 2 with two opens waiting: a third open is refused at once (429 naming the limit,
    nothing opened), while rounds of open sessions are still admitted and served."""
    svc = make_service(max_queue_depth=2)

    async def main() -> None:
        ids = [await open_(svc, prompt, seed) for seed in range(3)]
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))  # the model thread is busy
        opens = [asyncio.create_task(open_(svc, prompt, seed)) for seed in (7, 8)]
        busy = [asyncio.create_task(svc.verify(k0_request(i, prompt), "", 0)) for i in ids]
        await asyncio.sleep(0.05)
        assert svc.admission.depth == 5
        with pytest.raises(ResourceExhausted) as e:
            await open_(svc, prompt, 9)
        assert e.value.details["limit"] == "max_queue_depth" and len(svc.store) == 3
        gate.set()
        await blocker
        assert all(r.ctx_len == len(prompt) + 1 for r in await asyncio.gather(*busy))
        await asyncio.gather(*opens)
        assert svc.admission.depth == 0 and len(svc.store) == 5

    run(main())


def test_rounds_of_one_session_are_applied_in_arrival_order(make_service: Callable[..., VerifierService],
                                                            prompt: list[int]) -> None:
    """Round 2 is built on round 1's result; fired together, both succeed only if applied in order."""
    svc = make_service()

    async def main() -> None:
        probe = await open_(svc, prompt, seed=7)
        r1 = await svc.verify(k0_request(probe, prompt), "", 0)
        assert r1.correction is not None
        s1 = prompt + [r1.correction]
        ctx_id = await open_(svc, prompt, seed=7)
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))
        first = asyncio.create_task(svc.verify(k0_request(ctx_id, prompt), "", 0))
        second = asyncio.create_task(svc.verify(k0_request(ctx_id, s1), "", 0))
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        a, b = await asyncio.gather(first, second)
        assert a.ctx_hash == r1.ctx_hash and b.ctx_len == len(prompt) + 2

    run(main())


def test_queue_and_prefill_times_come_from_the_injected_clock(make_service: Callable[..., VerifierService],
                                                              prompt: list[int], monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    clock = FakeClock()
    svc = make_service(clock=clock)
    real = TargetModel.forward

    def slow_forward(self: TargetModel, rows: list[Any]) -> list[torch.Tensor]:
        clock.advance(0.042)
        return real(self, rows)

    async def main() -> None:
        ctx_id = await open_(svc, prompt)
        monkeypatch.setattr(TargetModel, "forward", slow_forward)
        blocker = asyncio.ensure_future(svc.scheduler.run(lambda: clock.advance(0.1)))  # 100 ms ahead in the queue
        await asyncio.sleep(0)  # let it take its place in the queue first
        resp = await svc.verify(draft_request(ctx_id, prompt, [5, 6]), "", 2)
        await blocker
        assert resp.metrics.prefill_ms == pytest.approx(42.0)
        assert resp.metrics.queue_ms == pytest.approx(100.0)

    run(main())


def test_idle_session_expires_by_the_injected_clock(make_service: Callable[..., VerifierService],
                                                    prompt: list[int]) -> None:
    clock = FakeClock()
    svc = make_service(clock=clock, session_ttl_s=30)

    async def main() -> None:
        ctx_id = await open_(svc, prompt)
        clock.advance(29)
        await svc.verify(k0_request(ctx_id, prompt), "", 0)
        clock.advance(31)
        with pytest.raises(NotFound):
            await svc.verify(k0_request(ctx_id, prompt), "", 0)

    run(main())
    assert svc.metrics.evictions.labels(reason="ttl")._value.get() == 1


def test_kv_budget_evicts_the_least_recently_used_session(make_service: Callable[..., VerifierService],
                                                          prompt: list[int], tiny_target: TargetModel) -> None:
    per_session = (len(prompt) - 1) * tiny_target.kv_bytes_per_token  # an open caches S[:-1]
    # blocks of one position and no prefix sharing (the three prompts are equal): memory by session
    clock = FakeClock()
    svc = make_service(clock=clock, kv_budget_bytes=int(2.5 * per_session), kv_block_size=1, prefix_cache=False)

    async def main() -> None:
        a = await open_(svc, prompt, 1)
        b = await open_(svc, prompt, 2)
        await svc.verify(k0_request(b, prompt), "", 0)  # both have run a round (a fresh one is spared) ...
        clock.advance(0.5)
        await svc.verify(k0_request(a, prompt), "", 0)  # ... and a is now more recently used than b
        clock.advance(2.0)  # both idle (a session mid-generation is never evicted)
        c = await open_(svc, prompt, 3)  # needs room: b goes
        with pytest.raises(NotFound):
            svc.get_session(b, "")
        assert {svc.get_session(x, "").ctx_id for x in (a, c)} == {a, c}
        assert svc.store.kv_bytes <= svc.settings.kv_budget_bytes

    run(main())
    assert svc.metrics.evictions.labels(reason="kv_budget")._value.get() == 1


def test_a_session_used_just_now_is_evicted_only_when_nothing_else_can_run(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """Two sessions that have run rounds: b idle for 10 s, a used 0.2 s ago. Asked for room while the
    forward has other rows (`progressing`), the service evicts b and never a; asked for more than b
    frees, it stops there (the job waits); asked with nothing else to run, a may go too."""
    clock = FakeClock()
    svc = make_service(clock=clock, kv_block_size=1, prefix_cache=False)

    async def main() -> None:
        a = await open_(svc, prompt, 1)
        b = await open_(svc, prompt, 2)
        await svc.verify(k0_request(b, prompt), "", 0)
        clock.advance(10.0)
        await svc.verify(k0_request(a, prompt), "", 0)
        clock.advance(0.2)
        pool = svc.model.pool
        sa, sb = svc.store._sessions[a], svc.store._sessions[b]  # a look that does not count as a use
        assert sa.seq_id is not None and sb.seq_id is not None
        svc.eviction.make_room(pool.manager.available() + 10 ** 6, progressing=True)  # more than every session holds
        assert sb.seq_id is None and sb.closed
        assert sa.seq_id is not None  # a, used 0.2 s ago, is spared: the job that lacks blocks waits instead
        svc.eviction.make_room(pool.manager.available() + 10 ** 6, progressing=False)
        assert sa.seq_id is None  # nothing else to run: a goes too
        await asyncio.sleep(0)  # the store drops them on the event loop
        for x in (a, b):
            with pytest.raises(NotFound):
                svc.get_session(x, "")

    run(main())


def test_open_session_rejects_bad_prompts_and_settings(make_service: Callable[..., VerifierService],
                                                       prompt: list[int]) -> None:
    svc = make_service(max_prompt_len=8, max_sessions=1)
    vocab = svc.info.vocab_size
    cases = {
        "empty": OpenSessionRequest([], CFG),
        "too long": OpenSessionRequest(list(range(9)), CFG),
        "id": OpenSessionRequest([1, vocab], CFG),
        "correction": OpenSessionRequest([1, 2], CFG, correction="lossy"),
        "seed": OpenSessionRequest([1, 2], CFG, seed=-1),
    }

    async def main() -> None:
        for name, req in cases.items():
            with pytest.raises(InvalidArgument):
                await svc.open_session(req, "")
            assert len(svc.store) == 0, name
        await svc.open_session(OpenSessionRequest([1, 2], CFG), "")
        with pytest.raises(ResourceExhausted):
            await svc.open_session(OpenSessionRequest([1, 2], CFG), "")

    run(main())


def test_prompt_limit_larger_than_the_model_context_is_a_start_error(make_service: Callable[..., VerifierService],
                                                                     tiny_target: TargetModel) -> None:
    with pytest.raises(ValueError, match="exceeds the model's context"):
        make_service(max_prompt_len=tiny_target.info.max_context + 1)


def test_sampling_cfg_that_differs_from_the_sessions_is_rejected(make_service: Callable[..., VerifierService],
                                                                 prompt: list[int]) -> None:
    svc = make_service()

    async def main() -> None:
        ctx_id = await open_(svc, prompt)
        with pytest.raises(InvalidArgument, match="sampling_cfg differs"):
            await svc.verify(k0_request(ctx_id, prompt), "", 0, SamplingConfig(1.0, 0.95, 0, 1.1))
        resp = await svc.verify(k0_request(ctx_id, prompt), "", 0, CFG)  # the same config is fine
        assert resp.ctx_len == len(prompt) + 1

    run(main())


def test_auth_keys_and_session_owners(make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    svc = make_service(api_keys=["alpha", "beta"])
    with pytest.raises(Unauthenticated):
        svc.authenticate(None)
    with pytest.raises(Unauthenticated):
        svc.authenticate("gamma")
    alice, bob = svc.authenticate("alpha"), svc.authenticate("beta")
    assert alice == key_owner("alpha") and alice != bob and "alpha" not in alice

    async def main() -> None:
        ctx_id = await open_(svc, prompt, owner=alice)
        with pytest.raises(PermissionDenied):
            await svc.verify(k0_request(ctx_id, prompt), bob, 0)
        with pytest.raises(PermissionDenied):
            svc.close_session(ctx_id, bob)
        assert svc.get_session(ctx_id, alice).ctx_len == len(prompt)

    run(main())
    assert make_service().authenticate(None) == ""  # auth off: one anonymous owner


def test_each_round_logs_one_json_line(make_service: Callable[..., VerifierService], prompt: list[int],
                                       caplog: pytest.LogCaptureFixture) -> None:
    svc = make_service()

    async def main() -> None:
        ctx_id = await open_(svc, prompt)
        req = draft_request(ctx_id, prompt, [5, 6, 7])
        req.request_id, req.draft.hard_mask = "req-1", [0, 1, 1]
        await svc.verify(req, "", 3)

    with caplog.at_level(logging.INFO, logger="specsplit.cloud.rounds"):
        run(main())
    lines = [JsonFormatter().format(r) for r in caplog.records if r.name == "specsplit.cloud.rounds"]
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["event"] == "verify_round" and rec["request_id"] == "req-1" and rec["k"] == 3
    assert 0 <= rec["accepted_len"] <= 3 and rec["la_over_k"] == pytest.approx(rec["accepted_len"] / 3, abs=1e-4)
    assert {"alpha_mean", "prefill_ms", "queue_ms", "next_kind"} <= set(rec)
    assert rec["hard_ratio"] == pytest.approx(2 / 3, abs=1e-4)


def test_generate_is_the_target_alone_with_position_keyed_draws(make_service: Callable[..., VerifierService],
                                                                prompt: list[int], tiny_reference: CausalLM) -> None:
    """Each generated token is drawn at its position exactly as a k = 0 round's bonus would be."""
    svc = make_service()
    req = GenerateRequest(prompt, CFG, seed=21, max_new_tokens=6, stop_at_eos=False)

    async def main() -> tuple[list[int], list[int]]:
        events = [e async for e in svc.start_generate(req, "")]
        gen = [e.token_id for e in events if e.token_id is not None]
        assert events[-1].metrics is not None and events[-1].metrics["tokens"] == 6
        ctx_id = await open_(svc, prompt, seed=21)
        ids = list(prompt)
        for _ in range(6):
            ids.append((await svc.verify(k0_request(ctx_id, ids), "", 0)).correction)  # type: ignore[arg-type]
        return gen, ids[len(prompt):]

    gen, by_rounds = run(main())
    ref = list(prompt)
    for _ in range(6):
        p = processed_probs(tiny_reference.logits(ref, 1), CFG, ref)[0]  # [vocab]
        ref.append(sample_index(p.double(), position_uniform(21, len(ref) + 1, SAMPLE)))
    assert gen == by_rounds == ref[len(prompt):]


def test_a_generation_is_one_job_whose_tokens_need_no_event_loop_between_forwards(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """The whole generation is one scheduler job: while the event loop is blocked after the first token, the
    model thread still runs every further forward (the tokens arrive all at once afterwards, in order, with the
    same text as an unblocked run), and a caller that leaves mid-generation stops it with its blocks back."""
    svc = make_service()
    req = GenerateRequest(prompt, CFG, seed=3, max_new_tokens=6, stop_at_eos=False)
    submits = []
    submit = svc.scheduler.submit

    def counted(job: Any, since: float | None = None) -> Any:
        submits.append(job)
        return submit(job, since)

    svc.scheduler.submit = counted  # type: ignore[method-assign]

    async def blocked() -> list[int]:
        out = []
        async for e in svc.start_generate(req, ""):
            if e.token_id is not None:
                out.append(e.token_id)
                if len(out) == 1:
                    time.sleep(1.0)  # the event loop blocked: no step could be submitted from here
        return out

    async def plain() -> list[int]:
        return [e.token_id async for e in svc.start_generate(req, "") if e.token_id is not None]

    forwards: list[float] = []
    on_batch = svc.on_batch

    def timed(b: Any) -> None:
        forwards.append(time.monotonic())
        on_batch(b)

    svc.on_batch = timed
    t0 = time.monotonic()
    first = run(blocked())
    assert len(submits) == 1 and len(first) == 6
    assert sum(t < t0 + 0.9 for t in forwards) >= 6  # prompt + 6 tokens' forwards ran while the loop slept
    assert run(plain()) == first

    async def leave() -> None:
        async for e in svc.start_generate(GenerateRequest(prompt, CFG, max_new_tokens=50, stop_at_eos=False), ""):
            if e.token_id is not None:
                break
        await svc.scheduler.run(lambda: None)
        await svc.scheduler.run(lambda: None)

    run(leave())
    assert svc.scheduler.call_sync(lambda: svc.model.pool.manager.seqs) == {}


def test_generate_checks_its_request_before_streaming(make_service: Callable[..., VerifierService]) -> None:
    svc = make_service(max_generate_tokens=10)
    with pytest.raises(InvalidArgument):
        svc.start_generate(GenerateRequest([1, 2], CFG, max_new_tokens=11), "")
    with pytest.raises(InvalidArgument):
        svc.start_generate(GenerateRequest([], CFG), "")


def test_context_mismatch_reports_the_clouds_length(make_service: Callable[..., VerifierService],
                                                    prompt: list[int]) -> None:
    svc = make_service()

    async def main() -> None:
        ctx_id = await open_(svc, prompt)
        with pytest.raises(ContextMismatch) as e:
            await svc.verify(k0_request(ctx_id, prompt + [1, 2]), "", 0)
        assert e.value.details["expected_ctx_len"] == len(prompt)
        assert e.value.details["expected_ctx_hash"] == ctx_hash(prompt)

    run(main())


def test_replay_cache_keeps_residual_distributions_within_its_byte_limit(make_service: Callable[..., VerifierService],
                                                                  prompt: list[int]) -> None:
    """Residual answers carry p_j over the vocabulary; the cache keeps them packed, within
    --replay-cache-bytes (here less than one distribution: the newest round's alone, what a resend needs)."""
    svc = make_service(replay_cache_size=8, replay_cache_bytes=1024)
    vocab = svc.info.vocab_size
    with torch.no_grad():  # the target's least likely next token: rejected, strict -> a residual answer
        unlikely = int(svc.model.model(input_ids=torch.tensor([prompt])).logits[0, -1].argmin())

    async def main() -> None:
        cid = await open_(svc, prompt)
        ids, append, sent = list(prompt), [], []
        for i in range(5):
            req = VerifyBody(ctx_id=cid, ctx_len=len(ids) + len(append), append_ids=append,
                             ctx_hash=ctx_hash(ids + append), draft_tokens=[unlikely], q_token_probs=[0.99], k=1,
                             request_id=f"round-{i}").to_request()
            resp = await svc.verify(req, "", 1)
            assert resp.next_kind == "residual" and resp.target_dist is not None
            sent.append((req, resp))
            ids = ids + append
            d = resp.target_dist
            append = [d.ids[max(range(len(d.ids)), key=lambda j: d.probs[j])]]  # the edge's draw, any will do
        s = svc.store.get(cid, "")
        assert sum(e.dist_ids is not None for e in s.replies.values()) == 1
        assert 0 < s.replay_bytes <= vocab * 12  # int32 ids + float64 probs of one distribution
        last_req, last_resp = sent[-1]
        again = await svc.verify(last_req, "", 1)  # the newest round's resend: the same answer, dist included
        assert again.target_dist == last_resp.target_dist and again.accepted_len == last_resp.accepted_len
        before = svc.get_session(cid, "")
        with pytest.raises(ContextMismatch):  # an older round's late duplicate: refused, nothing rolled back
            await svc.verify(sent[0][0], "", 1)
        after = svc.get_session(cid, "")
        assert (after.ctx_len, after.ctx_hash) == (before.ctx_len, before.ctx_hash)

    run(main())


def test_a_context_larger_than_the_whole_budget_is_refused_as_never_fitting(
        make_service: Callable[..., VerifierService], prompt: list[int], tiny_target: TargetModel) -> None:
    """A prompt whose cache exceeds the whole KV budget answers 422 (not 429 with Retry-After: retrying
    can never help), naming the limit; nothing is opened."""
    svc = make_service(kv_budget_bytes=(len(prompt) - 2) * tiny_target.kv_bytes_per_token, kv_block_size=1)

    async def main() -> None:
        with pytest.raises(InvalidArgument) as e:
            await svc.open_session(OpenSessionRequest(prompt, CFG), "")
        assert e.value.http_status == 422 and e.value.retry_after_s is None
        assert e.value.details["limit"] == "kv_budget_bytes" and "never fit" in e.value.message
        assert len(svc.store) == 0

    run(main())

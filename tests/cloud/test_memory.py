"""Memory under a tight KV budget: the first row of a forward never evicts a session mid-generation, a
half-finished prefill gives its blocks back before any session is evicted, and a non-finite state at an
open fails the open before a session is stored."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from cloud.generate import DecodeJob
from cloud.jobs import PENDING
from cloud.prefill import DecodeState, Prefill
from cloud.service import GenerateRequest, VerifierService
from shared.config import SamplingConfig
from shared.errors import ResourceExhausted, SpecSplitError
from shared.protocol import OpenSessionRequest
from tests.cloud.conftest import FakeClock
from tests.cloud.test_service import draft_request, k0_request

GREEDY = SamplingConfig(0.0)


@pytest.fixture(scope="module")
def text(tiny_pair: tuple[Path, Path]) -> list[int]:
    return list(AutoTokenizer.from_pretrained(tiny_pair[0]).encode("def main(argv):\n    return argv\n" * 30))


def test_a_round_first_in_its_forward_never_evicts_a_session_mid_generation(
        make_service: Callable[..., VerifierService], text: list[int]) -> None:
    """Ten blocks: session a (100 tokens, 7 blocks) has just run a round; b (40 tokens, 3 blocks) sends a
    round that needs one block more, alone in its forward: b is answered 429, a keeps its KV."""
    clock = FakeClock()
    probe = make_service()
    block = probe.model.kv_bytes_per_token * probe.model.pool.block_size
    svc = make_service(clock=clock, kv_budget_bytes=10 * block, prefix_cache=False, batch_wait_ms=0)
    pa, pb = text[:100], text[100:140]

    async def main() -> None:
        a = (await svc.open_session(OpenSessionRequest(pa, GREEDY), "")).ctx_id
        b = (await svc.open_session(OpenSessionRequest(pb, GREEDY), "")).ctx_id
        clock.advance(60.0)  # both long past their opening grace
        resp = await svc.verify(k0_request(a, pa), "", 0)  # a is mid-generation
        with pytest.raises(ResourceExhausted) as e:
            await svc.verify(draft_request(b, pb, pb[:10], q=1.0), "", 10)
        assert e.value.details["limit"] == "kv_budget_bytes"
        assert svc.get_session(a, "").ctx_len == resp.ctx_len  # a is still there, not evicted

    asyncio.run(main())


def test_a_waiting_half_finished_prefill_gives_its_blocks_back_and_resumes_from_the_prefix_cache(
        make_service: Callable[..., VerifierService], text: list[int]) -> None:
    svc = make_service()
    pool = svc.model.pool
    pre = Prefill(text[:100], salt=b"k")

    def first_chunk() -> None:
        row = pre.plan(pool, 32)
        assert row is not None
        svc.model.forward([row])
        pre.advance(pool, row)
        svc.eviction.prefilling.append(pre)  # as an open whose next chunk waits for a later forward

    svc.scheduler.call_sync(first_chunk)
    before = pool.manager.available()
    svc.scheduler.call_sync(lambda: svc.eviction.make_room(1, True))
    assert pre.seq_id is None and pool.manager.available() == before + 2  # its two blocks, now cached
    resumed = svc.scheduler.call_sync(lambda: pre.plan(pool, 32))
    assert resumed is not None and resumed.num_cached_tokens == 32  # taken from the prefix cache, not computed again
    svc.scheduler.call_sync(lambda: pool.release(resumed.seq_id))


def test_a_generate_prompt_half_prefilled_gives_its_blocks_back_and_its_token_is_unchanged(
        make_service: Callable[..., VerifierService], text: list[int]) -> None:
    """A /v1/generate prompt after its first chunk waits for a later forward: room-making takes its blocks
    back (cached), it resumes from the prefix cache, and its first token equals an undisturbed run's."""
    svc = make_service()
    pool = svc.model.pool
    req = GenerateRequest(text[:100], GREEDY, max_new_tokens=1)

    def run(st: DecodeState, disturb: bool) -> int:
        emitted: list[int] = []
        job = DecodeJob(svc, st, req, "", 1, lambda tok, ms: emitted.append(tok))
        out: Any = PENDING
        chunks = 0
        while out is PENDING:
            row = job.plan(32)
            logits = svc.model.forward([row])
            out = job.finish(logits[0], 1.0)
            chunks += 1
            if disturb and chunks == 1:
                assert st in svc.eviction.gen_prefilling
                before = pool.manager.available()
                svc.eviction.make_room(1, True)
                assert st.seq_id is None and pool.manager.available() == before + 2  # its two blocks, cached
                assert job.plan(32).num_cached_tokens == 32  # from the prefix cache, not computed again
                job.unplan()
        assert st not in svc.eviction.gen_prefilling
        svc.eviction.end_generate(st)
        assert out == 1 and len(emitted) == 1
        return emitted[0]

    disturbed = svc.scheduler.call_sync(lambda: run(DecodeState(list(text[:100]), salt=b"g"), True))
    clean = svc.scheduler.call_sync(lambda: run(DecodeState(list(text[:100]), salt=b"h"), False))
    assert disturbed == clean
    assert svc.scheduler.call_sync(lambda: pool.manager.seqs) == {}


def test_a_non_finite_state_at_an_open_fails_it_before_a_session_is_stored(
        make_service: Callable[..., VerifierService], text: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service()
    assert svc.info.feature_size > 0
    real = svc.model.hidden_of

    def nan_state(row: Any) -> torch.Tensor | None:
        h = real(row)
        return None if h is None else torch.full_like(h, float("nan"))

    monkeypatch.setattr(svc.model, "hidden_of", nan_state)
    with pytest.raises(SpecSplitError) as e:
        asyncio.run(svc.open_session(OpenSessionRequest(text[:20], GREEDY, feature_encoding="int8"), ""))
    assert e.value.http_status == 500 and len(svc.store) == 0
    svc.scheduler.call_sync(lambda: None)
    assert svc.model.pool.manager.seqs == {}

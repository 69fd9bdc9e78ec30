"""Rounds first whatever their timing: while a session is active (opened or answered within `session_active_ms`),
no forward gives prefills more than the slice (`max_prefill_tokens_with_rounds`), so a round that arrives
between forwards waits behind at most that much prefill. Forward sizes are read from the scheduler, and
time is a fake clock: nothing is timed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from cloud.engine import check_ids
from cloud.jobs import ROUND
from cloud.scheduler import Scheduler
from cloud.service import VerifierService
from shared.config import SamplingConfig
from shared.errors import InvalidArgument
from shared.kvpool import Row
from shared.protocol import OpenSessionRequest
from tests.cloud.conftest import FakeClock
from tests.cloud.fake_runner import ChunkedPrefill, FakeRunner, FnJob
from tests.cloud.test_paged_serving import record_forwards
from tests.cloud.test_service import k0_request

GREEDY = SamplingConfig(0.0)


def _forward_sizes(prefill_slice: Callable[[int], int] | None = None, **scheduler: Any) -> list[int]:
    """A session's round is answered, then a 100-token prefill runs (budget 256, active for 1 s); the clock
    passes the session's window after the fourth forward. The tokens of each forward."""
    clock = FakeClock(0.0)
    calls: list[list[Row]] = []
    gate = threading.Event()

    def forward(rows: list[Row]) -> list[torch.Tensor]:
        calls.append(rows)
        if len(calls) == 4:  # the round, then three slices: the session has gone quiet since
            clock.advance(2.0)
        return [torch.zeros(r.num_logits, 4) for r in rows]

    runner = FakeRunner(forward)
    if prefill_slice is not None:
        runner.prefill_slice = prefill_slice
    sched = Scheduler(clock, runner, max_batch_tokens=256, active_s=1.0, batch_wait_ms=0, **scheduler)

    async def main() -> None:
        await sched.submit(FnJob(lambda _: Row(9, 4, [3], 1), lambda _, __: 0.0, key="s", kind=ROUND))
        blocker = asyncio.ensure_future(sched.run(gate.wait))
        job = asyncio.ensure_future(sched.submit(ChunkedPrefill(1, 100, owner="o")))
        await asyncio.sleep(0.02)
        gate.set()
        await blocker
        await job

    try:
        asyncio.run(main())
    finally:
        sched.shutdown()
    return [sum(len(r.ids) for r in c) for c in calls]


def test_prefill_only_forwards_take_a_slice_while_a_session_is_active_and_the_budget_after() -> None:
    """Budget 256, slice 16, active for 1 s: a session's round is answered, then a 100-token prefill runs in
    forwards of 16 tokens; once the clock passes the session's window the rest runs in one forward."""
    assert _forward_sizes(max_prefill_tokens_with_rounds=16) == [1, 16, 16, 16, 52]


def test_a_forgotten_session_no_longer_holds_prefills_to_the_slice() -> None:
    """A session that closed (`forget`) is not waited for: the prefill after it takes the whole budget."""
    calls: list[list[Row]] = []

    def forward(rows: list[Row]) -> list[torch.Tensor]:
        calls.append(rows)
        return [torch.zeros(r.num_logits, 4) for r in rows]

    sched = Scheduler(FakeClock(0.0), FakeRunner(forward), max_batch_tokens=256, max_prefill_tokens_with_rounds=16,
                      active_s=1.0, batch_wait_ms=0)

    async def main() -> None:
        await sched.submit(FnJob(lambda _: Row(9, 4, [3], 1), lambda _, __: 0.0, key="s", kind=ROUND))
        sched.forget("s")
        await sched.submit(ChunkedPrefill(1, 100, owner="o"))

    try:
        asyncio.run(main())
    finally:
        sched.shutdown()
    assert [sum(len(r.ids) for r in c) for c in calls] == [1, 100]


@pytest.fixture(scope="module")
def long_prompts(tiny_pair: tuple[Path, Path]) -> list[list[int]]:
    ids = list(AutoTokenizer.from_pretrained(tiny_pair[0]).encode("def main(argv):\n    return argv\n" * 30))
    return [[100 + i] + ids[i: i + 199] for i in range(4)]


def test_opens_behind_an_active_session_run_in_slices_of_prefill(
        make_service: Callable[..., VerifierService], long_prompts: list[list[int]]) -> None:
    """The service with its defaults but a 256-token budget: one session has just been answered, then four
    200-token opens arrive with no round queued; no forward carries more than the 64-token slice."""
    svc = make_service(clock=FakeClock(), max_batch_tokens=256, batch_wait_ms=0)
    short = long_prompts[0][:12]

    async def main() -> None:
        a = (await svc.open_session(OpenSessionRequest(short, GREEDY), "")).ctx_id
        await svc.verify(k0_request(a, short), "", 0)  # answered: the session is active
        forwards = record_forwards(svc)
        await asyncio.gather(*[svc.open_session(OpenSessionRequest(p, GREEDY), "") for p in long_prompts])
        assert len(forwards) >= 4 * 199 // 64
        assert max(b.tokens for b in forwards) <= 64

    asyncio.run(main())


def test_a_session_just_opened_is_active_before_its_first_round(
        make_service: Callable[..., VerifierService], long_prompts: list[list[int]]) -> None:
    """The same burst of four 200-token opens behind a session that has only been opened (no round yet: its
    first round is on its way, bench.sustained's round 0): still no forward carries more than the slice.
    Without the open counting as activity these opens run in whole 256-token forwards."""
    svc = make_service(clock=FakeClock(), max_batch_tokens=256, batch_wait_ms=0)
    short = long_prompts[0][:12]

    async def main() -> None:
        await svc.open_session(OpenSessionRequest(short, GREEDY), "")
        forwards = record_forwards(svc)
        await asyncio.gather(*[svc.open_session(OpenSessionRequest(p, GREEDY), "") for p in long_prompts])
        assert len(forwards) >= 4 * 199 // 64
        assert max(b.tokens for b in forwards) <= 64

    asyncio.run(main())


def test_token_ids_are_checked_whole_and_the_first_bad_one_is_named() -> None:
    check_ids(list(range(1000)), 1000, "prompt_ids")
    for bad, index in (([1, 2, 1000, 3], 2), ([1, True, 2], 1), ([0, -1], 1), ([1, 2.0], 1)):
        with pytest.raises(InvalidArgument, match=rf"prompt_ids\[{index}\]"):
            check_ids(bad, 1000, "prompt_ids")  # type: ignore[arg-type]


def test_the_slice_follows_the_measured_cost_of_prefill() -> None:
    """The scheduler's slice is its model runner's `prefill_slice(running tokens)`, under the token cap: with a
    slice of 8 against a cap of 64, the same 100-token prefill behind an answered round runs in forwards of 8
    tokens while the session is active, then the rest in one forward."""
    asked: list[int] = []

    def slice_of(running: int) -> int:
        asked.append(running)
        return 8

    assert _forward_sizes(max_prefill_tokens_with_rounds=64, prefill_slice=slice_of) == [1, 8, 8, 8, 76]
    assert asked and set(asked) == {0}  # prefill-only forwards while active: no running tokens


def test_the_service_reads_the_slice_from_its_fitted_forward_cost(
        make_service: Callable[..., VerifierService]) -> None:
    """A forward costs 10 ms + 1 ms a row + c a prefill token (fed to the cost fit): the slice is the prefill
    that adds half the rounds' own forward (prefill_share_with_rounds 0.5), capped at 64 tokens and at least
    one KV block (16); the cap alone before the fit has seen 8 forwards."""
    svc = make_service(clock=FakeClock(), prefill_share_with_rounds=0.5, max_prefill_tokens_with_rounds=64,
                       kv_block_size=16)
    core = svc  # the service is its core
    core.budget.cost = type(core.budget.cost)()
    assert core.prefill_slice(4) == 64
    for c_ms, want in ((0.2, 35), (0.05, 64), (2.0, 16)):
        core.budget.cost = type(core.budget.cost)()
        for i in range(40):  # rows and prefill tokens varied so both slopes are identified
            rows, pre = 1 + i % 7, 16 * (i % 5)
            core.budget.cost.observe(rows, pre, (10 + rows + c_ms * pre) / 1000)
        assert abs(core.prefill_slice(4) - want) <= 1, c_ms  # the fit is least squares with a small ridge

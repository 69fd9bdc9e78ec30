"""Admission per API key: opens and generate streams count toward their key's and the server's limits
before any compute, and one key's burst never makes another key's rounds fail. The model thread is
held by a gate while requests arrive, so every refusal is seen before anything ran."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from cloud.service import GenerateRequest, VerifierService
from shared.config import SamplingConfig
from shared.errors import InvalidArgument, ResourceExhausted
from shared.protocol import OpenSessionRequest, VerifyResponse
from tests.cloud.test_service import k0_request

GREEDY = SamplingConfig(0.0)
KEYS = ["key-a", "key-b"]


@pytest.fixture(scope="module")
def prompt(tiny_pair: tuple[Path, Path]) -> list[int]:
    return list(AutoTokenizer.from_pretrained(tiny_pair[0]).encode("import numpy as np\n" * 6))


async def settle(tasks: list[asyncio.Task[Any]]) -> None:
    """Let the event loop run until every task is queued or refused."""
    for _ in range(20):
        await asyncio.sleep(0.005)


def test_one_keys_burst_of_opens_never_refuses_another_keys_rounds(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """Two keys, max_queue_depth 8 (4 per key): key a sends 8 opens at once; 4 wait, 4 are refused at once
    with 429 + Retry-After naming max_queue_depth_per_key. Key b's round and its own open are served."""
    svc = make_service(api_keys=KEYS, max_queue_depth=8)

    async def main() -> None:
        b = (await svc.open_session(OpenSessionRequest(prompt, GREEDY), "b")).ctx_id
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))
        burst = [asyncio.ensure_future(svc.open_session(OpenSessionRequest(prompt, GREEDY, seed=i), "a"))
                 for i in range(8)]
        await settle(burst)
        refused = [t.exception() for t in burst if t.done()]
        assert len(refused) == 4 and all(isinstance(e, ResourceExhausted) for e in refused)
        assert {e.details["limit"] for e in refused if isinstance(e, ResourceExhausted)} == {"max_queue_depth_per_key"}
        assert all(e.retry_after_s == 1 for e in refused if isinstance(e, ResourceExhausted))
        round_b = asyncio.ensure_future(svc.verify(k0_request(b, prompt), "b", 0))
        open_b = asyncio.ensure_future(svc.open_session(OpenSessionRequest(prompt, GREEDY, seed=9), "b"))
        await settle([round_b, open_b])
        assert not round_b.done() and not open_b.done()  # admitted: waiting for the model
        gate.set()
        await blocker
        assert isinstance(await round_b, VerifyResponse)
        await open_b
        await asyncio.gather(*[t for t in burst if not t.done() or t.exception() is None])

    asyncio.run(main())


def test_opens_in_flight_count_as_their_keys_sessions_before_any_prefill(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """max_sessions_per_key = 2, key a holds one session: of three opens sent at once one is admitted and
    two are refused before the model runs anything (429 max_sessions_per_key); likewise max_sessions."""
    # no session counts as active, so a prefill is never sliced into chunks beside one (one row a prefill)
    svc = make_service(max_sessions=3, max_sessions_per_key=2, session_active_ms=0)
    forwards: list[Any] = []
    inner = svc.on_batch
    svc.on_batch = lambda b: (forwards.append(b), inner(b))  # type: ignore[func-returns-value]

    async def main() -> None:
        await svc.open_session(OpenSessionRequest(prompt, GREEDY), "a")
        forwards.clear()
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))
        opens = [asyncio.ensure_future(svc.open_session(OpenSessionRequest(prompt, GREEDY, seed=i), "a"))
                 for i in range(3)]
        other = [asyncio.ensure_future(svc.open_session(OpenSessionRequest(prompt, GREEDY, seed=i), "c"))
                 for i in range(2)]
        await settle(opens + other)
        refused = [t.exception() for t in opens if t.done()]
        assert len(refused) == 2 and all(isinstance(e, ResourceExhausted) and e.details["limit"] ==
                                         "max_sessions_per_key" for e in refused)
        late = [t.exception() for t in other if t.done()]  # 1 open + 1 opening: one more fits the server
        assert len(late) == 1 and isinstance(late[0], ResourceExhausted) and late[0].details["limit"] == "max_sessions"
        gate.set()
        await blocker
        await asyncio.gather(*[t for t in opens + other if not t.done()])
        assert len(svc.store) == 3 and sum(b.rows for b in forwards) == 2  # two prefills ran, for two sessions

    asyncio.run(main())


def test_a_generate_prompt_that_can_never_fit_is_refused_at_once(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """The never-fits check counts whole blocks and the copy-on-write block, for /v1/generate too."""
    svc = make_service()
    block_bytes = svc.model.kv_bytes_per_token * svc.model.pool.block_size
    small = make_service(kv_budget_bytes=block_bytes * 2)  # two blocks: 32 positions with blocks of 16
    fits = prompt[:15]  # 15 positions + its first token: one block, and the copy-on-write one
    over = prompt[:17]  # as many bytes as 17 positions take pass a byte count, not a count of blocks
    assert 17 * svc.model.kv_bytes_per_token <= block_bytes * 2
    with pytest.raises(InvalidArgument) as e:
        small.start_generate(GenerateRequest(over, GREEDY, max_new_tokens=1), "")
    assert e.value.details["reason"] == "exceeds_kv_budget"
    with pytest.raises(InvalidArgument):
        asyncio.run(small.open_session(OpenSessionRequest(over, GREEDY), ""))

    async def generate() -> list[int]:
        return [e.token_id async for e in small.start_generate(GenerateRequest(fits, GREEDY, max_new_tokens=1), "")
                if e.token_id is not None]

    assert len(asyncio.run(generate())) == 1

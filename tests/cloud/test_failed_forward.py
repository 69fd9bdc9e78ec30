"""A forward that fails at any stage leaves every session as it was, copy-on-write included.

The session's round crops into a full block the prefix cache keys (the edge resends the last four tokens
of its prompt as `append_ids`), so the round's plan remaps that block to a private copy. A failure is
injected at each stage of the forward: while planning (after the remap), growing the pool, after the
model wrote its K/V, while committing. Afterwards the session's KV holds what it held before, and its
next rounds give the target's greedy text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from cloud.service import VerifierService
from shared.blocks import BlockManager
from shared.config import SamplingConfig
from shared.hashing import ctx_hash
from shared.kvpool import KVPool
from shared.protocol import OpenSessionRequest, VerifyRequest, VerifyResponse
from tests.cloud.reference import CausalLM
from tests.cloud.test_batching import greedy_continuation
from tests.cloud.test_service import draft_request

GREEDY = SamplingConfig(0.0)


class Injected(RuntimeError):
    """The failure a test injects."""


def fail_after(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> None:
    """`cls.name` runs, then raises."""
    real = getattr(cls, name)

    def broken(self: Any, *args: Any, **kw: Any) -> Any:
        real(self, *args, **kw)
        raise Injected(f"{name} failed")

    monkeypatch.setattr(cls, name, broken)


def fail_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    real = KVPool._fit

    def broken(self: KVPool, capacity: int | None = None) -> None:
        if capacity is not None:  # a forward's growth (start-up sizes the pool without one)
            raise Injected("the pool could not grow")
        real(self, capacity)

    monkeypatch.setattr(KVPool, "_fit", broken)


STAGES: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "plan": lambda mp: fail_after(mp, BlockManager, "prepare_write"),
    "growth": fail_growth,
    "model": lambda mp: fail_after(mp, KVPool, "run"),
    "commit": lambda mp: fail_after(mp, KVPool, "commit"),
}


@pytest.fixture(scope="module")
def prompt(tiny_pair: tuple[Path, Path]) -> list[int]:
    ids = list(AutoTokenizer.from_pretrained(tiny_pair[0]).encode("import numpy as np\n" * 12))
    return ids[:33]  # S[:-1] = 32 positions: two full blocks of 16, both keyed by the prefix cache


def resend_tail(ctx_id: str, ids: list[int], drafts: list[int]) -> VerifyRequest:
    """A round that resends the last four tokens of `ids` (the context is unchanged, the KV is cut at -4)."""
    req = draft_request(ctx_id, ids, drafts, q=1.0)
    req.append_ids = ids[-4:]
    return req


def session_kv(svc: VerifierService, seq_id: int, n: int) -> list[torch.Tensor]:
    pool = svc.model.pool
    rows = torch.tensor(pool.manager.slot_mapping(seq_id, 0, n))
    return [t[:, rows].clone() for t in (*pool.keys, *pool.values)]


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_forward_failing_at_any_stage_leaves_the_session_and_its_next_rounds_exact(
        stage: str, make_service: Callable[..., VerifierService], tiny_reference: CausalLM, prompt: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service()
    truth = greedy_continuation(tiny_reference, prompt, 12)

    async def main() -> None:
        ctx_id = (await svc.open_session(OpenSessionRequest(prompt, GREEDY), "")).ctx_id
        s = svc.store.get(ctx_id, "")
        m = svc.model.pool.manager
        assert s.seq_id is not None and s.kv_len == 32 and m.key_of[m.seqs[s.seq_id].table[1]] is not None
        before = session_kv(svc, s.seq_id, 28)
        with monkeypatch.context() as mp:
            STAGES[stage](mp)
            with pytest.raises(Injected):
                await svc.verify(resend_tail(ctx_id, prompt, truth[:2]), "", 2)
        assert s.context.ids == tuple(prompt)
        assert all(torch.equal(a, b) for a, b in zip(session_kv(svc, s.seq_id, 28), before, strict=True))
        m.check()
        ctx = list(prompt)
        for _ in range(3):  # the next rounds give the target's greedy text
            done = len(ctx) - len(prompt)
            resp = await svc.verify(resend_tail(ctx_id, ctx, truth[done: done + 2]), "", 2)
            assert isinstance(resp, VerifyResponse)
            assert resp.accepted_len == 2 and resp.correction == truth[done + 2]
            ctx += truth[done: done + 3]
            assert resp.ctx_hash == ctx_hash(ctx)

    asyncio.run(main())

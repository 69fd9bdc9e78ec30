"""Batched verification: many sessions' rounds in one forward, answers that do not depend on the batch.

The model thread is held by a gate while rounds queue, so each of them lands in one forward (the
batch-size histogram shows it); answers are compared with greedy decoding of the target without
any cache (tests/cloud/reference.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

import cloud.rounds
from cloud.rest import VerifyBody
from cloud.runners.torch_runner import TargetModel
from cloud.service import GenerateRequest, VerifierService
from shared.config import SamplingConfig
from shared.errors import InvalidArgument, NotFound
from shared.hashing import ctx_hash
from shared.protocol import OpenSessionRequest, VerifyResponse
from shared.sampling import processed_probs
from tests.cloud.reference import CausalLM
from tests.cloud.test_service import draft_request

GREEDY = SamplingConfig(0.0)


def greedy_continuation(ref: CausalLM, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(ref.logits(out, 1)[0].argmax()))
    return out[len(ids):]


def histogram_count(svc: VerifierService, name: str) -> tuple[float, float]:
    """(number of observations, their sum) of a histogram in the service's registry."""
    count = svc.metrics.registry.get_sample_value(f"specsplit_cloud_{name}_count") or 0.0
    total = svc.metrics.registry.get_sample_value(f"specsplit_cloud_{name}_sum") or 0.0
    return count, total


async def gated(svc: VerifierService, calls: list[Any]) -> list[Any]:
    """Hold the model thread until every call is queued, then let them run (as one batch)."""
    gate = threading.Event()
    blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))
    await asyncio.sleep(0.01)
    tasks = [asyncio.ensure_future(c) for c in calls]
    for _ in range(200):  # every call admitted and queued behind the gate
        await asyncio.sleep(0.005)
        if len(svc.scheduler._queue) >= len(calls) + 1:
            break
    gate.set()
    await blocker
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
def prompts(tiny_pair: tuple[Path, Path]) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    texts = ["import os", "def main(argv):\n    return", "class A:\n    x = 1\n    def f(self):\n        pass",
             "for i in range(10):", "x", "# a comment about nothing in particular, rather long\nwhile True:"]
    return [list(tok.encode(t)) for t in texts]


def test_mixed_batch_gives_every_session_the_target_greedy_answer(
        make_service: Callable[..., VerifierService], tiny_reference: CausalLM, prompts: list[list[int]]) -> None:
    """Six sessions (different prompt lengths), different k, some rejecting at position 0, some in the
    middle, some accepting all, over four rounds each, every round of all six in one forward."""
    svc = make_service()
    plans = [  # (k, index of the first wrong draft token; None = all right)
        (4, None), (3, 0), (5, 2), (1, None), (6, 0), (2, 1)]
    truth = [greedy_continuation(tiny_reference, p, 40) for p in prompts]

    async def main() -> None:
        ids = [(await svc.open_session(OpenSessionRequest(p, GREEDY), "")).ctx_id for p in prompts]
        ctx = [list(p) for p in prompts]
        for _ in range(4):
            reqs = []
            for i, (k, wrong) in enumerate(plans):
                done = len(ctx[i]) - len(prompts[i])
                drafts = list(truth[i][done: done + k])
                if wrong is not None:
                    drafts[wrong] = (drafts[wrong] + 1) % 4096
                reqs.append(drafts)
            before = histogram_count(svc, "batch_size")
            answers = await gated(svc, [svc.verify(draft_request(ids[i], ctx[i], reqs[i], q=1.0), "", len(reqs[i]))
                                        for i in range(len(plans))])
            after = histogram_count(svc, "batch_size")
            assert after[0] - before[0] == 1 and after[1] - before[1] == len(plans)  # one forward, all six rows
            for i, (k, wrong) in enumerate(plans):
                resp = answers[i]
                assert isinstance(resp, VerifyResponse), resp
                la = k if wrong is None else wrong
                done = len(ctx[i]) - len(prompts[i])
                assert resp.accepted_len == la
                assert resp.correction == truth[i][done + la]
                ctx[i] += truth[i][done: done + la + 1]
                assert resp.ctx_len == len(ctx[i])

    asyncio.run(main())


def test_a_session_closed_while_queued_gets_404_and_the_batch_goes_on(
        make_service: Callable[..., VerifierService], prompts: list[list[int]]) -> None:
    svc = make_service()

    async def main() -> None:
        a = (await svc.open_session(OpenSessionRequest(prompts[0], GREEDY), "")).ctx_id
        b = (await svc.open_session(OpenSessionRequest(prompts[1], GREEDY), "")).ctx_id

        async def close_then_verify() -> Any:
            task = asyncio.ensure_future(svc.verify(draft_request(a, prompts[0], [1, 2], q=1.0), "", 2))
            await asyncio.sleep(0.02)  # queued behind the gate
            svc.close_session(a, "")
            return await task

        got = await gated(svc, [close_then_verify(), svc.verify(draft_request(b, prompts[1], [1, 2], q=1.0), "", 2)])
        assert isinstance(got[0], NotFound)
        assert isinstance(got[1], VerifyResponse)

    asyncio.run(main())


def test_an_error_in_one_rows_verify_rule_fails_that_request_only(
        make_service: Callable[..., VerifierService], prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service()
    real = cloud.rounds.finish_round

    async def main() -> None:
        a = (await svc.open_session(OpenSessionRequest(prompts[0], GREEDY), "")).ctx_id
        b = (await svc.open_session(OpenSessionRequest(prompts[1], GREEDY), "")).ctx_id
        sa = svc.store.get(a, "")
        before = (sa.context, sa.kv_len, sa.counters.rounds)

        def broken(model: TargetModel, s: Any, *args: Any, **kw: Any) -> Any:
            if s.ctx_id == a:
                raise RuntimeError("bug in one row")
            return real(model, s, *args, **kw)

        monkeypatch.setattr(cloud.rounds, "finish_round", broken)
        got = await gated(svc, [svc.verify(draft_request(a, prompts[0], [1, 2], q=1.0), "", 2),
                                svc.verify(draft_request(b, prompts[1], [1, 2], q=1.0), "", 2)])
        assert isinstance(got[0], RuntimeError) and isinstance(got[1], VerifyResponse)
        assert (sa.context, sa.kv_len, sa.counters.rounds) == before
        monkeypatch.setattr(cloud.rounds, "finish_round", real)
        assert isinstance(await svc.verify(draft_request(a, prompts[0], [1, 2], q=1.0), "", 2), VerifyResponse)

    asyncio.run(main())


def test_a_failed_forward_leaves_every_session_of_the_batch_as_it_was(
        make_service: Callable[..., VerifierService], tiny_reference: CausalLM, prompts: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service()
    real = TargetModel.forward

    def broken(self: TargetModel, rows: list[Any]) -> list[torch.Tensor]:
        real(self, rows)  # the KV is written, then the device fails
        raise RuntimeError("device lost")

    async def main() -> None:
        ids = [(await svc.open_session(OpenSessionRequest(p, GREEDY), "")).ctx_id for p in prompts[:3]]
        sessions = [svc.store.get(i, "") for i in ids]
        before = [(s.context, s.kv_len) for s in sessions]
        monkeypatch.setattr(TargetModel, "forward", broken)
        got = await gated(svc, [svc.verify(draft_request(i, p, [5, 6, 7], q=1.0), "", 3)
                                for i, p in zip(ids, prompts[:3], strict=True)])
        assert all(isinstance(g, RuntimeError) for g in got)
        assert [(s.context, s.kv_len) for s in sessions] == before
        monkeypatch.setattr(TargetModel, "forward", real)
        for i, p in zip(ids, prompts[:3], strict=True):  # and the next round is the target's
            resp = await svc.verify(draft_request(i, p, [], q=1.0), "", 0)
            assert resp.correction == greedy_continuation(tiny_reference, p, 1)[0]

    asyncio.run(main())


def test_a_request_that_fails_its_checks_never_enters_a_batch(
        make_service: Callable[..., VerifierService], prompts: list[list[int]]) -> None:
    svc = make_service()

    async def main() -> None:
        a = (await svc.open_session(OpenSessionRequest(prompts[0], GREEDY), "")).ctx_id
        before = histogram_count(svc, "batch_size")
        with pytest.raises(InvalidArgument):
            await svc.verify(draft_request(a, prompts[0], [1, 2], q=1.0), "", 3)  # k disagrees
        assert histogram_count(svc, "batch_size") == before and svc.admission.depth == 0

    asyncio.run(main())


def test_generate_streams_and_verify_rounds_share_forwards(
        make_service: Callable[..., VerifierService], tiny_reference: CausalLM, prompts: list[list[int]]) -> None:
    """Concurrent /v1/generate streams and verify rounds run in the same forwards, each exact."""
    svc = make_service()

    async def gen(p: list[int]) -> list[int]:
        out = []
        async for e in svc.start_generate(GenerateRequest(p, GREEDY, 0, 8, stop_at_eos=False), ""):
            if e.token_id is not None:
                out.append(e.token_id)
        return out

    async def main() -> None:
        texts = await asyncio.gather(*[gen(p) for p in prompts[:4]])
        for p, t in zip(prompts[:4], texts, strict=True):
            assert t == greedy_continuation(tiny_reference, p, 8)
        n, rows = histogram_count(svc, "batch_size")
        assert rows / n > 1.5  # streams shared forwards

    asyncio.run(main())


def test_max_batch_size_one_runs_one_row_per_forward(make_service: Callable[..., VerifierService],
                                                     prompts: list[list[int]]) -> None:
    svc = make_service(max_batch_size=1)

    async def main() -> None:
        ids = [(await svc.open_session(OpenSessionRequest(p, GREEDY), "")).ctx_id for p in prompts[:3]]
        await gated(svc, [svc.verify(draft_request(i, p, [1], q=1.0), "", 1)
                          for i, p in zip(ids, prompts[:3], strict=True)])
        n, rows = histogram_count(svc, "batch_size")
        assert n == rows  # every forward had one row

    asyncio.run(main())


def test_sampled_rounds_in_one_forward_are_processed_together_as_they_would_be_alone(
        make_service: Callable[..., VerifierService], prompts: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Six sampled sessions with four sampling configs (penalty, top-p, top-k, temperature, greedy with
    a penalty), different k, every round of all six in one forward over three steps: the scheduler
    processes their logits as one tensor operation per config, and each round's p is bit for bit the
    processing of its own logits alone (`processed_probs` over its context and fed drafts)."""
    cfgs = [SamplingConfig(1.0, top_p=0.9, repetition_penalty=1.1), SamplingConfig(0.7),
            SamplingConfig(1.0, top_p=0.9, repetition_penalty=1.1), SamplingConfig(1.2, top_k=8),
            SamplingConfig(0.0, repetition_penalty=1.2), SamplingConfig(0.7)]
    ks = [4, 2, 5, 3, 1, 6]
    real = cloud.rounds.finish_round
    checked: list[int] = []

    def checking(model: TargetModel, s: Any, req: Any, q: Any, plan: Any, logits: torch.Tensor, *args: Any) -> Any:
        *rest, p = args
        fed = req.draft.draft_tokens
        assert p is not None  # processed with the forward's other rows
        assert torch.equal(p.dense_probs(), processed_probs(logits, s.sampling_cfg, plan.new.ids, fed).double())
        checked.append(len(fed))
        return real(model, s, req, q, plan, logits, *rest, p)

    monkeypatch.setattr(cloud.rounds, "finish_round", checking)
    svc = make_service()

    async def main() -> None:
        ids = [(await svc.open_session(OpenSessionRequest(p, c, seed=i), "")).ctx_id
               for i, (p, c) in enumerate(zip(prompts, cfgs, strict=True))]
        ctx = [list(p) for p in prompts]
        held = [len(p) for p in prompts]  # what the cloud holds of ctx (an edge-drawn token is sent next)
        for step in range(3):
            drafts = [[(7 * i + j + step) % 50 + 3 for j in range(k)] for i, k in enumerate(ks)]
            before = histogram_count(svc, "batch_size")
            answers = await gated(svc, [
                svc.verify(VerifyBody(ctx_id=ids[i], ctx_len=len(ctx[i]), ctx_hash=ctx_hash(ctx[i]),
                                      append_ids=ctx[i][held[i]:], draft_tokens=drafts[i],
                                      q_token_probs=[0.3] * ks[i], k=ks[i]).to_request(), "", ks[i])
                for i in range(len(ks))])
            after = histogram_count(svc, "batch_size")
            assert after[0] - before[0] == 1 and after[1] - before[1] == len(ks)  # one forward, all six rows
            for i, r in enumerate(answers):
                assert isinstance(r, VerifyResponse), r
                ctx[i] += drafts[i][: r.accepted_len]
                held[i] = len(ctx[i])
                if r.correction is not None:
                    ctx[i].append(r.correction)
                    held[i] += 1
                elif r.target_dist is not None:  # the edge's residual draw: any token of its support
                    ctx[i].append(r.target_dist.ids[0])

    asyncio.run(main())
    assert checked == ks * 3

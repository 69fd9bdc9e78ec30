"""The verify round on a real (tiny) target with a KV cache, against a cache-free reference."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from cloud.engine import (
    RoundLimits,
    RoundResult,
    check_request,
    fingerprint,
    finish_round,
    plan_round,
)
from cloud.prefill import Prefill
from cloud.rest import VerifyBody
from cloud.runners.torch_runner import TargetModel
from cloud.session import Context, Session
from shared.config import SamplingConfig
from shared.errors import ContextMismatch, InvalidArgument, SpecSplitError
from tests.cloud.reference import CausalLM, Drafter, EdgeSim, assert_matches

MODES = {
    # name: (sampling config, edge mode, correction)
    "strict-scalar": (SamplingConfig(1.0, 0.9, 0, 1.1), "scalar", "strict"),
    "strict-q_dists": (SamplingConfig(0.8, 1.0, 40, 1.0), "q_dists", "strict"),
    "deterministic": (SamplingConfig(1.0, 0.95, 0, 1.0), "deterministic", "strict"),
    "shortcut": (SamplingConfig(1.0, 0.9, 0, 1.1), "scalar", "shortcut"),
    "greedy": (SamplingConfig(0.0, 1.0, 0, 1.0), "scalar", "strict"),
}


@pytest.fixture(scope="module")
def prompt(tiny_pair: tuple[Path, Path]) -> list[int]:
    return list(AutoTokenizer.from_pretrained(tiny_pair[0]).encode("def fibonacci(n):\n    return"))


def open_session(model: TargetModel, prompt: list[int], cfg: SamplingConfig, seed: int,
                 correction: str = "strict") -> Session:
    """A session whose sequence holds the KV of prompt[:-1], prefilled in chunks of 4 tokens."""
    pre = Prefill(prompt[:-1], chunk=4)
    while (row := pre.plan(model.pool)) is not None:
        model.forward([row])
        if pre.advance(model.pool):
            break
    return Session(ctx_id=f"s{seed}-{correction}", owner="", sampling_cfg=cfg, seed=seed, correction=correction,
                   max_new_tokens=0, prompt_len=len(prompt), context=Context.of(prompt), seq_id=pre.seq_id,
                   kv_bytes_per_token=model.kv_bytes_per_token, last_used=0.0, created=0.0, kv_len=pre.done)


def run_round(model: TargetModel, s: Session, req: Any, q: torch.Tensor | None) -> RoundResult:
    """One round alone: plan, forward, finish (the scheduler does the same with other rows beside it);
    a failure crops the KV back like the scheduler's abort."""
    plan = plan_round(s, req, fingerprint(req))
    if not hasattr(plan, "row"):
        return RoundResult(plan, None, replayed=True)  # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        (logits,) = model.forward([plan.row])  # type: ignore[union-attr]
        return finish_round(model, s, req, q, plan, logits, (time.monotonic() - t0) * 1000, replay_keep=8)  # type: ignore[arg-type]
    except BaseException:
        s.set_kv_len(model.pool, min(s.kv_len, plan.num_cached_tokens))  # type: ignore[union-attr]
        raise


def do_round(model: TargetModel, s: Session, body: dict[str, Any]) -> dict[str, Any]:
    # a negative append id and a ctx_len of 0 are refused by the REST schema itself: parsed as valid values, then
    # set back, so the engine's own checks are what meets them (and must leave the session unchanged)
    sent = list(body.get("append_ids") or [])
    req = VerifyBody(**{**body, "append_ids": [max(0, int(x)) for x in sent],
                        "ctx_len": max(1, int(body["ctx_len"]))}).to_request()
    req.append_ids, req.ctx_len = sent, int(body["ctx_len"])
    lim = RoundLimits(max_k=16, max_return_top_k=8, max_context=model.info.max_context,
                      vocab_size=model.info.vocab_size)
    q = check_request(req, body["k"], lim, s.sampling_cfg, None)
    with torch.inference_mode():
        res = run_round(model, s, req, q)
    if res.replayed:
        s.counters.replayed += 1
    return asdict(res.response)


def state(s: Session) -> tuple:
    return s.context, s.kv_len, s.counters.rounds


@pytest.mark.parametrize("mode", list(MODES))
def test_rounds_match_the_cache_free_reference(mode: str, tiny_target: TargetModel, tiny_reference: CausalLM,
                                               tiny_drafter: Drafter, prompt: list[int]) -> None:
    cfg, edge_mode, correction = MODES[mode]
    s = open_session(tiny_target, prompt, cfg, seed=11, correction=correction)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=11, mode=edge_mode)
    kinds = set()
    for r in range(8):
        body, draft = edge.request(s.ctx_id, k=1 + r % 4)
        ref = edge.reference(tiny_reference, draft, correction)
        resp = do_round(tiny_target, s, body)
        assert_matches(resp, ref, len(edge.ids))
        edge.apply(resp, draft)
        kinds.add(resp["next_kind"])
        # the cache holds S minus the token not yet fed (correction/bonus), or all of S (residual)
        assert s.kv_len == len(s.context) - (resp["next_kind"] != "residual")
    assert s.context.ids == tuple(edge.ids[: len(edge.ids) - len(edge.pending)])
    if mode == "strict-scalar":
        assert "residual" in kinds
    else:
        assert "residual" not in kinds


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0, 0.9, 0, 1.1), SamplingConfig(0.0)], ids=["sampled", "greedy"])
def test_target_as_its_own_drafter_accepts_every_token(cfg: SamplingConfig, tiny_pair: tuple[Path, Path],
                                                        tiny_target: TargetModel, prompt: list[int]) -> None:
    """p = q when the draft is the target: any misaligned KV position would show as a rejection."""
    s = open_session(tiny_target, prompt, cfg, seed=3)
    edge = EdgeSim(Drafter(tiny_pair[0]), prompt, cfg, seed=3)
    for _ in range(4):
        body, draft = edge.request(s.ctx_id, k=5)
        resp = do_round(tiny_target, s, body)
        assert (resp["accepted_len"], resp["next_kind"]) == (5, "bonus")
        assert resp["metrics"]["alpha_mean"] == pytest.approx(1.0, abs=1e-5)
        edge.apply(resp, draft)


def test_retry_is_idempotent(tiny_target: TargetModel, tiny_drafter: Drafter, prompt: list[int]) -> None:
    """The same request twice (no request_id: recomputed by crop-then-append) gives the same answer
    and the same context and cache length."""
    cfg = SamplingConfig(1.0, 0.9, 0, 1.1)
    s = open_session(tiny_target, prompt, cfg, seed=5)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=5)
    for _ in range(3):
        body, draft = edge.request(s.ctx_id, k=4)
        body["request_id"] = ""
        first = do_round(tiny_target, s, body)
        after_first = (s.context, s.kv_len)
        again = do_round(tiny_target, s, body)
        for r in (first, again):
            r["metrics"].pop("prefill_ms")
        assert again == first and (s.context, s.kv_len) == after_first
        edge.apply(first, draft)
    assert s.counters.replayed == 0 and s.counters.rounds == 6


def test_late_duplicate_is_answered_from_the_replay_cache_without_rollback(
        tiny_target: TargetModel, tiny_drafter: Drafter, prompt: list[int]) -> None:
    cfg = SamplingConfig(1.0, 0.9, 0, 1.1)
    s = open_session(tiny_target, prompt, cfg, seed=6)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=6)
    body1, d1 = edge.request(s.ctx_id, k=3)
    r1 = do_round(tiny_target, s, body1)
    edge.apply(r1, d1)
    body2, d2 = edge.request(s.ctx_id, k=3)
    r2 = do_round(tiny_target, s, body2)
    edge.apply(r2, d2)
    after_two = state(s)
    assert do_round(tiny_target, s, body1) == r1  # the late copy of round 1
    assert state(s) == after_two and s.counters.replayed == 1
    assert do_round(tiny_target, s, body2) == r2  # an immediate retry of round 2
    assert state(s) == after_two and s.counters.replayed == 2


def test_late_duplicate_without_request_id_recomputes_and_rolls_back(
        tiny_target: TargetModel, tiny_drafter: Drafter, prompt: list[int]) -> None:
    """Without a request_id there is no cache: crop-then-append reapplies round 1, and round 2
    replayed afterwards restores the same state (the rollback is recoverable and deterministic)."""
    cfg = SamplingConfig(1.0, 0.9, 0, 1.1)
    s = open_session(tiny_target, prompt, cfg, seed=6)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=6)
    bodies, resps, states = [], [], []
    for _ in range(2):
        body, draft = edge.request(s.ctx_id, k=3)
        body["request_id"] = ""
        resps.append(do_round(tiny_target, s, body))
        edge.apply(resps[-1], draft)
        bodies.append(body)
        states.append((s.context, s.kv_len))
    again1 = do_round(tiny_target, s, bodies[0])
    assert (again1["ctx_len"], again1["ctx_hash"]) == (resps[0]["ctx_len"], resps[0]["ctx_hash"])
    assert (s.context, s.kv_len) == states[0]
    again2 = do_round(tiny_target, s, bodies[1])
    assert (again2["accepted_len"], again2["correction"], again2["ctx_hash"]) == \
        (resps[1]["accepted_len"], resps[1]["correction"], resps[1]["ctx_hash"])
    assert (s.context, s.kv_len) == states[1]


def test_rolling_back_to_the_prompt_continues_like_a_fresh_session(
        tiny_target: TargetModel, tiny_drafter: Drafter, prompt: list[int]) -> None:
    cfg = SamplingConfig(0.9, 1.0, 0, 1.0)
    used = open_session(tiny_target, prompt, cfg, seed=8)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=8, mode="q_dists")
    for _ in range(3):
        body, draft = edge.request(used.ctx_id, k=3)
        edge.apply(do_round(tiny_target, used, body), draft)
    fresh = open_session(tiny_target, prompt, cfg, seed=8)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=8, mode="q_dists")  # the edge starts over
    for _ in range(3):
        body, draft = edge.request(fresh.ctx_id, k=4)
        a = do_round(tiny_target, fresh, body)
        b = do_round(tiny_target, used, {**body, "ctx_id": used.ctx_id})
        for r in (a, b):
            r["metrics"].pop("prefill_ms")
        assert a == b
        edge.apply(a, draft)
    assert fresh.context == used.context and fresh.kv_len == used.kv_len


def test_rejected_requests_leave_the_session_unchanged(tiny_target: TargetModel, tiny_drafter: Drafter,
                                                       prompt: list[int]) -> None:
    cfg = SamplingConfig(1.0, 0.9, 0, 1.1)
    s = open_session(tiny_target, prompt, cfg, seed=9)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=9)
    body, draft = edge.request(s.ctx_id, k=3)
    edge.apply(do_round(tiny_target, s, body), draft)
    good, _ = edge.request(s.ctx_id, k=3)
    before = state(s)
    vocab = tiny_target.info.vocab_size
    bad_cases: dict[str, tuple[dict[str, Any], type[SpecSplitError]]] = {
        "hash": ({"ctx_hash": "0" * 16}, ContextMismatch),
        "ahead": ({"ctx_len": good["ctx_len"] + 5, "append_ids": []}, ContextMismatch),
        "k": ({"k": 2}, InvalidArgument),
        "len_q": ({"q_token_probs": good["q_token_probs"][:-1]}, InvalidArgument),
        "q_zero": ({"q_token_probs": [0.0] * 3}, InvalidArgument),
        "q_nan": ({"q_token_probs": [float("nan")] * 3}, InvalidArgument),
        "id": ({"draft_tokens": [vocab, 1, 2]}, InvalidArgument),
        "append_id": ({"append_ids": [-1] + good["append_ids"][1:]}, InvalidArgument)
        if good["append_ids"] else ({"append_ids": [], "ctx_len": 0}, InvalidArgument),
        "k_limit": ({"draft_tokens": [1] * 17, "q_token_probs": [0.5] * 17, "k": 17}, InvalidArgument),
    }
    for name, (patch, err) in bad_cases.items():
        with pytest.raises(err) as e:
            do_round(tiny_target, s, {**good, **patch})
        assert state(s) == before, name
        if err is ContextMismatch:
            assert e.value.details["expected_ctx_len"] == len(s.context)
    edge_resp = do_round(tiny_target, s, good)  # and the good request still works
    assert edge_resp["ctx_len"] >= good["ctx_len"]


def test_failed_forward_keeps_context_and_a_usable_cache(tiny_target: TargetModel, tiny_reference: CausalLM,
                                                         tiny_drafter: Drafter, prompt: list[int],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SamplingConfig(1.0, 1.0, 0, 1.0)
    s = open_session(tiny_target, prompt, cfg, seed=4)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=4, mode="q_dists")
    body, draft = edge.request(s.ctx_id, k=3)
    ctx_before = s.context
    real = TargetModel.forward

    def broken(self: TargetModel, rows: list[Any]) -> list[torch.Tensor]:
        real(self, rows)  # the KV is written, then the "device" fails
        raise RuntimeError("device lost")

    monkeypatch.setattr(TargetModel, "forward", broken)
    with pytest.raises(RuntimeError):
        do_round(tiny_target, s, body)
    monkeypatch.setattr(TargetModel, "forward", real)
    assert s.context == ctx_before and s.kv_len <= len(s.context)
    resp = do_round(tiny_target, s, body)
    assert_matches(resp, edge.reference(tiny_reference, draft, "strict"), len(edge.ids))


def test_return_top_k_gives_the_targets_top_ids_per_checked_position(
        tiny_target: TargetModel, tiny_reference: CausalLM, tiny_drafter: Drafter, prompt: list[int]) -> None:
    cfg = SamplingConfig(1.0, 1.0, 0, 1.0)
    s = open_session(tiny_target, prompt, cfg, seed=2)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=2, mode="q_dists")
    body, draft = edge.request(s.ctx_id, k=3)
    resp = do_round(tiny_target, s, {**body, "return_top_k": 4})
    logits = tiny_reference.logits(edge.ids + draft.tokens, 4)  # [k + 1, vocab]
    la = resp["accepted_len"]
    assert resp["top_k_ids"] == logits[: la + 1].topk(4, dim=-1).indices.tolist()


def test_bfloat16_target_runs_rounds_with_half_the_kv_bytes(tiny_pair: tuple[Path, Path], tiny_target: TargetModel,
                                                            tiny_drafter: Drafter, prompt: list[int]) -> None:
    half = TargetModel(tiny_pair[0], dtype="bfloat16")
    assert half.kv_bytes_per_token * 2 == tiny_target.kv_bytes_per_token
    cfg = SamplingConfig(1.0, 0.9, 0, 1.1)
    s = open_session(half, prompt, cfg, seed=12)
    edge = EdgeSim(tiny_drafter, prompt, cfg, seed=12)
    for _ in range(3):
        body, draft = edge.request(s.ctx_id, k=3)
        resp = do_round(half, s, body)
        edge.apply(resp, draft)
        assert s.kv_len == len(s.context) - (resp["next_kind"] != "residual")
    assert half.info.dtype == "bfloat16"

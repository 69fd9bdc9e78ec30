"""Model drafter: KV state by position, q from the shared processing, seeded draws, gating signals."""

from __future__ import annotations

import math

import pytest
import torch

from edge.drafters import ModelDrafter
from shared.config import SamplingConfig
from shared.sampling import processed_probs

CFG = SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.1)


def reference_q(d: ModelDrafter, context: list[int], drafts: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """Processed q for every draft position from one uncached forward ([k, vocab])."""
    with torch.no_grad():
        logits = d.model(input_ids=torch.tensor([context + drafts])).logits[0]  # [n, vocab]
    rows = logits[len(context) - 1: len(context) - 1 + len(drafts)]  # [k, vocab]
    return processed_probs(rows, cfg, context, drafts[:-1])[: len(drafts)]


def spy_feeds(d: ModelDrafter, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    fed: list[list[int]] = []
    real = d._feed

    def feed(tokens):  # type: ignore[no-untyped-def]
        fed.append(list(tokens))
        return real(tokens)

    monkeypatch.setattr(d, "_feed", feed)
    return fed


def test_q_matches_an_uncached_forward_with_the_shared_processing(model_drafter: ModelDrafter) -> None:
    ctx = [5, 17, 300, 17, 42]
    block = model_drafter.propose(ctx, k=4, cfg=CFG, seed=3)
    ref = reference_q(model_drafter, ctx, block.tokens, CFG)
    assert torch.allclose(torch.stack(block.q_full), ref.double(), atol=1e-5)
    assert block.q_probs == [float(q[y]) for q, y in zip(block.q_full, block.tokens, strict=True)]
    assert all(q > 0 for q in block.q_probs) and block.kind == "sampled"


def test_all_accepted_round_fills_in_the_last_draft_token_kv(model_drafter: ModelDrafter,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = [5, 17, 300]
    block = model_drafter.propose(ctx, k=3, cfg=CFG, seed=1)
    assert model_drafter.kv_len == len(ctx) + 2  # y_3 drawn, never fed
    fed = spy_feeds(model_drafter, monkeypatch)
    ctx2 = ctx + block.tokens + [77]  # all accepted + bonus
    block2 = model_drafter.propose(ctx2, k=2, cfg=CFG, seed=1)
    assert fed[0] == [block.tokens[-1], 77]
    ref = reference_q(model_drafter, ctx2, block2.tokens, CFG)
    assert torch.allclose(torch.stack(block2.q_full), ref.double(), atol=1e-5)


def test_rejection_crops_the_cache_to_the_accepted_prefix(model_drafter: ModelDrafter,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = [9, 8, 7, 6]
    block = model_drafter.propose(ctx, k=4, cfg=CFG, seed=2)
    fed = spy_feeds(model_drafter, monkeypatch)
    ctx2 = ctx + block.tokens[:1] + [123]  # y_1 accepted, correction 123
    block2 = model_drafter.propose(ctx2, k=3, cfg=CFG, seed=2)
    assert fed[0] == [123]
    assert model_drafter._ids == ctx2 + block2.tokens[:-1]
    assert model_drafter.kv_len == len(ctx2) + 2
    ref = reference_q(model_drafter, ctx2, block2.tokens, CFG)
    assert torch.allclose(torch.stack(block2.q_full), ref.double(), atol=1e-5)


def test_local_commits_and_reopen_feed_everything_new(model_drafter: ModelDrafter,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = [1, 2, 3]
    model_drafter.propose(ctx, k=2, cfg=CFG, seed=0)
    fed = spy_feeds(model_drafter, monkeypatch)
    model_drafter.propose([1, 2, 3, 40, 41, 42, 43], k=1, cfg=CFG, seed=0)  # cache held [1,2,3,y1]
    assert fed[0][-3:] == [41, 42, 43] and len(fed[0]) in (3, 4)
    model_drafter.propose([1, 2, 3], k=1, cfg=CFG, seed=0)  # shorter context: crop and refeed the last token
    assert fed[-1] == [3]


def test_greedy_drafts_are_the_draft_models_argmax_chain(model_drafter: ModelDrafter) -> None:
    greedy = SamplingConfig(temperature=0, repetition_penalty=1.2)
    ctx = [11, 22, 33, 22]
    block = model_drafter.propose(ctx, k=5, cfg=greedy, seed=0)
    ref = reference_q(model_drafter, ctx, block.tokens, greedy)
    assert block.tokens == ref.argmax(-1).tolist()
    assert block.q_probs == [1.0] * 5


def test_sampled_drafts_depend_only_on_seed_and_position(model_drafter: ModelDrafter) -> None:
    ctx = [100, 200, 300]
    a = model_drafter.propose(ctx, k=6, cfg=SamplingConfig(), seed=7).tokens
    model_drafter.propose([4, 4, 4, 4], k=3, cfg=SamplingConfig(), seed=7)  # unrelated state in between
    b = model_drafter.propose(ctx, k=6, cfg=SamplingConfig(), seed=7).tokens
    c = model_drafter.propose(ctx, k=6, cfg=SamplingConfig(), seed=8).tokens
    assert a == b and a != c


def test_gating_signals_come_from_the_raw_distribution(model_drafter: ModelDrafter) -> None:
    ctx = [3, 1, 4, 1, 5]
    block = model_drafter.propose(ctx, k=1, cfg=SamplingConfig(temperature=0), seed=0)
    with torch.no_grad():
        p = torch.softmax(model_drafter.model(input_ids=torch.tensor([ctx])).logits[0, -1], -1)  # [vocab]
    y = block.tokens[0]
    assert block.nll is not None and block.entropy_bits is not None and block.margin is not None
    assert block.nll[0] == pytest.approx(-math.log(float(p[y])), rel=1e-4)
    assert block.entropy_bits[0] == pytest.approx(float(-(p * p.log2()).sum()), rel=1e-4)
    top = torch.topk(p, 2).values
    assert block.margin[0] == pytest.approx(float(top[0] - top[1]), abs=1e-6)
    assert block.mc_var is None  # the tiny model has no dropout


def test_k_zero_proposes_nothing(model_drafter: ModelDrafter) -> None:
    assert model_drafter.propose([1, 2], k=0, cfg=CFG, seed=0).tokens == []


def test_the_draft_dtype_is_auto_by_default_and_follows_the_cpus_bfloat16_units(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Unset (the suite pins SPECSPLIT_EDGE_DRAFT_DTYPE), the edge drafts in "auto": bfloat16 where /proc/cpuinfo
    lists a bfloat16 unit, float32 where it lists none."""
    from edge.settings import EdgeSettings
    from shared.dtypes import resolve_dtype

    monkeypatch.delenv("SPECSPLIT_EDGE_DRAFT_DTYPE", raising=False)
    assert EdgeSettings().draft_dtype == "auto"
    with_units, without = tmp_path / "with", tmp_path / "without"
    with_units.write_text("processor : 0\nflags : fpu sse2 avx512f avx512_bf16\n")
    without.write_text("processor : 0\nflags : fpu sse2 avx2\n")
    assert resolve_dtype("auto", "cpu", with_units)[0] == "bfloat16"
    assert resolve_dtype("auto", "cpu", without)[0] == "float32"


def test_a_bfloat16_draft_keeps_its_q_equal_to_its_own_uncached_forward(tiny_pair) -> None:  # type: ignore[no-untyped-def]
    """q in bfloat16 is what that model computes (the cloud's rule reads it as sent): the cached drafts' q equal
    an uncached bfloat16 forward's processed probabilities to bfloat16 tolerance."""
    d = ModelDrafter(tiny_pair[1], dtype=torch.bfloat16)
    assert d.model.dtype == torch.bfloat16
    ctx = [5, 17, 300, 17, 42]
    block = d.propose(ctx, k=4, cfg=CFG, seed=3)
    ref = reference_q(d, ctx, block.tokens, CFG)
    assert block.q_probs == [float(q[y]) for q, y in zip(block.q_full, block.tokens, strict=True)]
    assert torch.allclose(torch.stack(block.q_full), ref.double(), atol=2e-2)

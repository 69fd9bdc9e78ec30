"""The verify rule on the device (shared/target_probs.py): a forward's rows processed together, with their draws
and scored probabilities computed ahead in one batched pass, decide every round exactly as the reference (each
round's p processed alone, dense, on the host); greedy rows cross one number a position; the check has power
(a pass drawing with the wrong uniform stream is caught).

Equality, not a statistic: 400 forwards' worth of rounds (seeded; chains and trees, greedy and sampled, strict,
shortcut, deterministic drafts, q_dists, check_last, repetition penalty, top-p with ties) must give outcomes equal
field for field, bit for bit. The same runs on a GPU where one is present (the device's float64 prefix sums, with
the margin rule of the module docstring).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import shared.sampling as sampling
from shared.config import SamplingConfig
from shared.rng import SAMPLE, position_uniform, sample_index
from shared.sampling import RowSampling, process_rows, processed_probs
from shared.target_probs import TRANSFERS, TargetProbs, draws
from shared.tree import depths, verify_tree
from shared.verify import VerifyOutcome, verify_round

V = 97
CFGS = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0),
        SamplingConfig(0.7, top_p=0.9, repetition_penalty=1.1), SamplingConfig(0.0, repetition_penalty=1.3),
        SamplingConfig(1.3, top_p=0.5, top_k=20)]


def _round(rng: random.Random, g: torch.Generator, device: str) -> dict[str, Any]:
    """One random round: its logits, RowSampling (with the draws and scores its rule will ask) and verify args."""
    cfg = rng.choice(CFGS)
    k = rng.randint(1, 6)
    tree = None if rng.random() < 0.6 else [-1] + [rng.randrange(-1, j) for j in range(k - 1)]
    check_last = tree is None and rng.random() < 0.25
    drafts = [rng.randrange(V) for _ in range(k)]
    if tree is not None:  # siblings carry distinct tokens
        seen: set[tuple[int, int]] = set()
        for j, par in enumerate(tree):
            while (par, drafts[j]) in seen:
                drafts[j] = rng.randrange(V)
            seen.add((par, drafts[j]))
    mode = rng.choice(["strict", "shortcut", "deterministic", "q_dists"]) if tree is None else \
        rng.choice(["strict", "shortcut"])
    q = [1.0] * k if mode == "deterministic" else [rng.uniform(0.05, 1.0) for _ in range(k)]
    fed = k - 1 if check_last else k
    # quarter-step logits: ties at top-p's boundary; a high draft sometimes, so rounds get accepted too
    logits = (torch.randn(fed + 1, V, generator=g) * 12).round() / 4  # [fed + 1, V]
    for i, y in enumerate(drafts[: fed + 1]):
        if rng.random() < 0.5:
            logits[i if tree is None else tree[i] + 1, y] += 6.0
    context = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
    L, seed = len(context) + 1, rng.randrange(2**64)
    if tree is None:
        positions = [L + i + 1 for i in range(fed + 1)]
        scored = [(i, y) for i, y in enumerate(drafts[: fed + 1])]
    else:
        positions = [L + 1] + [L + d + 1 for d in depths(tree)]
        scored = [(par + 1, y) for par, y in zip(tree, drafts, strict=True)]
    q_dists = None
    if mode == "q_dists":  # a draft distribution that agrees with q at the drafts
        q_dists = torch.zeros(k, V, dtype=torch.float64)
        for i, (y, qi) in enumerate(zip(drafts, q, strict=True)):
            q_dists[i] = (1 - qi) / (V - 1)
            q_dists[i, y] = qi
    return {"logits": logits.to(device), "spec": RowSampling(cfg, context, drafts[:fed], tree, seed=seed,
                                                             positions=positions, scored=scored),
            "drafts": drafts, "q": q, "tree": tree, "check_last": check_last, "mode": mode, "q_dists": q_dists,
            "L": L, "seed": seed, "cfg": cfg}


def _verify(r: dict[str, Any], p: torch.Tensor | TargetProbs) -> Any:
    kw: dict[str, Any] = {"seed": r["seed"], "ctx_len": r["L"], "greedy": r["cfg"].greedy}
    if r["tree"] is not None:
        return verify_tree(p, r["drafts"], r["tree"], r["q"], correction=r["mode"], **kw)
    extra: dict[str, Any] = {"check_last": r["check_last"]}
    if r["mode"] == "shortcut":
        extra["correction"] = "shortcut"
    elif r["mode"] == "deterministic":
        extra["draft_kind"] = "deterministic"
    elif r["mode"] == "q_dists":
        extra["q_dists"] = r["q_dists"]
    return verify_round(p, r["drafts"], r["q"], **kw, **extra)


def _fields(out: Any) -> tuple[Any, ...]:
    if isinstance(out, VerifyOutcome):
        ids = None if out.target_ids is None else out.target_ids.tolist()
        probs = None if out.target_probs is None else out.target_probs.tolist()
        return out.accepted_len, out.next_token, out.next_kind, ids, probs, out.alphas
    return tuple(out.path), out.next_token, out.next_kind, out.alphas


def _mismatches(device: str, forwards: int = 400) -> int:
    """Rounds whose device-pass outcome differs from the reference's, over `forwards` forwards of 1-8 rounds.
    The device pass must have answered from its batched results (not only from the rows themselves)."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    bad = 0
    ahead = TRANSFERS.ahead
    for _ in range(forwards):
        rounds = [_round(rng, g, device) for _ in range(rng.randint(1, 8))]
        got = process_rows([r["logits"] for r in rounds], [r["spec"] for r in rounds], ahead=True)
        for r, probs in zip(rounds, got, strict=True):
            s = r["spec"]
            ref = processed_probs(r["logits"], s.cfg, s.context_ids, s.draft_ids, s.parents).cpu().double()
            assert probs is not None
            bad += _fields(_verify(r, probs)) != _fields(_verify(r, ref))
    assert TRANSFERS.ahead - ahead > 2 * forwards
    return bad


def test_device_pass_decides_every_round_as_the_reference() -> None:
    assert _mismatches("cpu") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU's prefix sums are unchecked")
def test_device_pass_on_a_gpu_decides_every_round_as_the_reference() -> None:
    assert _mismatches("cuda") == 0


def test_a_biased_batched_draw_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Power: the same comparison, with the batched pass drawing the most likely token instead of inverse-CDF
    (a known bias towards the mode), finds differences."""

    def mode(p: torch.Tensor, u: torch.Tensor, margin: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return p.argmax(-1), torch.ones(p.shape[0], dtype=torch.bool, device=p.device)

    monkeypatch.setattr(sampling, "draws", mode)
    assert _mismatches("cpu", forwards=100) > 10


def test_draws_equal_sample_index_and_the_margin_refuses_a_boundary() -> None:
    """`draws` (with the margin rule a GPU uses, forced here) against `sample_index` on 2,000 rows; a uniform
    whose target lands on a prefix sum exactly is not called sure."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2000, 500, generator=g) * 3, -1)  # [2000, 500] float32
    p[::7, 100:] = 0.0  # zero-mass tails
    u = torch.rand(2000, generator=g, dtype=torch.float64)
    for margin in (False, True):
        idx, sure = draws(p, u, margin=margin)
        assert idx.tolist() == [sample_index(p[i], float(u[i])) for i in range(2000)]
        assert int(sure.sum()) >= 1995
    row = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    _, sure = draws(row, torch.tensor([0.5], dtype=torch.float64), margin=True)  # 0.5 x 1.0 sits on cdf[1]
    assert not bool(sure[0])
    assert sample_index(row[0], 0.5) == 2


def test_greedy_rows_cross_one_number_a_position() -> None:
    """64 greedy verify rows of 8 positions over a 151,936-token vocabulary: one read of 512 numbers, no row of p;
    sampled rows with their draws ahead: a number a position, two a draw, one a score, whatever the vocabulary."""
    vocab, rows, n = 151_936, 64, 8
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(n, vocab, generator=g) for _ in range(rows)]  # [n, vocab] each
    greedy = RowSampling(SamplingConfig(temperature=0.0), [1, 2, 3], list(range(n - 1)), seed=5,
                         positions=list(range(10, 10 + n)), scored=[(i, i) for i in range(n - 1)])
    before = (TRANSFERS.values, TRANSFERS.reads)
    got = process_rows(logits, [greedy] * rows, ahead=True)
    assert (TRANSFERS.values - before[0], TRANSFERS.reads - before[1]) == (rows * n, 1)
    assert all(x is not None and x.p is None for x in got)
    out = verify_round(got[0], list(range(n - 1)), [1.0] * (n - 1), seed=5, ctx_len=9, greedy=True)  # type: ignore[arg-type]
    assert (TRANSFERS.values - before[0], TRANSFERS.reads - before[1]) == (rows * n, 1)
    assert out.next_token == int(logits[0][out.accepted_len].argmax())
    sampled = RowSampling(SamplingConfig(temperature=1.0), [1, 2, 3], list(range(n - 1)), seed=5,
                          positions=list(range(10, 10 + n)), scored=[(i, i) for i in range(n - 1)])
    before = (TRANSFERS.values, TRANSFERS.reads)
    process_rows(logits[:4], [sampled] * 4, ahead=True)
    assert (TRANSFERS.values - before[0], TRANSFERS.reads - before[1]) == (4 * (n + 2 * n + (n - 1)), 1)


def test_a_draw_the_pass_was_not_sure_of_is_the_references() -> None:
    """A precomputed draw dropped (as the margin rule drops one on a GPU) is drawn again from the row itself."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, V, generator=g)
    spec = RowSampling(SamplingConfig(temperature=1.0), [4], [7, 8], seed=11, positions=[3, 4, 5])
    probs = process_rows([logits], [spec], ahead=True)[0]
    assert probs is not None and len(probs.drawn) == 3
    u = position_uniform(11, 4, SAMPLE)
    want = probs.draw(1, u)
    probs.drawn.clear()
    assert probs.draw(1, u) == want == sample_index(processed_probs(logits, spec.cfg, [4], [7, 8])[1].double(), u)

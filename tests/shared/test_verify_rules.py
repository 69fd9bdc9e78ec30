"""The deterministic rules of shared.verify: greedy, seeded replay, input validation, the
degenerate residual, and the alphas it reports."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shared.errors import InvalidArgument
from shared.rng import SAMPLE, position_uniform, sample_index
from shared.verify import VerifyOutcome, check_draft, dense_from_sparse, sample_residual, verify_round

V = 10
K = 4


def _probs(seed: int, rows: int, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(rows, vocab, generator=g, dtype=torch.float64), -1)  # [rows, vocab]


def _same(a: VerifyOutcome, b: VerifyOutcome) -> bool:
    tensors_equal = all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a.target_ids, b.target_ids), (a.target_probs, b.target_probs)))
    return (a.accepted_len, a.next_token, a.next_kind, a.alphas) == (
        b.accepted_len, b.next_token, b.next_kind, b.alphas) and tensors_equal


# ---- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n_match", range(K + 1))
@pytest.mark.parametrize("one_hot", [False, True], ids=["raw-p", "processed-one-hot-p"])
def test_greedy_accepts_the_longest_argmax_prefix_then_emits_the_argmax(n_match: int, one_hot: bool) -> None:
    p = _probs(100 + n_match, K + 1)  # [K + 1, V]
    if one_hot:  # what processed_probs gives at temperature 0
        p = torch.nn.functional.one_hot(p.argmax(-1), V).double()
    best = p.argmax(-1).tolist()
    draft = best[:K]
    if n_match < K:
        draft[n_match] = (best[n_match] + 3) % V  # first mismatch; later tokens are argmax again
    for seed in range(20):  # greedy ignores the seed and the q values
        q = [0.5 + 0.5 * ((seed + i) % 3) / 2 for i in range(K)]
        out = verify_round(p, draft, q, seed=seed, ctx_len=9, greedy=True)
        assert out.accepted_len == n_match
        assert out.next_token == best[n_match]
        assert out.next_kind == ("bonus" if n_match == K else "correction")
        assert out.alphas == [1.0 if y == b else 0.0 for y, b in zip(draft, best[:K], strict=True)]


def test_greedy_with_an_empty_draft_emits_the_argmax_bonus() -> None:
    p = _probs(5, 1)
    out = verify_round(p, [], [], seed=0, ctx_len=3, greedy=True)
    assert (out.accepted_len, out.next_token, out.next_kind) == (0, int(p[0].argmax()), "bonus")


# ---- sampled rule: alphas, replay -----------------------------------------------------------


def test_alphas_are_min_one_p_over_q_and_coins_decide_acceptance() -> None:
    p = _probs(1, K + 1)
    draft = [3, 1, 4, 1]
    q = [0.9, 0.05, 0.3, 1.0]
    out = verify_round(p, draft, q, seed=42, ctx_len=20)
    want = [min(1.0, float(p[i, y]) / q[i]) for i, y in enumerate(draft)]
    assert out.alphas == pytest.approx(want, rel=1e-12)
    # accepted exactly while the position's COIN uniform is below alpha
    coins = [position_uniform(42, 20 + i + 1, 0) for i in range(K)]
    la = next((i for i in range(K) if coins[i] >= want[i]), K)
    assert out.accepted_len == la


@pytest.mark.parametrize("mode", ["dense", "split", "deterministic", "shortcut"])
def test_seeded_replay_gives_identical_outcomes(mode: str) -> None:
    p = _probs(2, K + 1)
    q_dists = _probs(3, K)  # [K, V]
    draft = [int(q_dists[i].argmin()) for i in range(K)]  # unlikely drafts: rejections happen
    q = [float(q_dists[i, y]) for i, y in enumerate(draft)]
    options: dict[str, dict[str, Any]] = {
        "dense": {"q_dists": q_dists}, "split": {}, "shortcut": {"correction": "shortcut"},
        "deterministic": {"draft_kind": "deterministic"}}
    kwargs = options[mode]
    if mode == "deterministic":
        q = [1.0] * K
    outcomes = []
    for seed in range(200):
        a = verify_round(p, draft, q, seed=seed, ctx_len=50, **kwargs)
        b = verify_round(p.clone(), list(draft), list(q), seed=seed, ctx_len=50, **kwargs)
        assert _same(a, b), seed
        if a.next_kind == "residual":
            assert a.target_ids is not None and a.target_probs is not None
            r1 = sample_residual(a.target_ids, a.target_probs, q_dists[a.accepted_len], seed, 51 + a.accepted_len)
            r2 = sample_residual(a.target_ids.tolist(), a.target_probs.tolist(), q_dists[a.accepted_len].clone(),
                                 seed, 51 + a.accepted_len)
            assert r1 == r2
        outcomes.append((a.accepted_len, a.next_token))
    assert len(set(outcomes)) > 3, "the seed must matter"


def test_outcome_depends_on_absolute_position() -> None:
    """Coins are keyed by ctx_len + i: the same draft at another context length draws anew."""
    p, q_dists = _probs(2, K + 1), _probs(3, K)
    draft = [int(q_dists[i].argmin()) for i in range(K)]
    q = [float(q_dists[i, y]) for i, y in enumerate(draft)]
    at = {c: [verify_round(p, draft, q, seed=s, ctx_len=c, q_dists=q_dists).accepted_len for s in range(100)]
          for c in (10, 11)}
    assert at[10] != at[11]


def test_split_residual_returns_the_support_of_p_at_the_rejected_position() -> None:
    p = _probs(4, K + 1)
    p[1, :3] = 0.0  # a processed p with zeros (top-k / top-p)
    p[1] /= p[1].sum()
    draft = [int(p[0].argmax()), 0, 1, 2]
    q = [float(p[0].max()), 0.5, 0.5, 0.5]  # y_1 always accepted (alpha 1); y_2 has p = 0: rejected
    out = verify_round(p, draft, q, seed=7, ctx_len=4)
    assert (out.accepted_len, out.next_token, out.next_kind) == (1, None, "residual")
    assert out.target_ids is not None and out.target_probs is not None
    assert out.target_ids.tolist() == list(range(3, V))
    assert torch.equal(out.target_probs, p[1, 3:])


def test_deterministic_draft_correction_never_repeats_the_rejected_token() -> None:
    p = _probs(6, 3)
    y = int(p[0].argmax())  # likely but not certain: sometimes rejected
    seen = set()
    for seed in range(300):
        out = verify_round(p, [y, 0], [1.0, 1.0], seed=seed, ctx_len=1, draft_kind="deterministic")
        if out.accepted_len == 0:
            assert out.next_token != y
            seen.add(out.next_token)
    assert len(seen) > 1


# ---- degenerate residual --------------------------------------------------------------------


def test_degenerate_residual_falls_back_to_p_on_the_cloud_q_dists_path() -> None:
    """p_j <= q_j everywhere (q_dists = p, and the scalar q_j a hair above p_j(y_j), inside the
    allowed disagreement, so that y_j can be rejected): the correction is drawn from p_j itself."""
    p = _probs(8, 3)  # [3, V]
    p[0, 0] = 1e-4  # a rare token to draft
    p[0] /= p[0].sum()
    q_dists = p[:2].clone()
    q = [float(p[0, 0]) + 9e-5, float(p[1, 0])]  # alpha ~ 0.53
    hits = 0
    for seed in range(300):
        out = verify_round(p, [0, 0], q, seed=seed, ctx_len=30, q_dists=q_dists)
        if out.accepted_len == 0:
            hits += 1
            assert out.next_kind == "correction"
            assert out.next_token == sample_index(p[0], position_uniform(seed, 31, SAMPLE))
    assert hits > 50


@pytest.mark.parametrize("noise", ["exact", "q-above-by-1e-16", "p-above-by-1e-15-relative"])
def test_degenerate_residual_falls_back_to_p_in_sample_residual(noise: str) -> None:
    p = _probs(9, 1)[0]  # [V]
    p[[2, 5]] = 0.0
    p /= p.sum()
    ids = torch.nonzero(p > 0).squeeze(-1)  # [m]
    q_full = p.clone()
    if noise == "q-above-by-1e-16":
        q_full[ids] += 1e-16
    elif noise == "p-above-by-1e-15-relative":  # max(0, p - q) ~ 1e-15: float noise, not a distribution
        q_full *= 1 - 1e-15
    draws = set()
    for seed in range(200):
        tok = sample_residual(ids, p[ids], q_full, seed, 17)
        assert tok == int(ids[sample_index(p[ids], position_uniform(seed, 17, SAMPLE))])
        draws.add(tok)
    assert len(draws) > 3


def test_sample_residual_draws_from_max_p_minus_q() -> None:
    """With q_j >= p_j on all tokens but one, the residual is a point mass on that token."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.3, 0.1], dtype=torch.float64)
    for seed in range(50):
        assert sample_residual([0, 1, 2, 3], p, q, seed, 3) == 3


# ---- bad input ------------------------------------------------------------------------------


def _good() -> dict:
    p = _probs(11, 3)
    return {"p": p, "draft_tokens": [1, 2], "q_probs": [0.5, 0.25], "seed": 0, "ctx_len": 5}


def _q_dists_matching(d: dict) -> torch.Tensor:
    qd = torch.full((2, V), 0.5 / (V - 1), dtype=torch.float64)
    qd[0, 1] = 0.5
    qd[1] = 0.75 / (V - 1)
    qd[1, 2] = 0.25
    return qd


BAD_CASES = {
    "p-missing-bonus-row": lambda d: d.update(p=d["p"][:2]),
    "p-1d": lambda d: d.update(p=d["p"][0]),
    "p-nan": lambda d: d["p"].__setitem__((1, 3), math.nan),
    "p-negative": lambda d: d["p"].__setitem__((0, 0), -0.1),
    "p-inf": lambda d: d["p"].__setitem__((2, 0), math.inf),
    "len-q-differs-from-k": lambda d: d.update(q_probs=[0.5]),
    "q-zero": lambda d: d.update(q_probs=[0.0, 0.5]),
    "q-negative": lambda d: d.update(q_probs=[-0.2, 0.5]),
    "q-above-one": lambda d: d.update(q_probs=[1.5, 0.5]),
    "q-nan": lambda d: d.update(q_probs=[math.nan, 0.5]),
    "q-inf": lambda d: d.update(q_probs=[0.5, math.inf]),
    "q-not-a-number": lambda d: d.update(q_probs=["0.5", 0.5]),
    "id-equal-vocab": lambda d: d.update(draft_tokens=[1, V]),
    "id-negative": lambda d: d.update(draft_tokens=[-1, 2]),
    "id-float": lambda d: d.update(draft_tokens=[1.0, 2]),
    "id-bool": lambda d: d.update(draft_tokens=[True, 2]),
    "unknown-draft-kind": lambda d: d.update(draft_kind="beam"),
    "deterministic-with-q-below-one": lambda d: d.update(draft_kind="deterministic", q_probs=[1.0, 0.9]),
    "q-dists-wrong-shape": lambda d: d.update(q_dists=torch.full((3, V), 1.0 / V, dtype=torch.float64)),
    "q-dists-wrong-vocab": lambda d: d.update(q_dists=torch.full((2, V + 1), 1.0 / (V + 1))),
    "q-dists-nan": lambda d: d.update(q_dists=_q_dists_matching(d).index_put_((torch.tensor([0]), torch.tensor([4])),
                                                                            torch.tensor([math.nan], dtype=torch.float64))),
    "q-dists-negative": lambda d: d.update(q_dists=_q_dists_matching(d) + torch.tensor([0.1] + [0.0] * (V - 2) + [-0.1],
                                                                                    dtype=torch.float64)),
    "q-dists-rows-not-summing-to-one": lambda d: d.update(q_dists=_q_dists_matching(d) * 1.1),
    "q-dists-disagree-with-q": lambda d: d.update(q_dists=_q_dists_matching(d), q_probs=[0.5, 0.3]),
}


def test_the_bad_input_fixtures_start_from_a_valid_request() -> None:
    d = _good()
    verify_round(d.pop("p"), d.pop("draft_tokens"), d.pop("q_probs"), **d)
    d = _good()
    verify_round(d.pop("p"), d.pop("draft_tokens"), d.pop("q_probs"), q_dists=_q_dists_matching(d), **d)


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_raises_invalid_argument(case: str) -> None:
    d = _good()
    BAD_CASES[case](d)
    with pytest.raises(InvalidArgument) as err:
        verify_round(d.pop("p"), d.pop("draft_tokens"), d.pop("q_probs"), **d)
    assert err.value.http_status == 422 and err.value.code == "invalid_argument" and err.value.message


def test_check_draft_accepts_a_good_draft_and_changes_nothing() -> None:
    q_dists = torch.full((2, V), 0.5 / (V - 1), dtype=torch.float64)
    q_dists[0, 1], q_dists[1, 2] = 0.5, 0.5
    snapshot = q_dists.clone()
    check_draft([1, 2], [0.5, 0.5], V, "sampled", q_dists)
    check_draft([1, 2], [1.0, 1.0], V, "deterministic")
    assert torch.equal(q_dists, snapshot)


@pytest.mark.parametrize("bad", ["length-mismatch", "id-outside-vocab", "nan-prob", "negative-prob", "empty",
                                 "zero-mass", "q-not-1d"])
def test_sample_residual_rejects_a_malformed_target_dist(bad: str) -> None:
    ids, probs, q = [0, 3, 5], [0.2, 0.3, 0.5], torch.full((V,), 1.0 / V, dtype=torch.float64)
    if bad == "length-mismatch":
        probs = [0.5, 0.5]
    elif bad == "id-outside-vocab":
        ids = [0, 3, V]
    elif bad == "nan-prob":
        probs = [0.2, math.nan, 0.5]
    elif bad == "negative-prob":
        probs = [0.2, -0.3, 0.5]
    elif bad == "empty":
        ids, probs = [], []
    elif bad == "zero-mass":
        probs = [0.0, 0.0, 0.0]
    else:
        q = q[None]
    with pytest.raises(InvalidArgument):
        sample_residual(ids, probs, q, 1, 2)


def test_dense_from_sparse_places_probs_at_their_ids() -> None:
    d = dense_from_sparse([4, 1], [0.75, 0.25], 6)
    assert d.dtype == torch.float64 and d.tolist() == [0.0, 0.25, 0.0, 0.0, 0.75, 0.0]


def test_an_empty_draft_gets_a_bonus_from_p() -> None:
    p = _probs(12, 1)
    for seed in range(20):
        out = verify_round(p, [], [], seed=seed, ctx_len=8)
        assert (out.accepted_len, out.next_kind, out.alphas) == (0, "bonus", [])
        assert out.next_token == sample_index(p[0], position_uniform(seed, 9, SAMPLE))

"""Speculative sampling with shared.verify emits exactly the target's distribution.

Every exactness test here is Pearson's chi-square goodness of fit at significance ALPHA = 0.001
on N independent runs (verifier seed = base + run index; draft uniforms from a numpy generator
seeded with the case's base seed; all fixed), on the first emitted token (~ p_1) and the pair of
the first two (~ p_1(a) p_2(b | a)) of toy autoregressive pairs with V = 6 (see toy_speculation).
The emitted tokens of a round are the accepted drafts then the next token; a round that rejects
y_1 emits one token only, and the pair's second token is then the first of the next round, run
from the extended context as the system would. Cells with expected count < 5 are pooled.
Power: a total-variation error t gives non-centrality >= 4 N t^2 (toy_speculation.chi_square_gof);
N is the smallest of 20,000, 25,000, 30,000 that detects t = 0.02 with probability >= 0.8 on the
pair test (30,000 for the full 35 degrees of freedom: non-centrality 48, power 0.85), and each
test asserts that power for its own degrees of freedom. Cases marked check_last verify the last draft token against p_k instead of drawing a
bonus (the rule sampled sessions use for seeded text independent of the rounds). The same test flags the known-biased
variants (shortcut correction, a residual drawn without the draft's q) with p-values far below
ALPHA.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from shared.config import SamplingConfig
from shared.sampling import process_logits
from shared.verify import Correction, verify_round
from tests.shared.toy_speculation import (
    ALPHA,
    MIN_POWER,
    GoodnessOfFit,
    Mode,
    ResidualQ,
    ToyPair,
    chi_square_gof,
    first_token_law,
    first_two_emitted,
    pair_law,
    random_rows,
    runs_needed,
)

V = 6


def _one_hot_rows(tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, V).to(torch.float64)  # [V, V]


def _normalised(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.to(torch.float64)
    return rows / rows.sum(-1, keepdim=True)


def _tables() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(target, draft) tables by family name, all from one fixed generator."""
    g = torch.Generator().manual_seed(20240611)
    rand_p, rand_q = random_rows(g, V), random_rows(g, V)
    peaked_p = random_rows(g, V, scale=3.0)
    # adversarial: the draft puts 0.85 on the token the target likes least
    peaked_q = 0.15 / V + 0.85 * _one_hot_rows(peaked_p.argmin(-1))
    # disjoint supports: per row, the target lives on 3 tokens and the draft on the other 3
    perm = torch.stack([torch.randperm(V, generator=g) for _ in range(V)])  # [V, V]
    on_p = torch.zeros(V, V, dtype=torch.bool).scatter(1, perm[:, : V // 2], True)
    disj_p = _normalised(torch.where(on_p, random_rows(g, V), 0.0))
    disj_q = _normalised(torch.where(~on_p, random_rows(g, V), 0.0))
    # top-p / top-k truncated, through the shared processing itself: zeros on both sides
    topp_p = _normalised(process_logits(torch.randn(V, V, generator=g), SamplingConfig(top_p=0.8)))
    topp_q = _normalised(process_logits(torch.randn(V, V, generator=g), SamplingConfig(top_p=0.9, top_k=4)))
    # a frequency-ranked output layer (FR-Spec; the feature-fed head's): the draft proposes from a fixed
    # subset only, through the shared processing with -inf elsewhere (q = 0 there), and the target puts
    # about half of its mass on the two ids the subset leaves out
    left_out = torch.zeros(V, dtype=torch.bool)
    left_out[:2] = True
    red_p = _normalised(random_rows(g, V) + torch.where(left_out, 1.5, 0.0))
    red_q = _normalised(process_logits(torch.randn(V, V, generator=g).masked_fill(left_out, float("-inf")),
                                       SamplingConfig()))
    assert bool((red_q[:, left_out] == 0).all()) and float(red_p[:, left_out].sum(-1).min()) > 0.4
    return {
        "random": (rand_p, rand_q),
        "reduced": (red_p, red_q),
        "peaked": (peaked_p, peaked_q),
        "disjoint": (disj_p, disj_q),
        "top_p": (topp_p, topp_q),
        "near": (peaked_p, 0.7 * peaked_p + 0.3 * random_rows(g, V)),
        "equal": (topp_p, topp_p.clone()),
        # deterministic drafters (one-hot q rows)
        "det_argmax": (peaked_p, _one_hot_rows(peaked_p.argmax(-1))),
        "det_zero_mass": (topp_p, _one_hot_rows(topp_p.argmin(-1))),  # a token the target never emits
        "det_map": (peaked_p, _one_hot_rows((torch.arange(V) * 5 + 1) % V)),
    }


TABLES = _tables()


@dataclass(frozen=True)
class Case:
    # family in TABLES
    family: str
    # draft length
    k: int
    # how the round is verified and finished
    mode: Mode
    # verifier seeds are base_seed + run index
    base_seed: int
    # the last draft token is checked against p_k instead of a bonus being drawn (shared/verify.py)
    check_last: bool = False

    @property
    def id(self) -> str:
        return f"{self.mode}-{self.family}-k{self.k}" + ("-checklast" if self.check_last else "")

    def pair(self) -> ToyPair:
        p, q = TABLES[self.family]
        return ToyPair(p, q, self.k)


# q = p is verified in one mode only (every draft is accepted, the mode never matters), disjoint
# supports in split mode only (every draft is rejected and the residual is p: the dense path's
# _residual is the same function, exercised by every other dense case)
_FAMILIES: dict[Mode, list[tuple[str, int]]] = {
    "dense": [("random", 2), ("peaked", 3), ("top_p", 2), ("equal", 1), ("reduced", 3)],
    "split": [("random", 2), ("peaked", 3), ("disjoint", 2), ("top_p", 2), ("near", 1), ("reduced", 3)],
    "deterministic": [("det_argmax", 3), ("det_zero_mass", 2), ("det_map", 1)],
}
CASES = [Case(f, k, mode, 1_000_000 * (10 * m + i + 1))
         for m, (mode, fams) in enumerate(_FAMILIES.items()) for i, (f, k) in enumerate(fams)]
# the checked last draft (a round of k = 1 is then one checked token: the pair's second token comes from
# the next round, so both rounds are decided by the rule without a bonus)
CASES += [Case(f, k, mode, 1_000_000 * (50 + i), check_last=True)
          for i, (f, k, mode) in enumerate([("random", 1, "split"), ("peaked", 3, "dense"), ("reduced", 2, "split"),
                                            ("det_argmax", 2, "deterministic")])]


def _fits(pair: ToyPair, emitted: np.ndarray) -> tuple[GoodnessOfFit, GoodnessOfFit]:
    first = chi_square_gof(emitted[:, 0], first_token_law(pair))
    both = chi_square_gof(emitted[:, 0] * V + emitted[:, 1], pair_law(pair))
    return first, both


def _run(case: Case, correction: Correction = "strict", residual_q: ResidualQ | None = None, n: int | None = None
         ) -> tuple[GoodnessOfFit, GoodnessOfFit]:
    pair = case.pair()
    n = n or runs_needed(pair_law(pair))
    emitted = first_two_emitted(pair, n, case.base_seed, case.mode, draft_seed=case.base_seed, correction=correction,
                                residual_q=residual_q, check_last=case.check_last)
    return _fits(pair, emitted)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_first_two_emitted_tokens_follow_the_target(case: Case) -> None:
    """Chi-square GOF at 0.001, N in 20,000..30,000 (power >= 0.8 at TV 0.02): the first
    emitted token ~ p_1 and the first two ~ p_1(a) p_2(b | a); no token of probability 0."""
    first, both = _run(case)
    for name, fit in (("first token", first), ("pair", both)):
        assert fit.impossible == 0, f"{name}: emitted a token of target probability 0"
        assert fit.power >= MIN_POWER, f"{name}: N too small for df = {fit.df} (power {fit.power:.2f})"
        assert fit.pvalue >= ALPHA, f"{name}: chi2 = {fit.statistic:.1f}, df = {fit.df}, p = {fit.pvalue:.2e}"


def test_shortcut_correction_is_flagged_as_biased() -> None:
    """The same test (0.001, N = 20,000, the floor of every case) rejects correction="shortcut"
    (correction drawn from p_j instead of the residual) on the truncated pair, where it
    re-emits the rejected draft tokens too often."""
    first, both = _run(Case("top_p", 2, "split", 1_000_000 * 99 + 1), correction="shortcut", n=20_000)
    assert first.pvalue < ALPHA and both.pvalue < ALPHA, (first, both)


def test_shortcut_correction_with_a_reduced_vocabulary_draft_is_flagged_as_biased() -> None:
    """The same test (0.001, N = 20,000) rejects correction="shortcut" for the reduced-vocabulary draft
    (q = 0 on two ids that carry about half of the target's mass): drawn from p_j instead of the
    residual, a correction re-emits the rejected draft token too often. The strict rule passes the same
    pair in both dense and split modes (CASES)."""
    first, both = _run(Case("reduced", 3, "split", 1_000_000 * 99 + 3), correction="shortcut", n=20_000)
    assert first.pvalue < ALPHA and both.pvalue < ALPHA, (first, both)


def test_shortcut_correction_with_the_checked_last_draft_is_flagged_as_biased() -> None:
    """The same test (0.001, N = 20,000) rejects correction="shortcut" with check_last on the truncated pair."""
    first, both = _run(Case("top_p", 2, "split", 1_000_000 * 99 + 4, check_last=True), correction="shortcut",
                       n=20_000)
    assert first.pvalue < ALPHA and both.pvalue < ALPHA, (first, both)


def test_residual_drawn_without_the_draft_q_is_flagged_as_biased() -> None:
    """The same test (0.001, N = 20,000, the floor of every case) rejects a broken edge that finishes a
    split residual as "p_j with y_j removed" (q_j taken as a point mass on y_j) although the draft
    sampled y_j from a spread q_j."""
    def point_mass(_prev: int, y: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(y), V).to(torch.float64)  # [V]

    first, both = _run(Case("random", 2, "split", 1_000_000 * 99 + 2), residual_q=point_mass, n=20_000)
    assert first.pvalue < ALPHA and both.pvalue < ALPHA, (first, both)


def test_mean_accepted_length_matches_the_acceptance_rates() -> None:
    """E[accepted_len] = sum_{i=1..k} prod_{j<=i} beta_j, beta_j = sum_x min(p_j, q_j), for
    per-position p_j, q_j that do not depend on the prefix (k = 4, V = 8, N = 20,000 rounds,
    seeds fixed): the sample mean is within 3 standard errors, and the histogram of
    accepted_len passes a chi-square GOF at 0.001 against P(La >= i) = prod_{j<=i} beta_j."""
    k, vocab, n = 4, 8, 20_000
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(1.5 * torch.randn(k + 1, vocab, generator=g, dtype=torch.float64), -1)  # [k + 1, V]
    mix = torch.tensor([0.9, 0.6, 0.3, 0.75], dtype=torch.float64)[:, None]  # [k, 1]
    q = mix * p[:k] + (1 - mix) * torch.softmax(torch.randn(k, vocab, generator=g, dtype=torch.float64), -1)
    beta = torch.minimum(p[:k], q).sum(-1)  # [k]
    survive = torch.cumprod(beta, 0)  # [k]: P(La >= i)
    expected_mean = float(survive.sum())

    rng = np.random.default_rng(3)
    q_np = q.numpy()
    drafts = np.stack([rng.choice(vocab, size=n, p=q_np[i] / q_np[i].sum()) for i in range(k)], 1)  # [n, k]
    la = np.empty(n, dtype=np.int64)
    for s in range(n):
        ys = drafts[s].tolist()
        qs = [q_np[i, y] for i, y in enumerate(ys)]
        la[s] = verify_round(p, ys, qs, seed=5_000_000 + s, ctx_len=11).accepted_len

    se = la.std(ddof=1) / np.sqrt(n)
    assert abs(la.mean() - expected_mean) < 3 * se, (la.mean(), expected_mean, se)
    law = np.append(1.0, survive.numpy()) - np.append(survive.numpy(), 0.0)  # [k + 1]: P(La = i)
    fit = chi_square_gof(la, law)
    assert fit.pvalue >= ALPHA, fit

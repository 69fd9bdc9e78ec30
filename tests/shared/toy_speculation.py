"""Toy autoregressive draft/target pairs over tiny vocabularies, one speculative round on them, and
the chi-square machinery the exactness tests share.

A toy "model" is a table: row t is the next-token distribution after previous token t ([V, V]).
That makes p_{i+1} the target's conditional after the drafted y_i, as in a real language model,
so the second emitted token of a round is drawn under the right conditional only if the verify
rule handles prefixes correctly. The draft's own sampling is done here (it is not the code under
test); every accept/reject decision, correction, bonus and residual comes from `shared.verify`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

import numpy as np
import torch
from scipy.stats import chi2, chisquare, ncx2

from shared.verify import Correction, DraftKind, sample_residual, verify_round

# "dense": the edge sends q_dists; "split": scalar q, the cloud answers "residual" and the edge
# draws it with sample_residual; "deterministic": q = 1 point-mass drafts
Mode = Literal["dense", "split", "deterministic"]
# the draft's full q at a rejected position, given (previous token, rejected draft token) -> [V]
ResidualQ = Callable[[int, int], torch.Tensor]

ALPHA = 1e-3  # significance of every goodness-of-fit test
TV_DETECT = 0.02  # total-variation error the tests must detect ...
MIN_POWER = 0.8  # ... with at least this probability
CONTEXT_LAST = 0  # last token of the committed context before the round
CTX_LEN = 7  # |S| before the round


@dataclass
class ToyPair:
    """A target and a draft over the same tiny vocabulary, both conditioned on the previous token."""

    # target p: row t is p(. | previous token t); [V, V] float64, rows sum to 1
    target: torch.Tensor
    # draft q: row t is q(. | previous token t); [V, V] float64; one-hot rows for deterministic drafts
    draft: torch.Tensor
    # draft length of a round
    k: int
    # python copies for the draft sampler (not the code under test)
    _q_rows: list[list[float]] = field(init=False, repr=False)
    _q_cdf: list[list[float]] = field(init=False, repr=False)
    _p_cache: dict[tuple[int, ...], torch.Tensor] = field(init=False, repr=False, default_factory=dict)
    _q_cache: dict[tuple[int, ...], torch.Tensor] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._q_rows = self.draft.tolist()
        self._q_cdf = [list(accumulate(row)) for row in self._q_rows]

    @property
    def vocab(self) -> int:
        return self.target.size(-1)

    def draw_draft(self, prev: int, u: float) -> int:
        """Inverse-CDF draw of the draft's next token after `prev` (never a zero-mass token)."""
        cdf = self._q_cdf[prev]
        i = min(bisect_right(cdf, u * cdf[-1]), len(cdf) - 1)
        while self._q_rows[prev][i] <= 0:
            i -= 1
        return i

    def target_rows(self, prevs: tuple[int, ...]) -> torch.Tensor:
        """p for the positions after each token of `prevs` ([len(prevs), V]), cached by prefix."""
        p = self._p_cache.get(prevs)
        if p is None:
            p = self._p_cache[prevs] = self.target[list(prevs)]
        return p

    def draft_rows(self, prevs: tuple[int, ...]) -> torch.Tensor:
        """q for the positions after each token of `prevs` ([len(prevs), V]), cached by prefix."""
        q = self._q_cache.get(prevs)
        if q is None:
            q = self._q_cache[prevs] = self.draft[list(prevs)]
        return q

    def true_q(self, prev: int, _y: int) -> torch.Tensor:
        return self.draft[prev]  # [V]


def speculative_round(pair: ToyPair, prev: int, ctx_len: int, seed: int, us: np.ndarray, mode: Mode,
                      correction: Correction = "strict", residual_q: ResidualQ | None = None,
                      check_last: bool = False) -> list[int]:
    """Draft k tokens after `prev`, verify them with shared.verify, return the emitted tokens.

    Emitted = accepted drafts + the next token (correction, bonus, or residual drawn by the edge; none
    when check_last keeps every draft: the target's rows then stop at p_k).
    `us` ([k]) are the draft's own uniforms.
    """
    ys, qs, prevs = [], [], [prev]
    for i in range(pair.k):
        y = pair.draw_draft(prevs[-1], float(us[i]))
        qs.append(pair._q_rows[prevs[-1]][y])
        ys.append(y)
        prevs.append(y)
    key = tuple(prevs)
    p = pair.target_rows(key)  # [k + 1, V]
    if check_last:
        p = p[: pair.k]  # [k, V]: y_k is checked against p_k, not run
    q_dists = pair.draft_rows(key[:-1]) if mode == "dense" else None  # [k, V]
    kind: DraftKind = "deterministic" if mode == "deterministic" else "sampled"
    out = verify_round(p, ys, qs, seed=seed, ctx_len=ctx_len, correction=correction, draft_kind=kind,
                       q_dists=q_dists, check_last=check_last)
    la = out.accepted_len
    if out.next_kind == "none":
        return ys
    if out.next_kind == "residual":
        assert mode == "split" and correction == "strict", (mode, correction)
        assert out.target_ids is not None and out.target_probs is not None
        q_full = (residual_q or pair.true_q)(prevs[la], ys[la])  # [V]
        nxt = sample_residual(out.target_ids, out.target_probs, q_full, seed, ctx_len + la + 1)
    else:
        assert out.next_token is not None
        nxt = out.next_token
    return ys[:la] + [nxt]


def first_two_emitted(pair: ToyPair, n: int, base_seed: int, mode: Mode, *, draft_seed: int = 0,
                      correction: Correction = "strict", residual_q: ResidualQ | None = None,
                      check_last: bool = False) -> np.ndarray:
    """The first two tokens emitted after the context, for n independent runs ([n, 2]).

    Run i uses verifier seed base_seed + i. A round that emits only one token (rejection at y_1)
    is followed by a second round from the extended context, as the system would do.
    """
    us = np.random.default_rng(draft_seed).random((n, 2, pair.k))  # [n, rounds, k]
    out = np.empty((n, 2), dtype=np.int64)
    for i in range(n):
        seed = base_seed + i
        emitted = speculative_round(pair, CONTEXT_LAST, CTX_LEN, seed, us[i, 0], mode, correction, residual_q,
                                    check_last)
        if len(emitted) < 2:
            emitted += speculative_round(pair, emitted[-1], CTX_LEN + 1, seed, us[i, 1], mode, correction,
                                         residual_q, check_last)
        out[i] = emitted[:2]
    return out


def first_token_law(pair: ToyPair) -> np.ndarray:
    """p_1(a) after the context ([V])."""
    return pair.target[CONTEXT_LAST].numpy()


def pair_law(pair: ToyPair) -> np.ndarray:
    """p_1(a) p_2(b | a), flattened over (a, b) ([V * V])."""
    p = pair.target.numpy()
    return (p[CONTEXT_LAST][:, None] * p).reshape(-1)


@dataclass
class GoodnessOfFit:
    # chi-square statistic over the pooled cells
    statistic: float
    # degrees of freedom: pooled cells - 1
    df: int
    # P(chi2_df >= statistic)
    pvalue: float
    # power against any alternative at total variation TV_DETECT (lower bound, see chi_square_gof)
    power: float
    # observations that fell in cells of probability 0 (must be none for an exact sampler)
    impossible: int


def chi_square_gof(observed_cells: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> GoodnessOfFit:
    """Pearson's chi-square goodness of fit of cell indices `observed_cells` ([n]) to `probs` ([m]).

    Cells of probability 0 are left out (hits there are counted in `impossible`); the cells with an
    expected count below `min_expected` are pooled into one, together with the next smallest cells
    until the pool reaches `min_expected`.

    Power: for an alternative r at total variation t from probs, the non-centrality is
    lam = n * sum((r - p)^2 / p) >= n * (sum |r - p|)^2 = 4 n t^2 (Cauchy-Schwarz, sum p = 1).
    The reported power is P(noncentral chi2(df, 4 n t^2) > critical value at ALPHA), t = TV_DETECT.
    Pooling can only hide an error that moves mass inside the pool, whose mass is ~2 * min_expected / n
    (< 0.001 here), so the bound holds up to that.
    """
    n = len(observed_cells)
    counts = np.bincount(observed_cells, minlength=len(probs)).astype(np.float64)
    possible = probs > 0
    impossible = int(counts[~possible].sum())
    exp, obs = _pooled(probs[possible] * n, counts[possible], min_expected)
    exp = exp * obs.sum() / exp.sum()  # exact float normalisation of the expected counts
    res = chisquare(obs, exp)
    df = len(exp) - 1
    return GoodnessOfFit(float(res.statistic), df, float(res.pvalue), detection_power(df, n), impossible)


def _pooled(exp: np.ndarray, obs: np.ndarray, min_expected: float) -> tuple[np.ndarray, np.ndarray]:
    """Merge the cells of expected count < min_expected (and then the next smallest ones until the
    pool reaches min_expected) into one cell."""
    order = np.argsort(exp, kind="stable")
    exp, obs = exp[order], obs[order]
    cut = int((exp < min_expected).sum())  # the small cells are a prefix after sorting
    while 0 < cut < len(exp) and exp[:cut].sum() < min_expected:
        cut += 1
    if cut > 1:
        exp = np.concatenate([[exp[:cut].sum()], exp[cut:]])
        obs = np.concatenate([[obs[:cut].sum()], obs[cut:]])
    return exp, obs


def detection_power(df: int, n: int) -> float:
    """P(reject at ALPHA) against any alternative at total variation TV_DETECT (lower bound)."""
    if df <= 0:
        return 1.0
    return float(ncx2.sf(chi2.ppf(1 - ALPHA, df), df, 4 * n * TV_DETECT**2))


def runs_needed(probs: np.ndarray, start: int = 20_000, step: int = 5_000, min_expected: float = 5.0) -> int:
    """The smallest n = start + j * step whose goodness-of-fit test on `probs` has MIN_POWER."""
    n = start
    while True:
        exp, _ = _pooled(probs[probs > 0] * n, np.zeros(int((probs > 0).sum())), min_expected)
        if detection_power(len(exp) - 1, n) >= MIN_POWER:
            return n
        n += step


def random_rows(gen: torch.Generator, v: int, scale: float = 1.0) -> torch.Tensor:
    """v random distributions over v tokens, softmax of scaled Gaussian logits ([v, v] float64)."""
    return torch.softmax(scale * torch.randn(v, v, generator=gen, dtype=torch.float64), -1)

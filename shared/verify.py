"""The verify rule of speculative sampling (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192).

Words, used the same way everywhere in the project:
- draft: k tokens y_1..y_k proposed after the committed context S, with q_i = q(y_i | S, y_<i).
- accepted: y_i is kept with probability min(1, p_i(y_i) / q_i), checked in order; the first
  rejection at j ends the round, so accepted_len = j - 1 (or k when none is rejected).
- correction: the token that replaces the first rejected y_j. Exactness needs it drawn from the
  residual norm(max(0, p_j - q_j)), which needs the draft's whole q_j:
    * q_dists sent                -> the cloud samples the residual itself;
    * deterministic draft (q = 1) -> q_j is a point mass, residual = p_j without y_j;
    * strict, scalar q only       -> next_kind "residual": the cloud returns p_j and the edge,
                                     which holds q_j, draws the residual (`sample_residual`);
    * shortcut                    -> sample p_j (fast, biased towards y_j's alternatives);
    * greedy                      -> argmax p_j.
- bonus: when all k are accepted, one more token drawn from p_{k+1}.
- checked last (`check_last`): the edge drafts y_k too and the forward runs only y_1..y_{k-1}, so
  p_k is the distribution after them; y_k is accepted or corrected like the others and no bonus is
  drawn (next kind "none" when all k are kept). Then every committed position is decided by the same
  rule (draft from q, coin, residual), whatever the grouping of positions into rounds: with a draft
  whose q depends on the text alone, the same seed gives the same text for any k schedule.

Coins and samples come from `shared.rng` streams keyed by (seed, absolute position), position
ctx_len + i for y_i, so the same request always gets the same answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from shared.errors import InvalidArgument
from shared.rng import COIN, SAMPLE, position_uniform, sample_index
from shared.target_probs import RESIDUAL_EPS, TargetProbs

Correction = Literal["strict", "shortcut"]
DraftKind = Literal["sampled", "deterministic"]
NextKind = Literal["correction", "bonus", "residual", "none"]


@dataclass
class VerifyOutcome:
    # number of draft tokens kept, 0..k
    accepted_len: int
    # the token after the accepted prefix; None when the edge must draw the residual
    next_token: int | None
    # "correction" (first rejection), "bonus" (all accepted), "residual" (edge draws it), "none" (all
    # accepted with check_last: nothing follows)
    next_kind: NextKind
    # for "residual": the support of the processed p_j, ids [m] and probs [m] (float64)
    target_ids: torch.Tensor | None = None
    target_probs: torch.Tensor | None = None
    # min(1, p_i(y_i) / q_i) for every draft position i = 1..k (greedy: 1.0 if y_i is the argmax)
    alphas: list[float] = field(default_factory=list)


def dense_from_sparse(ids: Sequence[int], probs: Sequence[float], vocab: int) -> torch.Tensor:
    """A [vocab] float64 distribution from its support."""
    out = torch.zeros(vocab, dtype=torch.float64)
    out[torch.as_tensor(list(ids), dtype=torch.long)] = torch.as_tensor(list(probs), dtype=torch.float64)
    return out


def check_draft(draft_tokens: Sequence[int], q_probs: Sequence[float], vocab: int, draft_kind: str,
                q_dists: torch.Tensor | None = None) -> None:
    """Raise InvalidArgument unless the draft is well formed. Changes nothing."""
    k = len(draft_tokens)
    if len(q_probs) != k:
        raise InvalidArgument(f"len(q_token_probs) = {len(q_probs)} but k = {k}")
    if draft_kind not in ("sampled", "deterministic"):
        raise InvalidArgument(f"draft_kind must be 'sampled' or 'deterministic', not {draft_kind!r}")
    for i, (y, q) in enumerate(zip(draft_tokens, q_probs, strict=True)):
        if not isinstance(y, int) or isinstance(y, bool) or not 0 <= y < vocab:
            raise InvalidArgument(f"draft_tokens[{i}] = {y!r} is not a token id in [0, {vocab})")
        if not isinstance(q, (int, float)) or not math.isfinite(q) or not 0.0 < q <= 1.0:
            raise InvalidArgument(f"q_token_probs[{i}] = {q!r} is not in (0, 1]")
        if draft_kind == "deterministic" and q != 1.0:
            raise InvalidArgument(f"deterministic drafts have q = 1.0, got q_token_probs[{i}] = {q!r}")
    if q_dists is not None:
        _check_q_dists(q_dists, torch.as_tensor(list(draft_tokens), dtype=torch.long), q_probs, vocab)


def _check_q_dists(q_dists: torch.Tensor, ys: torch.Tensor, q_probs: Sequence[float], vocab: int) -> None:
    """q_dists ([k, vocab]) must be distributions that agree with q_probs at the drafts ys ([k])."""
    k = len(q_probs)
    if q_dists.shape != (k, vocab):
        raise InvalidArgument(f"q_dists has shape {tuple(q_dists.shape)}, expected ({k}, {vocab})")
    # one read-back: row minima (NaN propagates), row sums (inf propagates), q at the drafts
    at_draft = q_dists.gather(-1, ys[:, None])[:, 0]  # [k]
    mins, sums, at = torch.stack([q_dists.amin(-1), q_dists.sum(-1), at_draft]).tolist()  # [3, k]
    if not all(m >= 0 and math.isfinite(s) for m, s in zip(mins, sums, strict=True)):
        raise InvalidArgument("q_dists must be finite and non-negative")
    if any(abs(s - 1) > 1e-3 for s in sums):
        raise InvalidArgument(f"q_dists rows must sum to 1, got {sums}")
    if any(abs(a - float(q)) > 1e-4 + 1e-3 * float(q) for a, q in zip(at, q_probs, strict=True)):
        raise InvalidArgument("q_dists disagree with q_token_probs at the draft tokens")


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) ([vocab]); p itself when that has no mass (float error only)."""
    r = (p - q).clamp_min(0.0)
    return r if float(r.sum()) > RESIDUAL_EPS else p


def sample_residual(target_ids: Sequence[int] | torch.Tensor, target_probs: Sequence[float] | torch.Tensor,
                    q_full: torch.Tensor, seed: int, position: int) -> int:
    """The edge's half of a split residual: draw norm(max(0, p_j - q_j)) at `position`.

    p_j arrives sparse (its support); q_full is the edge's processed q_j ([vocab]). Tokens outside
    p_j's support have p = 0, so the residual lives on that support. Raises InvalidArgument on a
    malformed target_dist (lengths differ, ids outside q_full's vocabulary, p not a distribution).
    """
    ids = torch.as_tensor(target_ids, dtype=torch.long)  # [m]
    p = torch.as_tensor(target_probs, dtype=torch.float64)  # [m]
    vocab = q_full.size(-1)
    if q_full.dim() != 1 or ids.dim() != 1 or ids.shape != p.shape or ids.numel() == 0:
        raise InvalidArgument(f"target_dist needs matching non-empty ids and probs and q_full a [vocab] "
                              f"vector; got {tuple(ids.shape)}, {tuple(p.shape)}, {tuple(q_full.shape)}")
    lo, hi = ids.aminmax()
    if int(lo) < 0 or int(hi) >= vocab:
        raise InvalidArgument(f"target_dist ids must be in [0, {vocab})")
    p_sum = float(p.sum())
    if not (float(p.amin()) >= 0 and math.isfinite(p_sum) and p_sum > 0):  # NaN fails the first test
        raise InvalidArgument("target_dist probs must be finite, non-negative, with positive mass")
    r = _residual(p, q_full.to(torch.float64)[ids])  # [m]
    return int(ids[sample_index(r, position_uniform(seed, position, SAMPLE))])


def verify_round(p: torch.Tensor | TargetProbs, draft_tokens: Sequence[int], q_probs: Sequence[float], *,
                 seed: int, ctx_len: int, greedy: bool = False, correction: Correction = "strict",
                 draft_kind: DraftKind = "sampled", q_dists: torch.Tensor | None = None,
                 check_last: bool = False) -> VerifyOutcome:
    """Accept/reject k drafts against the processed target probabilities.

    p: [k + 1, vocab] processed target distributions at positions ctx_len + 1 .. ctx_len + k + 1
    ([k, vocab] with check_last: no bonus row), dense or as the forward left them (shared/target_probs.py).
    q_dists: optional [k, vocab] processed draft distributions (dense).
    """
    k = len(draft_tokens)
    rows = k if check_last else k + 1
    if check_last and k == 0:
        raise InvalidArgument("check_last needs at least one draft token")
    if isinstance(p, torch.Tensor):
        if p.dim() != 2 or p.shape[0] != rows:
            raise InvalidArgument(f"p has shape {tuple(p.shape)}, expected ({rows}, vocab)")
        if not (float(p.amin()) >= 0 and math.isfinite(float(p.sum()))):  # NaN fails the first test
            raise InvalidArgument("p must be finite and non-negative")
        p = TargetProbs.dense(p)
    vocab = p.shape[1]
    if p.rows != rows:
        raise InvalidArgument(f"p has shape {p.shape}, expected ({rows}, vocab)")
    check_draft(draft_tokens, q_probs, vocab, draft_kind)
    ys = [int(y) for y in draft_tokens]
    if q_dists is not None:
        _check_q_dists(q_dists, torch.as_tensor(ys, dtype=torch.long), q_probs, vocab)
        q_dists = q_dists.to(torch.float64)  # [k, vocab]

    if greedy:
        alphas = [1.0 if p.argmax(i) == ys[i] else 0.0 for i in range(k)]
    else:
        alphas = [min(1.0, p.at(i, ys[i]) / q_probs[i]) for i in range(k)]

    for i in range(k):
        pos = ctx_len + i + 1
        if greedy:
            if alphas[i] == 1.0:
                continue
            return VerifyOutcome(i, p.argmax(i), "correction", alphas=alphas)
        if position_uniform(seed, pos, COIN) < alphas[i]:
            continue
        u = position_uniform(seed, pos, SAMPLE)
        if correction == "shortcut":
            return VerifyOutcome(i, p.draw(i, u), "correction", alphas=alphas)
        if q_dists is not None:
            return VerifyOutcome(i, p.draw_residual(i, q_dists[i], u), "correction", alphas=alphas)
        if draft_kind == "deterministic":  # max(0, p_j - point mass on y_j) = p_j with y_j zeroed
            return VerifyOutcome(i, p.draw_without(i, ys[i], u), "correction", alphas=alphas)
        ids, probs = p.support(i)
        return VerifyOutcome(i, None, "residual", target_ids=torch.as_tensor(ids, dtype=torch.long),
                             target_probs=torch.as_tensor(probs, dtype=torch.float64), alphas=alphas)

    if check_last:
        return VerifyOutcome(k, None, "none", alphas=alphas)
    if greedy:
        return VerifyOutcome(k, p.argmax(k), "bonus", alphas=alphas)
    return VerifyOutcome(k, p.draw(k, position_uniform(seed, ctx_len + k + 1, SAMPLE)), "bonus", alphas=alphas)

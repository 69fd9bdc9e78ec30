"""The cost-model k controller: per round, the k with the most committed tokens per second.

A round drafts k tokens on the edge, sends them, the cloud verifies them in one target forward and
answers. It commits the accepted drafts plus one token (the correction, bonus or residual), so

    rate(k) = E[tokens](k) / (k t_draft + t_verify(k) + RTT)

    E[tokens](k) = 1 + sum_{j=1..k} prod_{i<j} a_i

where a_i is the probability that draft position i (0-based) is accepted given that every position
before it was (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192, with the per-position
acceptance instead of one alpha and the round trip added to the cost). The controller picks
argmax_k rate(k) over [k_min, k_max] after every verified round, from running estimates:

- a_i = (h_i + m a) / (n_i + m): h_i and n_i are exponentially decayed counts (factor
  1 - `alpha_weight` per verified round) of the rounds where position i was accepted and where it
  was reached (k > i and la >= i); a = (sum h + m0 a0) / (sum n + m0) is the pooled estimate over
  all positions, pulled to a0 = `prior_accept` by m0 = `prior_weight` observations (one unlucky
  first round does not read as "nothing is ever accepted"), and m = `prior_strength` pulls rarely
  reached positions to it.
- t_draft: the edge's drafting time per drafted token, ms (the round's drafting time on the critical
  path over the tokens drafted on it; tokens drafted ahead while the cloud verified are not counted),
  exponentially weighted (weight `cost_weight`). Rounds whose drafter first caught up on tokens it
  never drafted (the prompt, k = 0 rounds, local commits) are left out: the caller passes
  drafted_now = 0 for them. Until t_draft is measured, k stays where it is.
- t_verify(k) = v0 + v1 (k + 1): the cloud's forward plus queue time as it reports them in every
  answer, fitted by exponentially weighted least squares on the round's k + 1 verified positions,
  with a light ridge pull of v1 towards 0 so that rounds of one k alone (no slope to see) read as
  a flat cost; the fit corrects itself as soon as rounds of another k arrive. Its weight per round
  is `verify_weight`, lower than the others: the slope needs rounds of several k to be seen.
- RTT: the answer's wall time seen by the edge minus the cloud's reported time (the network and the
  serving stack), exponentially weighted (weight `cost_weight`).

With weights of 0.2-0.4 (memories of 3-5 rounds; 0.15 for the verify fit) the estimates follow a
change of link or acceptance within a few rounds (tests/edge/test_policy_k.py: a round trip going
from 1 to 80 ms moves k up within 8 rounds).
k = 0 (plain target decoding, one token per round) wins when acceptance is near 0 and drafting is
not free. It is taken only when its rate beats the best k >= 1 by `zero_margin` (a near tie is
not worth going blind for), and since a round with k = 0 observes no acceptance, after
`probe_every` such rounds the controller drafts once with the best k >= 1 to look again.

Clocks stay outside: the caller measures and feeds `observe(...)`, so tests inject any costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundCosts:
    # draft tokens verified in the round (k) and how many were accepted (La)
    k: int
    accepted_len: int
    # edge drafting time on the critical path, ms, and the draft tokens drafted on it
    draft_ms: float
    drafted_now: int
    # the verify exchange's wall time seen by the edge, ms
    exchange_ms: float
    # the cloud's reported target forward and queue time, ms
    cloud_ms: float


def _ewma(old: float | None, new: float, w: float) -> float:
    return new if old is None else (1 - w) * old + w * new


@dataclass
class CostModelK:
    # current k (the next round's)
    k: int = 4
    # the choice is made within [k_min, k_max]
    k_min: int = 0
    k_max: int = 12
    # weight of a new round in the acceptance estimates and of a new observation in the cost estimates
    alpha_weight: float = 0.2
    cost_weight: float = 0.4
    verify_weight: float = 0.15
    # acceptance assumed before any round, and the pull (in rounds) of each position to the pooled value
    prior_accept: float = 0.6
    prior_weight: float = 3.0
    prior_strength: float = 1.0
    # k = 0 only when its rate is this much above the best k >= 1's; after probe_every rounds at
    # k = 0, one round drafts the best k >= 1 to re-measure acceptance
    zero_margin: float = 0.1
    probe_every: int = 4
    # ridge weight pulling the verify slope v1 to 0 (in units of one round's weight)
    ridge: float = 0.05
    # per position: decayed counts of rounds that accepted it (hits) and that reached it
    hits: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    # running cost estimates, ms (None until measured)
    t_draft_ms: float | None = None
    rtt_ms: float | None = None
    # exponentially weighted sums of the verify fit: weight, x, y, x^2, x y (x = k + 1, y = ms)
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)
    # rounds run at k = 0 since the last probe
    _zero_rounds: int = 0
    # the caller says: False -> k never changes (kept for KController's interface)
    dynamic: bool = True

    # -- estimates ------------------------------------------------------------------------------

    @property
    def pooled_accept(self) -> float:
        n = sum(self.reached) + self.prior_weight
        return (sum(self.hits) + self.prior_weight * self.prior_accept) / n if n > 1e-9 else self.prior_accept

    def accept_at(self, i: int) -> float:
        """a_i, the estimated acceptance of draft position i given all before it accepted."""
        a, m = self.pooled_accept, self.prior_strength
        if i >= len(self.reached) or self.reached[i] + m <= 1e-9:
            return a
        return (self.hits[i] + m * a) / (self.reached[i] + m)

    def expected_tokens(self, k: int) -> float:
        """E[tokens](k) = 1 + sum_{j=1..k} prod_{i<j} a_i."""
        total, run = 1.0, 1.0
        for i in range(k):
            run *= self.accept_at(i)
            total += run
        return total

    def verify_ms(self, k: int) -> float:
        """t_verify(k) = v0 + v1 (k + 1) from the weighted fit (0 before any answer)."""
        w, sx, sy, sxx, sxy = self._fit
        if w <= 0:
            return 0.0
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        cov = sxy / w - mx * my
        slope = max(0.0, cov / (var + self.ridge / w))  # a cost does not fall with more positions
        return max(0.0, my + slope * (k + 1 - mx))

    def round_ms(self, k: int) -> float:
        """Predicted wall time of a round of k drafts: k t_draft + t_verify(k) + RTT."""
        return k * (self.t_draft_ms or 0.0) + self.verify_ms(k) + (self.rtt_ms or 0.0)

    def rate(self, k: int) -> float:
        """Expected committed tokens per ms with k drafts (inf while nothing is measured)."""
        ms = self.round_ms(k)
        return self.expected_tokens(k) / ms if ms > 0 else float("inf")

    def best_k(self) -> int:
        lo, hi = max(0, self.k_min), max(self.k_min, self.k_max)
        if self.t_draft_ms is None or self.round_ms(hi) <= 0:  # costs not measured yet: no reason to move
            return min(max(self.k, lo), hi)
        best = -max((self.rate(k), -k) for k in range(max(lo, 1), hi + 1))[1]  # ties go to the smaller k
        if lo == 0 and (hi == 0 or self.rate(0) > (1 + self.zero_margin) * self.rate(best)):
            return 0
        return best

    def best_positive_k(self) -> int:
        lo, hi = max(1, self.k_min), max(1, self.k_min, self.k_max)
        return -max((self.rate(k), -k) for k in range(lo, hi + 1))[1]

    # -- updates --------------------------------------------------------------------------------

    def _observe_acceptance(self, k: int, accepted_len: int) -> None:
        keep = 1 - self.alpha_weight
        self.hits = [h * keep for h in self.hits]
        self.reached = [n * keep for n in self.reached]
        while len(self.reached) < k:
            self.hits.append(0.0)
            self.reached.append(0.0)
        for i in range(min(k, accepted_len + 1)):  # positions reached: 0..la (la < k), or all k
            self.reached[i] += 1.0
            self.hits[i] += float(i < accepted_len)

    def _observe_verify(self, k: int, cloud_ms: float) -> None:
        keep = 1 - self.verify_weight
        x, y = float(k + 1), float(cloud_ms)
        f = self._fit
        for j, v in enumerate((1.0, x, y, x * x, x * y)):
            f[j] = keep * f[j] + v

    def observe(self, c: RoundCosts) -> int:
        """Feed one verified round; returns the next k."""
        if c.k > 0:
            self._observe_acceptance(c.k, c.accepted_len)
        if c.drafted_now > 0:
            self.t_draft_ms = _ewma(self.t_draft_ms, max(0.0, c.draft_ms) / c.drafted_now, self.cost_weight)
        self._observe_verify(c.k, max(0.0, c.cloud_ms))
        self.rtt_ms = _ewma(self.rtt_ms, max(0.0, c.exchange_ms - c.cloud_ms), self.cost_weight)
        if not self.dynamic:
            return self.k
        self.k = self.best_k()
        if self.k == 0:
            self._zero_rounds += 1
            if self._zero_rounds > self.probe_every:
                self._zero_rounds = 0
                self.k = self.best_positive_k()
        else:
            self._zero_rounds = 0
        return self.k

    def update(self, k: int, accepted_len: int) -> int:
        """KController's interface: acceptance only (costs come through `observe`)."""
        return self.k


# --- fixed k, or k moved by one step on the last round's la/k (the "dynamic" policy) ---------------------

@dataclass
class KController:
    # current k
    k: int = 6
    # bounds of the dynamic k
    k_min: int = 3
    k_max: int = 12
    # la/k >= up_at -> k + 1; la/k <= down_at -> k - 1
    up_at: float = 0.8
    down_at: float = 0.4
    # False: k never changes
    dynamic: bool = True

    def update(self, k: int, accepted_len: int) -> int:
        """Feed one verified round (its k and La); returns the next k."""
        if not self.dynamic or k <= 0:
            return self.k
        ratio = accepted_len / k
        if ratio >= self.up_at:
            self.k = min(self.k + 1, self.k_max)
        elif ratio <= self.down_at:
            self.k = max(self.k - 1, self.k_min)
        return self.k

    def observe(self, c: RoundCosts) -> int:
        """The cost controller's interface: only k and La are used here."""
        return self.update(c.k, c.accepted_len)

"""What speculative decoding should give, from measured acceptance and costs (Leviathan et al. 2023,
https://arxiv.org/abs/2211.17192, section 3).

Words: a round drafts k tokens; the target checks them in one forward and keeps the first La
(0..k), then adds one token of its own (correction or bonus), so a round yields La + 1 tokens.

- a: per-position acceptance, the chance that a draft token is kept once the check reaches it.
  Estimated from rounds (k_r, La_r) as a = sum La / sum min(La + 1, k) (the maximum-likelihood
  estimate when every position is kept independently with probability a).
- tokens per round: E[La + 1] = (1 - a^(k+1)) / (1 - a)  (k + 1 when a = 1).
- c = t_draft / t_target: one draft forward over one target forward.
- walltime bound: speedup <= (1 - a^(k+1)) / ((1 - a)(k c + 1)).
- with a network: a round also waits one round trip, so with r = rtt / t_target
  speedup = (1 - a^(k+1)) / ((1 - a)(k c + 1 + r)) against target-only decoding that costs
  t_target per token and no round trip per token (one request for the whole text).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def tokens_per_round(a: float, k: int) -> float:
    """Expected tokens a round yields, accepted + the target's own: (1 - a^(k+1)) / (1 - a)."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_accepted_len(a: float, k: int) -> float:
    """E[La]: expected accepted draft tokens per round = tokens_per_round - 1."""
    return tokens_per_round(a, k) - 1.0


def speedup_bound(a: float, k: int, c: float, r: float = 0.0) -> float:
    """(1 - a^(k+1)) / ((1 - a)(k c + 1 + r)); r = rtt / t_target (0: the paper's bound)."""
    if c < 0 or r < 0:
        raise ValueError("cost ratios must be >= 0")
    return tokens_per_round(a, k) / (k * c + 1.0 + r)


def estimate_acceptance(rounds: Iterable[tuple[int, int]]) -> float:
    """a from verified rounds (k, La): accepted / checked, checked = min(La + 1, k) per round."""
    accepted = checked = 0
    for k, la in rounds:
        if not 0 <= la <= k:
            raise ValueError(f"accepted_len {la} outside [0, {k}]")
        accepted += la
        checked += min(la + 1, k)
    return accepted / checked if checked else 0.0


def per_position_acceptance(rounds: Iterable[tuple[int, int]], k_max: int) -> list[float | None]:
    """a_i for i = 1..k_max: of the rounds whose check reached draft position i, the share that kept it.

    None where no round reached position i.
    """
    reached = [0] * k_max
    kept = [0] * k_max
    for k, la in rounds:
        for i in range(1, min(la + 1, k, k_max) + 1):
            reached[i - 1] += 1
            kept[i - 1] += int(i <= la)
    return [kp / rc if rc else None for kp, rc in zip(kept, reached, strict=True)]


def predicted_tokens_per_round(a: float, ks: Sequence[int]) -> float:
    """Mean over rounds of tokens_per_round(a, k_r): the prediction when k changes between rounds."""
    if not ks:
        return 0.0
    return sum(tokens_per_round(a, k) for k in ks) / len(ks)


def predicted_speedup(a: float, ks: Sequence[int], t_draft_ms: float, t_target_ms: float,
                      rtt_ms: float = 0.0) -> float:
    """Ideal speedup over target-only decoding for rounds of sizes `ks`.

    Tokens per round over time per round, against t_target per token:
    mean_r[(1 - a^(k_r+1)) / (1 - a)] * t_target / mean_r[k_r t_draft + t_target + rtt].
    With one fixed k this is speedup_bound(a, k, t_draft / t_target, rtt / t_target).
    """
    if not ks or t_target_ms <= 0:
        return 0.0
    per_round_ms = sum(k * t_draft_ms + t_target_ms + rtt_ms for k in ks) / len(ks)
    return predicted_tokens_per_round(a, ks) * t_target_ms / per_round_ms


def predicted_speedup_end_to_end(a: float, ks: Sequence[int], t_draft_ms: float, t_target_ms: float,
                                 rtt_ms: float, prefill_ms: float, n_tokens: float) -> float:
    """predicted_speedup for whole generations of n_tokens after a prompt whose prefill takes prefill_ms.

    cloud_only:  prefill + n t_target + rtt                   (one request)
    speculative: prefill + 2 rtt + n / E[tokens/round] * mean_r[k_r t_draft + t_target + rtt]
                 (open and close cost a round trip each)
    Tends to predicted_speedup as n grows.
    """
    if not ks or n_tokens <= 0:
        return 0.0
    per_round_ms = sum(k * t_draft_ms + t_target_ms + rtt_ms for k in ks) / len(ks)
    rounds = n_tokens / predicted_tokens_per_round(a, ks)
    cloud_only_ms = prefill_ms + n_tokens * t_target_ms + rtt_ms
    return cloud_only_ms / (prefill_ms + 2 * rtt_ms + rounds * per_round_ms)

"""The speedup formulas of bench/theory.py: closed forms, the paper's numbers, and the estimator of a."""

from __future__ import annotations

import random

import pytest

from bench.theory import (
    estimate_acceptance,
    expected_accepted_len,
    per_position_acceptance,
    predicted_speedup,
    predicted_speedup_end_to_end,
    predicted_tokens_per_round,
    speedup_bound,
    tokens_per_round,
)


def simulate_rounds(a: float, k: int, n: int, seed: int) -> list[tuple[int, int]]:
    """n rounds of k draft tokens, each kept with probability a until the first rejection."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(n):
        la = 0
        while la < k and rng.random() < a:
            la += 1
        rounds.append((k, la))
    return rounds


def test_tokens_per_round_matches_the_paper_example() -> None:
    # alpha = 0.8, gamma = 3: (1 - 0.8^4) / 0.2 = 2.952
    assert tokens_per_round(0.8, 3) == pytest.approx(2.952)
    assert expected_accepted_len(0.8, 3) == pytest.approx(1.952)


def test_tokens_per_round_edges() -> None:
    assert tokens_per_round(0.0, 5) == 1.0
    assert tokens_per_round(1.0, 5) == 6.0
    assert tokens_per_round(0.999999, 5) == pytest.approx(6.0, rel=1e-4)
    assert tokens_per_round(0.5, 0) == 1.0
    with pytest.raises(ValueError):
        tokens_per_round(1.5, 3)
    with pytest.raises(ValueError):
        tokens_per_round(0.5, -1)


def test_speedup_bound_matches_the_paper_example() -> None:
    # alpha = 0.75, gamma = 7, c = 0.02: (1 - 0.75^8) / (0.25 * 1.14) = 3.16
    assert speedup_bound(0.75, 7, 0.02) == pytest.approx((1 - 0.75**8) / (0.25 * 1.14))
    assert speedup_bound(0.75, 7, 0.02) == pytest.approx(3.16, abs=0.01)


def test_round_trip_lowers_the_bound() -> None:
    assert speedup_bound(0.8, 4, 0.1, r=2.0) < speedup_bound(0.8, 4, 0.1)
    assert speedup_bound(0.8, 4, 0.1, r=2.0) == pytest.approx(tokens_per_round(0.8, 4) / (0.4 + 1 + 2.0))


def test_predicted_speedup_with_one_k_is_the_bound() -> None:
    got = predicted_speedup(0.7, [4, 4, 4], t_draft_ms=1.0, t_target_ms=5.0, rtt_ms=10.0)
    assert got == pytest.approx(speedup_bound(0.7, 4, c=0.2, r=2.0))


def test_predicted_tokens_per_round_averages_over_k() -> None:
    assert predicted_tokens_per_round(0.5, [1, 3]) == pytest.approx((1.5 + 1.875) / 2)
    assert predicted_tokens_per_round(0.5, []) == 0.0


def test_estimate_acceptance_recovers_a_from_simulated_rounds() -> None:
    """Statistical: 20,000 simulated rounds (seeds 1-3) per a in {0.3, 0.6, 0.9}, k = 4; the
    estimate must be within 0.01 of a (its standard error is < 0.005). The naive accepted / drafted
    (every drafted position counted, also those after the first rejection) misses by more than
    0.05 for each a, which shows the test can tell an estimator that ignores truncation."""
    for seed, a in enumerate((0.3, 0.6, 0.9), start=1):
        rounds = simulate_rounds(a, 4, 20_000, seed)
        assert estimate_acceptance(rounds) == pytest.approx(a, abs=0.01)
        naive = sum(la for _, la in rounds) / sum(k for k, _ in rounds)
        assert abs(naive - a) > 0.05


def test_measured_tokens_per_round_match_the_formula_in_simulation() -> None:
    """Statistical: 20,000 simulated rounds, a = 0.7, k = 5, seed 7: mean La + 1 within 0.03 of
    (1 - a^6) / (1 - a) = 2.94 (standard error ~0.012)."""
    rounds = simulate_rounds(0.7, 5, 20_000, seed=7)
    mean_tokens = sum(la + 1 for _, la in rounds) / len(rounds)
    assert mean_tokens == pytest.approx(tokens_per_round(0.7, 5), abs=0.03)


def test_per_position_acceptance_counts_only_reached_positions() -> None:
    # k = 3: La = 3 reaches 1..3 (all kept); La = 1 reaches 1, 2 (keeps 1); La = 0 reaches 1
    got = per_position_acceptance([(3, 3), (3, 1), (3, 0)], k_max=4)
    assert got == [pytest.approx(2 / 3), pytest.approx(1 / 2), 1.0, None]


def test_estimate_acceptance_rejects_impossible_rounds() -> None:
    with pytest.raises(ValueError):
        estimate_acceptance([(2, 3)])
    assert estimate_acceptance([]) == 0.0
    # k = 0 rounds (nothing drafted) do not count
    assert estimate_acceptance([(0, 0), (2, 2)]) == 1.0


def test_end_to_end_prediction_tends_to_the_per_round_bound() -> None:
    args = (0.7, [4, 4], 1.0, 5.0, 3.0)
    per_round = predicted_speedup(*args)
    short = predicted_speedup_end_to_end(*args, prefill_ms=200.0, n_tokens=16)
    long = predicted_speedup_end_to_end(*args, prefill_ms=200.0, n_tokens=1e7)
    assert long == pytest.approx(per_round, rel=1e-4)
    # a prefill both sides pay pulls the ratio towards 1
    assert abs(short - 1) < abs(per_round - 1)


def test_end_to_end_prediction_by_hand() -> None:
    # a = 0.5, k = 2: 1.75 tokens per round; round 2*1 + 4 + 2 = 8 ms; 7 tokens -> 4 rounds
    got = predicted_speedup_end_to_end(0.5, [2], 1.0, 4.0, 2.0, prefill_ms=10.0, n_tokens=7)
    assert got == pytest.approx((10 + 7 * 4 + 2) / (10 + 2 * 2 + 4 * 8))

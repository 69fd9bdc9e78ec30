"""The cost-model k controller on simulated rounds with injected costs (no clocks, no timing).

A simulated round: position i is accepted with probability alpha (seeded), La = the first
rejection; the edge spends k t_draft drafting, the cloud v0 + v1 (k + 1), the link rtt. The
controller sees only those measurements, as the edge feeds them.
"""

from __future__ import annotations

import random

import pytest

from edge.policy.k import CostModelK, RoundCosts


def true_rate(k: int, alpha: float, t_draft: float, v0: float, v1: float, rtt: float) -> float:
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * t_draft + v0 + v1 * (k + 1) + rtt)


def run(ctl: CostModelK, rounds: int, alpha: float, t_draft: float, v0: float, v1: float, rtt: float,
        seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    ks = []
    for _ in range(rounds):
        k = ctl.k
        la = 0
        while la < k and rng.random() < alpha:
            la += 1
        cloud = v0 + v1 * (k + 1)
        ctl.observe(RoundCosts(k=k, accepted_len=la, draft_ms=k * t_draft, drafted_now=k,
                               exchange_ms=cloud + rtt, cloud_ms=cloud))
        ks.append(ctl.k)
    return ks


def best(alpha: float, t_draft: float, v0: float, v1: float, rtt: float, k_max: int = 12) -> float:
    return max(true_rate(k, alpha, t_draft, v0, v1, rtt) for k in range(k_max + 1))


def settled_rate(ks: list[int], alpha: float, t_draft: float, v0: float, v1: float, rtt: float) -> float:
    """Mean true rate of the k chosen over the last 20 rounds."""
    tail = ks[-20:]
    return sum(true_rate(k, alpha, t_draft, v0, v1, rtt) for k in tail) / len(tail)


def test_expensive_verify_positions_and_no_round_trip_give_a_small_k() -> None:
    # each verified position costs more than drafting it and there is no round trip: one draft pays best
    params = dict(alpha=0.8, t_draft=1.0, v0=4.0, v1=3.0, rtt=0.0)
    assert max(range(13), key=lambda k: true_rate(k, **params)) in (1, 2)
    ks = run(CostModelK(k=6), 60, **params)
    assert max(ks[-20:]) <= 3
    assert settled_rate(ks, **params) >= 0.95 * best(**params)


def test_a_dominant_round_trip_with_high_acceptance_gives_a_large_k() -> None:
    params = dict(alpha=0.85, t_draft=1.0, v0=10.0, v1=0.5, rtt=100.0)
    ks = run(CostModelK(k=2), 60, **params)
    assert min(ks[-20:]) >= 8
    assert settled_rate(ks, **params) >= 0.95 * best(**params)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k_follows_a_change_of_link_within_a_few_rounds(seed: int) -> None:
    ctl = CostModelK(k=4)
    lan = dict(alpha=0.7, t_draft=3.0, v0=5.0, v1=2.0, rtt=1.0)
    wan = dict(lan, rtt=80.0)
    ks_lan = run(ctl, 40, **lan, seed=seed)
    ks_wan = run(ctl, 8, **wan, seed=seed + 10)
    assert ks_wan[-1] > max(ks_lan[-10:])
    assert true_rate(ks_wan[-1], **wan) >= 0.9 * best(**wan)


def test_useless_drafts_fall_to_k_zero_and_probe_again() -> None:
    ctl = CostModelK(k=4, probe_every=5)
    ks = run(ctl, 40, alpha=0.0, t_draft=5.0, v0=5.0, v1=1.0, rtt=1.0)
    assert ks[-10:].count(0) >= 7
    assert any(k > 0 for k in ks[10:])  # a probe round after a stretch at k = 0


def test_expected_tokens_use_per_position_acceptance() -> None:
    ctl = CostModelK(prior_strength=0.0, prior_weight=0.0)
    ctl.observe(RoundCosts(k=3, accepted_len=1, draft_ms=3, drafted_now=3, exchange_ms=10, cloud_ms=5))
    # position 0 accepted (a_0 = 1), position 1 rejected (a_1 = 0), position 2 not reached (pooled 1/2)
    assert ctl.accept_at(0) == 1.0 and ctl.accept_at(1) == 0.0 and ctl.accept_at(2) == 0.5
    assert ctl.expected_tokens(3) == pytest.approx(2.0)
    assert ctl.rtt_ms == pytest.approx(5.0) and ctl.t_draft_ms == pytest.approx(1.0)


def test_fixed_controller_ignores_costs() -> None:
    ctl = CostModelK(k=5, dynamic=False)
    ks = run(ctl, 10, alpha=0.0, t_draft=50.0, v0=1.0, v1=1.0, rtt=0.0)
    assert set(ks) == {5}


def test_k_stays_until_drafting_is_measured() -> None:
    ctl = CostModelK(k=6)
    ctl.observe(RoundCosts(k=6, accepted_len=6, draft_ms=900, drafted_now=0, exchange_ms=50, cloud_ms=10))
    assert ctl.k == 6 and ctl.t_draft_ms is None


def test_the_run_hides_catch_up_drafting_from_the_controller(make_client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The first round (the prompt's pass) and rounds after a k = 0 round feed no drafting time."""
    seen: list[tuple[int, int]] = []
    real = CostModelK.observe

    def spy(self: CostModelK, c: RoundCosts) -> int:
        seen.append((c.k, c.drafted_now))
        return real(self, c)

    monkeypatch.setattr(CostModelK, "observe", spy)
    schedule = iter([0, 2, 2, 0, 3, 1] * 20)  # k chosen by script, not by the clock
    monkeypatch.setattr(CostModelK, "best_k", lambda self: next(schedule))
    client, _ = make_client(temperature=0, max_new_tokens=40, draft_ahead=False)
    client.generate("The cat sat on the mat. The cat")
    assert seen[0][1] == 0
    for (k_prev, _), (_, drafted_now) in zip(seen, seen[1:], strict=False):
        if k_prev == 0:
            assert drafted_now == 0
    assert any(d > 0 for _, d in seen)
    assert any(k == 0 for k, _ in seen[:-1]), "no k = 0 round to check: pick another prompt"

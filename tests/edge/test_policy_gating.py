"""Uncertainty gating: per-token hard mask, block decision, rule triggers."""

from __future__ import annotations

from edge.drafters.base import DraftBlock
from edge.policy.gating import GateThresholds, decide, hard_mask, rule_triggered

TH = GateThresholds(t_nll=2.0, t_entropy_bits=2.5, t_margin=0.2, t_mc_var=0.01, r_hard=0.3)


def block(nll: list[float], ent: list[float], margin: list[float], mc: list[float] | None = None) -> DraftBlock:
    k = len(nll)
    return DraftBlock(tokens=list(range(k)), q_probs=[0.5] * k, kind="sampled", nll=nll, entropy_bits=ent,
                      margin=margin, mc_var=mc)


def test_each_signal_alone_marks_a_token_hard() -> None:
    b = block(nll=[0.1, 3.0, 0.1, 0.1, 0.1], ent=[1.0, 1.0, 3.0, 1.0, 1.0], margin=[0.5, 0.5, 0.5, 0.1, 0.5],
              mc=[0.0, 0.0, 0.0, 0.0, 0.5])
    assert hard_mask(b, TH) == [0, 1, 1, 1, 1]


def test_easy_block_stays_local_and_hard_block_goes_to_the_cloud() -> None:
    easy = block(nll=[0.1] * 4, ent=[1.0] * 4, margin=[0.6, 0.6, 0.6, 0.1])  # hard_ratio 0.25 <= 0.3
    d = decide(easy, "the cat sat", TH)
    assert d.hard_ratio == 0.25 and not d.to_cloud and not d.triggered
    hard = block(nll=[0.1, 3.0, 3.0], ent=[1.0] * 3, margin=[0.6] * 3)  # 2/3 > 0.3
    assert decide(hard, "the cat sat", TH).to_cloud


def test_digits_dates_and_amounts_always_go_to_the_cloud() -> None:
    easy = block(nll=[0.1] * 3, ent=[1.0] * 3, margin=[0.9] * 3)
    for text in ("costs 42", "on 3/4", "in March", "$ to spend", "50%"):
        assert rule_triggered(text), text
        d = decide(easy, text, TH)
        assert d.triggered and d.to_cloud
    assert not rule_triggered("maybe marching on")
    assert not decide(easy, "costs 42", TH, rules=False).to_cloud


def test_a_drafter_without_signals_always_goes_to_the_cloud() -> None:
    b = DraftBlock(tokens=[1, 2], q_probs=[1.0, 1.0], kind="deterministic")
    d = decide(b, "ab", TH)
    assert d.hard_mask == [1, 1] and d.to_cloud

"""Round control: dynamic k moves by one on la/k within its bounds; fixed k never moves."""

from __future__ import annotations

from edge.policy.k import KController


def test_dynamic_k_grows_on_high_and_shrinks_on_low_acceptance() -> None:
    c = KController(k=6, k_min=3, k_max=12)
    assert c.update(6, 5) == 7  # 0.83 >= 0.8
    assert c.update(7, 4) == 7  # 0.57: unchanged
    assert c.update(7, 2) == 6  # 0.29 <= 0.4
    assert c.update(6, 0) == 5


def test_dynamic_k_stays_within_bounds() -> None:
    c = KController(k=11, k_min=3, k_max=12)
    for _ in range(5):
        c.update(c.k, c.k)
    assert c.k == 12
    for _ in range(20):
        c.update(c.k, 0)
    assert c.k == 3


def test_fixed_k_and_empty_rounds_leave_k_alone() -> None:
    c = KController(k=4, dynamic=False)
    assert c.update(4, 4) == 4 and c.update(4, 0) == 4
    d = KController(k=6)
    assert d.update(0, 0) == 6  # an n-gram round with nothing to propose says nothing about k

"""shared.rng: uniforms keyed by (seed, position, stream), and the inverse-CDF draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import kstest, pearsonr

from shared.rng import COIN, SAMPLE, position_uniform, sample_index

MASK = 2**64 - 1


def reference_uniform(seed: int, position: int, stream: int) -> float:
    """The formula in shared.rng's docstring, written out independently."""
    def splitmix64(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)

    h = splitmix64(splitmix64(splitmix64(seed % 2**64) ^ position) ^ stream)
    return (h >> 11) / 2**53


@pytest.mark.parametrize(("seed", "position", "stream"),
                         [(0, 0, COIN), (0, 0, SAMPLE), (1234, 17, COIN), (2**63 + 5, 10**9, SAMPLE), (-1, 3, COIN)])
def test_uniform_follows_the_documented_formula(seed: int, position: int, stream: int) -> None:
    assert position_uniform(seed, position, stream) == reference_uniform(seed, position, stream)


def test_uniform_is_a_pure_function_of_seed_position_stream() -> None:
    a = [position_uniform(s, t, c) for s in range(5) for t in range(20) for c in (COIN, SAMPLE)]
    b = [position_uniform(s, t, c) for s in range(5) for t in range(20) for c in (COIN, SAMPLE)]
    assert a == b and len(set(a)) == len(a)
    assert all(0.0 <= u < 1.0 for u in a)


def test_uniforms_are_uniform_and_streams_independent() -> None:
    """KS test against U(0, 1) at 0.001 over 20,000 (seed, position) keys, for each stream and
    along positions of one seed; |Pearson r| between COIN and SAMPLE at the same key and between
    adjacent seeds stays below 0.03 (4 standard errors at n = 20,000)."""
    n = 20_000
    coin = np.array([position_uniform(1000 + i, 5, COIN) for i in range(n)])
    sample = np.array([position_uniform(1000 + i, 5, SAMPLE) for i in range(n)])
    along = np.array([position_uniform(77, t, COIN) for t in range(n)])
    for u in (coin, sample, along):
        assert kstest(u, "uniform").pvalue > 1e-3
    assert abs(pearsonr(coin, sample)[0]) < 0.03
    assert abs(pearsonr(coin[:-1], coin[1:])[0]) < 0.03


def test_sample_index_is_the_inverse_cdf() -> None:
    probs = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])  # unnormalised, total 4
    assert sample_index(probs, 0.0) == 1
    assert sample_index(probs, 0.4999) == 1
    assert sample_index(probs, 0.5) == 3
    assert sample_index(probs, 0.7499) == 3
    assert sample_index(probs, 0.75) == 4
    assert sample_index(probs, 1.0 - 2**-53) == 4  # never the trailing zero-mass entry


def test_sample_index_never_lands_on_zero_mass() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        probs = torch.rand(12, generator=g, dtype=torch.float64) * (torch.rand(12, generator=g) > 0.6)
        if probs.sum() == 0:
            continue
        for u in (0.0, 1e-300, 0.5, 1 - 1e-16, 1 - 2**-53, float(torch.rand((), generator=g))):
            assert probs[sample_index(probs, u)] > 0

"""Seeded randomness by position, so a replayed round draws the same coins.

Each absolute position t of the text has two independent streams: COIN (the accept/reject
uniform) and SAMPLE (the uniform that picks a correction, bonus or residual token). Keeping them
apart matters: the residual must not be drawn with the very uniform that caused the rejection.

The uniform is plain integer arithmetic, so any client in any language can reproduce it:
h = splitmix64(splitmix64(splitmix64(seed) ^ position) ^ stream) (64-bit wrap-around, `seed`
taken mod 2^64), u = (h >> 11) / 2^53.
"""

from __future__ import annotations

import torch

COIN = 0
SAMPLE = 1
_MASK = (1 << 64) - 1
_TWO_POW_M53 = 2.0**-53


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int, stream: int) -> float:
    """A uniform in [0, 1) fixed by (seed, position, stream): the top 53 bits of a splitmix64 hash."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK) ^ (position & _MASK)) ^ (stream & _MASK))
    return (h >> 11) * _TWO_POW_M53


def sample_index(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from an unnormalised non-negative vector `probs` ([n]) with uniform `u`."""
    cdf = probs.to(torch.float64).cumsum(0)  # [n]
    idx = min(int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True)), probs.numel() - 1)
    while idx > 0 and float(probs[idx]) <= 0:  # never land on a zero-mass entry at the float edge
        idx -= 1
    return idx

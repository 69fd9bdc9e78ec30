"""The feature encodings (shared/features.py): one state and a window of states follow one rule."""

from __future__ import annotations

import pytest
import torch

from shared.features import ENCODINGS, decode_feature, decode_states, encode_feature, encode_states


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_state_that_is_not_finite_is_refused_alone_or_in_a_window(encoding: str, bad: float) -> None:
    """A NaN maximum used to pass `or 1.0` (NaN is truthy) and go out as a NaN scale; now the single
    state is refused as the window of states is."""
    h = torch.randn(2, 16)  # [n, d]
    h[1, 3] = bad
    with pytest.raises(ValueError, match="not finite"):
        encode_states(h, encoding, 0)
    with pytest.raises(ValueError, match="not finite"):
        encode_feature(h[1], encoding, 1)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_one_state_encodes_as_it_does_in_a_window(encoding: str) -> None:
    """The same vector, alone or as a window's row, gives the same bytes and scale (an all-zero one: scale 1)."""
    h = torch.randn(3, 16) * 40.0  # [n, d]
    h[2] = 0.0
    states = encode_states(h, encoding, 5)
    width = len(states.data) // 3
    for i in range(3):
        f = encode_feature(h[i], encoding, 5 + i)
        assert f.data == states.data[i * width:(i + 1) * width]
        if encoding == "int8":
            assert f.scale == pytest.approx(states.scales[i], rel=1e-6)
        assert torch.allclose(decode_feature(f), decode_states(states)[i])
    if encoding == "int8":
        assert encode_feature(h[2], encoding, 7).scale == 1.0

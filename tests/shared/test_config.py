"""SamplingConfig: validation at the boundary, greedy flag, dict round trip."""

from __future__ import annotations

import math

import pytest

from shared.config import SamplingConfig
from shared.errors import InvalidArgument


def test_defaults_disable_every_transformation() -> None:
    cfg = SamplingConfig()
    assert cfg.to_dict() == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
    assert not cfg.greedy


def test_temperature_zero_means_greedy() -> None:
    assert SamplingConfig(temperature=0.0).greedy and SamplingConfig(temperature=0).greedy
    assert not SamplingConfig(temperature=1e-6).greedy


def test_dict_round_trip() -> None:
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.1)
    assert SamplingConfig.from_dict(cfg.to_dict()) == cfg
    assert SamplingConfig.from_dict(None) == SamplingConfig() == SamplingConfig.from_dict({})
    assert SamplingConfig.from_dict({"top_k": 5}) == SamplingConfig(top_k=5)


@pytest.mark.parametrize("fields", [
    {"temperature": -0.1}, {"temperature": math.nan}, {"temperature": math.inf},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": math.nan},
    {"top_k": -1}, {"top_k": 2.5}, {"top_k": True},
    {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0}, {"repetition_penalty": math.inf},
    {"temperature": "hot"}, {"temperature": None}, {"top_p": False},
    {"nucleus": 0.9},
])
def test_bad_sampling_config_raises_invalid_argument(fields: dict) -> None:
    with pytest.raises(InvalidArgument) as err:
        SamplingConfig.from_dict(fields)
    assert err.value.http_status == 422 and err.value.message


def test_configs_are_frozen_and_hashable() -> None:
    cfg = SamplingConfig(top_k=3)
    with pytest.raises(AttributeError):
        cfg.top_k = 4  # type: ignore[misc]
    assert len({cfg, SamplingConfig(top_k=3)}) == 1

"""Every accepted SamplingConfig gives finite distributions; what would not is refused, naming the field.

Property test: configs drawn at the edges of the accepted ranges (the bounds themselves, just
inside them, and typical values), crossed with logits from seeded generators at scales 1, 1e2, 1e4
and 6e4 (the float16 range), with ties and a context that triggers the repetition penalty. Sample:
every combination of the extreme values below (5 x 4 x 4 x 4 = 320 configs) x 4 logit scales and an
all-tied case; threshold: every processed row is finite, non-negative and sums to 1 within 1e-4.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from shared.config import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingConfig,
)
from shared.errors import InvalidArgument
from shared.sampling import processed_probs

TEMPERATURES = [0.0, MIN_TEMPERATURE, MIN_TEMPERATURE * 1.5, 1.0, MAX_TEMPERATURE]
TOP_PS = [MIN_TOP_P, MIN_TOP_P * 3, 0.5, 1.0]
TOP_KS = [0, 1, 7, 10**9]
PENALTIES = [MIN_REPETITION_PENALTY, 0.5, 1.0, MAX_REPETITION_PENALTY]


def logits_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    out = []
    for scale in (1.0, 1e2, 1e4, 6e4):
        x = torch.randn(3, 50, generator=g) * scale  # [3, vocab]
        x[1, :10] = x[1].max()  # a tie at the top
        out.append(x)
    out.append(torch.zeros(3, 50))  # all tied
    return out


def test_no_accepted_config_gives_non_finite_probabilities() -> None:
    context, draft = [1, 2, 3, 4, 5], [6, 7]
    cases = logits_cases()
    for t, p, k, r in itertools.product(TEMPERATURES, TOP_PS, TOP_KS, PENALTIES):
        cfg = SamplingConfig(temperature=t, top_p=p, top_k=k, repetition_penalty=r)
        for logits in cases:
            probs = processed_probs(logits[: len(draft) + 1], cfg, context, draft)  # [k + 1, vocab]
            assert torch.isfinite(probs).all() and (probs >= 0).all(), cfg
            assert torch.allclose(probs.sum(-1), torch.ones(probs.size(0)), atol=1e-4), cfg


@pytest.mark.parametrize("field, value", [
    ("temperature", 1e-40), ("temperature", MIN_TEMPERATURE / 2), ("temperature", MAX_TEMPERATURE * 2),
    ("temperature", 1e300), ("top_p", 1e-300), ("top_p", MIN_TOP_P / 2),
    ("repetition_penalty", 1e-300), ("repetition_penalty", MIN_REPETITION_PENALTY / 2),
    ("repetition_penalty", MAX_REPETITION_PENALTY * 2), ("repetition_penalty", math.inf),
])
def test_configs_that_could_overflow_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(InvalidArgument) as e:
        SamplingConfig(**{field: value})
    assert e.value.http_status == 422 and e.value.message.startswith(field)


def test_the_refused_values_would_indeed_break_processing() -> None:
    """Why the bounds exist: just the processing (no validation) of the probe's values is not finite."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 10  # [1, vocab]
    for field, value in [("temperature", 1e-40), ("top_p", 1e-300), ("repetition_penalty", 1e-300)]:
        cfg = object.__new__(SamplingConfig)  # skips __post_init__, as a careless peer would
        for name, default in SamplingConfig().to_dict().items():
            object.__setattr__(cfg, name, value if name == field else default)
        probs = processed_probs(logits, cfg, [int(logits.argmax())])
        assert not torch.isfinite(probs).all(), field

"""Sampling settings, carried by the session so that edge and cloud process logits alike."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

from shared.errors import InvalidArgument

# Bounds that keep every processed distribution finite. Processing runs in float32: a temperature,
# top_p or penalty that is tiny as a double can round to 0 there (x / 0 = inf, a kept mass of 0),
# and a tiny temperature or penalty can push logits past the float32 range. Inside these bounds,
# logits of magnitude up to 6e4 (the float16 range) give finite p (tests/shared/test_sampling_bounds.py).
# temperature is 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e3
# top_p is in [MIN_TOP_P, 1]
MIN_TOP_P = 1e-6
# repetition_penalty is in [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2


@dataclass(frozen=True)
class SamplingConfig:
    # softmax temperature; 0 means greedy (argmax, no randomness); otherwise in [1e-6, 1e3]
    temperature: float = 1.0
    # keep the smallest set of most likely tokens whose mass reaches top_p (a run of tokens tied at
    # the boundary is kept whole); 1.0 disables; in [1e-6, 1]
    top_p: float = 1.0
    # keep the top_k most likely tokens; 0 disables
    top_k: int = 0
    # HF-style penalty on tokens already in the context: logit / r if logit > 0 else logit * r; 1.0 disables;
    # in [1e-2, 1e2]
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InvalidArgument(f"{f.name} must be a number, got {value!r}")
        t, r = self.temperature, self.repetition_penalty
        checks = [
            (math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
             f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], not {t!r}"),
            (math.isfinite(self.top_p) and MIN_TOP_P <= self.top_p <= 1,
             f"top_p must be in [{MIN_TOP_P:g}, 1], not {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (math.isfinite(r) and MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], not {r!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidArgument(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingConfig:
        d = dict(d or {})
        unknown = set(d) - {"temperature", "top_p", "top_k", "repetition_penalty"}
        if unknown:
            raise InvalidArgument(f"unknown sampling_cfg fields: {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise InvalidArgument(f"bad sampling_cfg: {e}") from None

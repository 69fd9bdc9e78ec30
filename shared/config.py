"""Sampling settings, carried by the session so that edge and cloud process logits alike."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

from shared.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingConfig:
    # softmax temperature; 0 means greedy (argmax, no randomness)
    temperature: float = 1.0
    # keep the smallest set of most likely tokens whose mass reaches top_p (a run of tokens tied at
    # the boundary is kept whole); 1.0 disables
    top_p: float = 1.0
    # keep the top_k most likely tokens; 0 disables
    top_k: int = 0
    # HF-style penalty on tokens already in the context: logit / r if logit > 0 else logit * r; 1.0 disables
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InvalidArgument(f"{f.name} must be a number, got {value!r}")
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (math.isfinite(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty must be > 0"),
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

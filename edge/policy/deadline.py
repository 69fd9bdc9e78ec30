"""How long the edge waits for a verify answer: a deadline that follows what the path actually does.

A fixed deadline cannot tell a busy cloud, a slow device and a slow link apart, and each of them
turns a fixed 400 ms into dropped answers. Here every answered round is observed twice: the time the
cloud reports it spent (`queue_ms` waiting for the model + `prefill_ms` in the forward) and the rest
of the round trip (the link and both ends' overheads). The deadline of an attempt is

    clamp(multiplier x (high percentile of the link part + high percentile of the cloud part),
          floor, ceiling)

over the last `window` rounds, `first` before any round was answered, and `growth ** n` times that on
the n-th resend of the same round (capped at the ceiling, never below the first attempt's): a late
answer is not met with the same too-short deadline again. A slow but healthy link raises the link
part, a busy cloud raises the cloud part (its reported queue time), and either way the deadline
follows; a dead cloud answers nothing, so its rounds time out with growing deadlines until the
resends run out (connection errors fail faster: they are retried with backoff).

A missed deadline never changes a token by default: the round is resent (idempotent by its
request_id). Only with `--timeout-fallback` does the edge commit the first draft token unverified
instead, and it counts every such token (`timeout_fallback_tokens`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeadlineConfig:
    # a fixed deadline for every first attempt (seconds); None = adaptive
    fixed_s: float | None = None
    # the first round's deadline, before anything was observed (seconds)
    first_s: float = 10.0
    # bounds of the adaptive deadline (seconds)
    floor_s: float = 0.5
    ceiling_s: float = 30.0
    # deadline = multiplier x (percentile of the link part + percentile of the cloud part)
    multiplier: float = 4.0
    # which percentile, in [0, 1]
    quantile: float = 0.95
    # rounds remembered
    window: int = 64
    # the n-th resend of one round waits growth ** n times as long (capped at the ceiling)
    growth: float = 2.0


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-percentile of `values` (0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class VerifyDeadline:
    cfg: DeadlineConfig = field(default_factory=DeadlineConfig)
    # seconds of answered rounds outside the cloud's reported time (link, serialisation, both ends)
    link_s: deque[float] = field(init=False)
    # seconds the cloud reported for those rounds (queue_ms + prefill_ms)
    cloud_s: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.link_s = deque(maxlen=self.cfg.window)
        self.cloud_s = deque(maxlen=self.cfg.window)

    def observe(self, round_s: float, cloud_reported_s: float) -> None:
        """One answered attempt: its wall time and the time the cloud said it spent on it."""
        cloud = min(max(cloud_reported_s, 0.0), round_s)
        self.cloud_s.append(cloud)
        self.link_s.append(round_s - cloud)

    def base_s(self) -> float:
        """The first attempt's deadline for the next round."""
        c = self.cfg
        if c.fixed_s is not None:
            return c.fixed_s
        if not self.link_s:
            return c.first_s
        expected = percentile(list(self.link_s), c.quantile) + percentile(list(self.cloud_s), c.quantile)
        return min(max(c.multiplier * expected, c.floor_s), c.ceiling_s)

    def for_attempt(self, attempt: int) -> float:
        """Deadline (seconds) of attempt `attempt` (0 = first send) of one round."""
        base = self.base_s()
        return max(base, min(base * self.cfg.growth ** attempt, self.cfg.ceiling_s))

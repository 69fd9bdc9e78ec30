"""How many tokens to draft next: fixed k, or k moved by one step on the last round's la/k (the
"dynamic" policy; the default "cost" policy is edge/kcontrol.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .kcontrol import RoundCosts


@dataclass
class KController:
    # current k
    k: int = 6
    # bounds of the dynamic k
    k_min: int = 3
    k_max: int = 12
    # la/k >= up_at -> k + 1; la/k <= down_at -> k - 1
    up_at: float = 0.8
    down_at: float = 0.4
    # False: k never changes
    dynamic: bool = True

    def update(self, k: int, accepted_len: int) -> int:
        """Feed one verified round (its k and La); returns the next k."""
        if not self.dynamic or k <= 0:
            return self.k
        ratio = accepted_len / k
        if ratio >= self.up_at:
            self.k = min(self.k + 1, self.k_max)
        elif ratio <= self.down_at:
            self.k = max(self.k - 1, self.k_min)
        return self.k

    def observe(self, c: RoundCosts) -> int:
        """The cost controller's interface: only k and La are used here."""
        return self.update(c.k, c.accepted_len)

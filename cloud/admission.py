"""Admission: which requests may wait for the model, counted per API key before any compute.

Two kinds of model-bound work:
- **new work**: session opens and `/v1/generate` streams (a stream is counted for its whole generation,
  an open from its admission to its answer). Each in flight counts toward the server's limit
  (`max_queue_depth`, 429 `limit` "max_queue_depth") and its key's (`max_queue_depth_per_key`, 429
  "max_queue_depth_per_key"); an open in flight also counts as one of its key's sessions
  (`SessionStore.check_room` is given `opening`), so a key's burst is refused, at once and with
  Retry-After, by the limits it would reach, not after the prefills it could never keep.
- **rounds** of open sessions. New work never refuses them: they are refused only past
  `max_queue_depth + max_sessions` requests in flight in all, which new work alone cannot reach
  (at most `max_queue_depth` of it is admitted), so one key filling the queue with opens leaves
  every other key's rounds served.
Runs on the event loop only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from shared.errors import ResourceExhausted


@dataclass
class Admission:
    # new work (opens and generate streams) in flight at most, over every key
    max_new: int
    # new work in flight at most for one key
    max_new_per_key: int
    # requests of any kind in flight at most (rounds are refused only past it)
    max_total: int
    # requests admitted and not finished (waiting for the model or running)
    depth: int = 0
    # new work in flight, over every key and per key
    new: int = 0
    new_by_key: dict[str, int] = field(default_factory=dict)
    # opens in flight per key: sessions to be
    opening_by_key: dict[str, int] = field(default_factory=dict)

    def opening(self, owner: str | None = None) -> int:
        """Opens in flight (of `owner`, when given)."""
        if owner is None:
            return sum(self.opening_by_key.values())
        return self.opening_by_key.get(owner, 0)

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        """A verify round of an open session."""
        if self.depth >= self.max_total:
            raise ResourceExhausted(f"{self.depth} requests are waiting for the model (max_queue_depth + "
                                    f"max_sessions = {self.max_total}); retry later", limit="max_queue_depth")
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    @contextlib.contextmanager
    def new_work(self, owner: str, opening: bool = False) -> Iterator[None]:
        """An open (`opening`) or a generate stream of `owner`."""
        self.check_new(owner)
        self.depth += 1
        self.new += 1
        self.new_by_key[owner] = self.new_by_key.get(owner, 0) + 1
        if opening:
            self.opening_by_key[owner] = self.opening_by_key.get(owner, 0) + 1
        try:
            yield
        finally:
            self.depth -= 1
            self.new -= 1
            _decrement(self.new_by_key, owner)
            if opening:
                _decrement(self.opening_by_key, owner)

    def check_new(self, owner: str) -> None:
        """ResourceExhausted when one more open or stream of `owner` would pass a limit."""
        if self.new >= self.max_new:
            raise ResourceExhausted(f"{self.new} opens and generations are waiting for the model (max_queue_depth "
                                    f"= {self.max_new}); retry later", limit="max_queue_depth")
        mine = self.new_by_key.get(owner, 0)
        if mine >= self.max_new_per_key:
            raise ResourceExhausted(f"this API key has {mine} opens and generations waiting for the model "
                                    f"(max_queue_depth_per_key = {self.max_new_per_key}); retry later",
                                    limit="max_queue_depth_per_key")


def _decrement(counts: dict[str, int], key: str) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]

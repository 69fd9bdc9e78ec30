"""The scheduler alone (cloud/scheduler.py), without a model: a fake model runner, jobs of two callables, and a
chunked prefill job."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from cloud.jobs import PENDING, PREFILL, ROUND, BatchStats, Job, Pending, Wait
from shared.kvpool import Row

T = TypeVar("T")


def zero_logits(rows: list[Row]) -> list[torch.Tensor]:
    return [torch.zeros(r.num_logits, 4) for r in rows]


@dataclass
class FakeRunner:
    """A `ModelRunner` of callables: zero logits, and blocks and tree sequences that never run out, unless told."""
    forward: Callable[[list[Row]], list[torch.Tensor]] = zero_logits
    blocks_needed: Callable[[Row], int] = lambda _: 0
    blocks_available: Callable[[], int] = lambda: 1 << 62
    tree_seqs: Callable[[Row], int] = lambda _: 0
    tree_seqs_available: Callable[[], int] = lambda: 1 << 30
    make_room: Callable[[int, bool], None] = lambda _, __: None
    prefill_slice: Callable[[int], int] = lambda _: 1 << 30
    on_batch: Callable[[BatchStats], None] = lambda _: None


class FnJob(Job[T]):
    """A job whose plan and finish are the callables given."""

    def __init__(self, plan: Callable[[int], Row | None | Wait], finish: Callable[[Any, float], T | Pending],
                 kind: str = ROUND, key: str | None = None, owner: str = "") -> None:
        super().__init__(kind, key=key, owner=owner)
        self._plan, self._finish = plan, finish

    def plan(self, budget: int) -> Row | None | Wait:
        return self._plan(budget)

    def finish(self, logits: Any, ms: float) -> T | Pending:
        return self._finish(logits, ms)


class ChunkedPrefill(Job[float]):
    """A prompt of `n` tokens on `seq_id`, in chunks of the budget it is given; answers 1.0."""

    def __init__(self, seq_id: int, n: int, owner: str = "") -> None:
        super().__init__(PREFILL, owner=owner)
        self.seq_id, self.n, self.done = seq_id, n, 0
        self.row: Row | None = None

    def plan(self, budget: int) -> Row:
        self.row = Row(self.seq_id, self.done, [1] * min(budget, self.n - self.done), 0)
        return self.row

    def finish(self, logits: Any, ms: float) -> float | Pending:
        assert self.row is not None
        self.done += len(self.row.ids)
        return 1.0 if self.done >= self.n else PENDING

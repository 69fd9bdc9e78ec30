"""N-gram drafter (NASD): deterministic drafts from counts of what followed each recent context.

Storage level n (1..order) maps the previous n tokens to weighted counts of the token that came
next. A prediction backs off from the longest context seen: level `order` first, then shorter ones.
The storage is built from the prompt and updated online with every committed token; the optional
top-k filler also adds the target's top-k ids at every checked position (response `top_k_ids`),
weighted below real observations (rank r weighs FILLER_WEIGHT / (r + 1)). filler_top_k = 1 learns
only the target's own top choice, i.e. NAPD.

Drafts are deterministic: q = 1 and draft_kind "deterministic", so the cloud's correction
(p without the rejected token) keeps the output exact with no distributions sent. When nothing
continues the context the block is shorter, possibly empty (k = 0: plain target decoding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.config import SamplingConfig
from shared.verify import DraftKind

from .base import DraftBlock

# weight of a filler observation of rank 0 (a committed token weighs 1)
FILLER_WEIGHT = 0.5


class NGramStorage:
    """Multi-level n-gram counts with backoff; ties go to the most recently updated token."""

    def __init__(self, order: int = 4) -> None:
        if order < 1:
            raise ValueError("order must be >= 1")
        self.order = order
        # level n (index n - 1): context tuple of n ids -> {next id: weight}
        self._counts: list[dict[tuple[int, ...], dict[int, float]]] = [{} for _ in range(order)]
        # level n: context -> (best next id, its weight)
        self._best: list[dict[tuple[int, ...], tuple[int, float]]] = [{} for _ in range(order)]

    def update(self, history: Sequence[int], token: int, weight: float = 1.0) -> None:
        """Count `token` after each of the last 1..order tokens of `history`."""
        for n in range(1, min(self.order, len(history)) + 1):
            ctx = tuple(history[-n:])
            row = self._counts[n - 1].setdefault(ctx, {})
            w = row.get(token, 0.0) + weight
            row[token] = w
            best = self._best[n - 1].get(ctx)
            if best is None or best[0] == token or w >= best[1]:
                self._best[n - 1][ctx] = (token, w)

    def ingest(self, ids: Sequence[int], start: int = 0) -> None:
        """Count every token ids[i], i >= start, after its preceding tokens."""
        for i in range(max(start, 1), len(ids)):
            self.update(ids[max(0, i - self.order):i], ids[i])

    def predict(self, history: Sequence[int]) -> tuple[int, int] | None:
        """(next id, level it came from) from the longest seen context; None when none is seen."""
        for n in range(min(self.order, len(history)), 0, -1):
            best = self._best[n - 1].get(tuple(history[-n:]))
            if best is not None:
                return best[0], n
        return None

    def weights(self, context: Sequence[int]) -> dict[int, float]:
        """The counts stored for exactly this context (its length is the level)."""
        return dict(self._counts[len(context) - 1].get(tuple(context), {}))


class NGramDrafter:
    kind: DraftKind = "deterministic"
    max_context: int | None = None

    def __init__(self, order: int = 4, filler_top_k: int = 0, vocab_size: int | None = None) -> None:
        self.order = order
        self.wants_top_k = filler_top_k
        self.vocab_size = vocab_size
        self.storage = NGramStorage(order)
        # the committed context already counted
        self._seen: list[int] = []

    def reset(self) -> None:
        self.storage = NGramStorage(self.order)
        self._seen = []

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self._seen)
        if len(context) < n or list(context[:n]) != self._seen:  # not an extension: a new text
            self.reset()
            n = 0
        self._seen.extend(int(t) for t in context[n:])
        self.storage.ingest(self._seen, start=n)

    def propose(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        self._sync(context)
        history = list(context[-self.order:])
        block = DraftBlock(tokens=[], q_probs=[], kind=self.kind)
        for _ in range(k):
            pred = self.storage.predict(history)
            if pred is None:
                break
            block.tokens.append(pred[0])
            block.q_probs.append(1.0)
            history = (history + [pred[0]])[-self.order:]
        if self.vocab_size is not None:  # point masses, for a residual the cloud should never ask for
            for y in block.tokens:
                q = torch.zeros(self.vocab_size, dtype=torch.float64)  # [vocab]
                q[y] = 1.0
                block.q_full.append(q)
        return block

    def observe(self, context: Sequence[int], draft: Sequence[int], top_k_ids: Sequence[Sequence[int]]) -> None:
        if not self.wants_top_k:
            return
        for i, ids in enumerate(top_k_ids):
            if i > len(draft):
                break
            history = (list(context[-self.order:]) + list(draft[:i]))[-self.order:]
            for rank, tok in enumerate(ids[:self.wants_top_k]):
                self.storage.update(history, int(tok), FILLER_WEIGHT / (rank + 1))

"""The drafter interface: propose k tokens after the committed context S.

Drafters keep their own state by position and re-sync from S on every call, so local commits,
reopened sessions and all-accepted rounds (whose last draft token was never fed back) need no
special calls: `propose(S, k)` finds what it already holds and processes only the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.config import SamplingConfig
from shared.verify import DraftKind


@dataclass
class DraftBlock:
    # y_1..y_k
    tokens: list[int]
    # q_i = q(y_i | S, y_<i) after the shared processing (1.0 for a deterministic drafter)
    q_probs: list[float]
    # "sampled" or "deterministic"
    kind: DraftKind
    # the processed q_i per position, each [vocab]; kept for the split residual and q_dists
    q_full: list[torch.Tensor] = field(default_factory=list)
    # gating signals of the model's raw (temperature 1, unfiltered) distribution, per token:
    # -log q_raw(y_i) in nats, entropy in bits, top-1 minus top-2 probability
    nll: list[float] | None = None
    entropy_bits: list[float] | None = None
    margin: list[float] | None = None
    # MC-dropout variance of q_raw(y_i) across passes (None when not computed)
    mc_var: list[float] | None = None
    # a token tree (edge/drafters/tree.py): each node's parent (-1: the context); None for a chain
    parents: list[int] | None = None
    # a tree's path confidences: the product of the draft's q along each node's path
    values: list[float] | None = None
    # a tree's nodes that only a copy branch proposed (edge/drafters/lookup.py); None: none grafted
    copied: list[bool] | None = None

    @property
    def k(self) -> int:
        """Draft tokens (a tree's nodes)."""
        return len(self.tokens)


class Drafter(Protocol):
    # "sampled" (model) or "deterministic" (n-gram, q = 1)
    kind: DraftKind
    # target ids per checked position the drafter wants back (n-gram filler); 0 = none
    wants_top_k: int
    # longest context (prompt + text + draft) the drafter can hold; None = unbounded
    max_context: int | None

    def reset(self) -> None:
        """Forget the previous text (a new generation starts)."""

    def propose(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        """Up to k draft tokens after `context` (the committed S). Deterministic drafters may return fewer."""
        ...

    def observe(self, context: Sequence[int], draft: Sequence[int], top_k_ids: Sequence[Sequence[int]]) -> None:
        """The target's top ids at the checked positions after context + draft[:i] (filler)."""

"""Hybrid drafter: the n-gram continuation while it is confident, the draft model for the rest.

Confident = predicted from a context of at least `min_level` tokens. Positions taken from the
n-gram are point masses (q = 1 on the token, q_full one-hot), the model's positions carry its
processed q; both are valid proposals for the verify rule since each depends only on the text
before it, so the block goes out as "sampled" and stays exact (a rejected n-gram position's
residual is p without that token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.config import SamplingConfig
from shared.verify import DraftKind

from .base import DraftBlock
from .causal import CausalDrafter
from .ngram import NGramDrafter


class HybridDrafter:
    kind: DraftKind = "sampled"

    def __init__(self, model: CausalDrafter, ngram: NGramDrafter, min_level: int = 2) -> None:
        self.model = model
        self.ngram = ngram
        self.min_level = min_level
        self.wants_top_k = ngram.wants_top_k
        self.max_context = model.max_context

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @vocab_size.setter
    def vocab_size(self, value: int) -> None:
        self.model.vocab_size = value

    def reset(self) -> None:
        self.model.reset()
        self.ngram.reset()

    def propose(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        self.ngram.propose(context, 0, cfg, seed)  # counts the new committed tokens
        history = list(context)
        block = DraftBlock(tokens=[], q_probs=[], kind="sampled", nll=[], entropy_bits=[], margin=[])
        while block.k < k:
            pred = self.ngram.storage.predict(history[-self.ngram.order:])
            if pred is None or pred[1] < self.min_level:
                break
            q = torch.zeros(self.vocab_size, dtype=torch.float64)  # [vocab]
            q[pred[0]] = 1.0
            block.tokens.append(pred[0])
            block.q_probs.append(1.0)
            block.q_full.append(q)
            for signals in (block.nll, block.entropy_bits, block.margin):
                assert signals is not None
                signals.append(0.0 if signals is not block.margin else 1.0)
            history.append(pred[0])
        rest = self.model.propose(history, k - block.k, cfg, seed)
        block.tokens += rest.tokens
        block.q_probs += rest.q_probs
        block.q_full += rest.q_full
        for mine, theirs in ((block.nll, rest.nll), (block.entropy_bits, rest.entropy_bits),
                             (block.margin, rest.margin)):
            assert mine is not None
            mine += theirs or []
        return block

    def observe(self, context: Sequence[int], draft: Sequence[int], top_k_ids: Sequence[Sequence[int]]) -> None:
        self.ngram.observe(context, draft, top_k_ids)

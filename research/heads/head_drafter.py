"""What the two drafters around a feature-fed head share (`FeatureDrafter`, research/heads/feature_head.py;
`AttentionDrafter`, research/heads/attention_drafter.py): the head drafts while the cloud's states fit the
committed context (`usable`), the tokens-only `fallback` drafts every other round, and the head's logits cover
the whole vocabulary (-inf on the ids it has no output row for, where q is 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

from edge.drafters.base import DraftBlock
from edge.drafters.tree import TreeShape
from shared.config import SamplingConfig
from shared.verify import DraftKind


class StateHead(Protocol):
    """A head over the target's states: its config names the target's width and tokenizer."""

    cfg: Any
    # [n_out] the vocabulary ids of the output rows
    out_ids: torch.Tensor

    @property
    def out(self) -> torch.Tensor:
        """[n_out, d] the output rows (their device is the head's)."""

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        """Logits over `out_ids` ([..., n_out]) of states ([..., d])."""


H = TypeVar("H", bound=StateHead)


class HeadDrafter(Generic[H]):
    kind: DraftKind = "sampled"

    def __init__(self, head: H, fallback: object | None) -> None:
        self.head = head
        self.fallback = fallback
        self.wants_top_k = int(getattr(fallback, "wants_top_k", 0))
        self.max_context = getattr(fallback, "max_context", None)
        self._vocab_size: int = head.cfg.vocab_size
        # whether the last block with k > 0 came from the head (None: none drafted yet)
        self.last_from_head: bool | None = None

    @property
    def vocab_size(self) -> int:
        """The ids q is taken over (the target's tokenizer_size once paired); the fallback's too."""
        return self._vocab_size

    @vocab_size.setter
    def vocab_size(self, n: int) -> None:
        self._vocab_size = n
        if self.fallback is not None and hasattr(self.fallback, "vocab_size"):
            self.fallback.vocab_size = n

    def usable(self, context: Sequence[int]) -> bool:
        """Whether the head can draft after `context` (the cloud's states fit it)."""
        raise NotImplementedError

    def _head_chain(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        """k > 0 tokens from the head after `context` (it is `usable`)."""
        raise NotImplementedError

    def _head_tree(self, context: Sequence[int], shape: TreeShape, cfg: SamplingConfig) -> DraftBlock:
        """A token tree from the head after `context` (it is `usable`; edge/drafters/tree.py)."""
        raise NotImplementedError

    @torch.no_grad()
    def propose(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        if k > 0 and self.usable(context):
            self.last_from_head = True
            return self._head_chain(context, k, cfg, seed)
        if self.fallback is None or k <= 0:
            return DraftBlock(tokens=[], q_probs=[], kind=self.kind)
        self.last_from_head = False
        return self.fallback.propose(context, k, cfg, seed)  # type: ignore[attr-defined, no-any-return]

    @torch.no_grad()
    def propose_tree(self, context: Sequence[int], shape: TreeShape, cfg: SamplingConfig,
                     seed: int) -> DraftBlock | None:
        """A token tree from the head (one batched step per level), else the fallback's tree; None when neither
        can grow one."""
        if not self.usable(context):
            grow = getattr(self.fallback, "propose_tree", None)
            if grow is None:
                return None
            self.last_from_head = False
            return grow(context, shape, cfg, seed)  # type: ignore[no-any-return]
        self.last_from_head = True
        return self._head_tree(context, shape, cfg)

    def _full_logits(self, s: torch.Tensor) -> torch.Tensor:
        """The head's logits ([w, vocab]) of states ([w, d]): -inf on ids it has no output row for."""
        rows = self.head.out_ids < self.vocab_size  # [n_out]
        full = torch.full((s.shape[0], self.vocab_size), float("-inf"))  # [w, vocab]
        full[:, self.head.out_ids[rows].cpu()] = self.head.logits(s.to(self.head.out.device))[:, rows].float().cpu()
        return full

    def _reset_fallback(self) -> None:
        if self.fallback is not None and hasattr(self.fallback, "reset"):
            self.fallback.reset()

    def _forked_fallback(self) -> object | None:
        """The fallback for a twin drafter (its own state, when it keeps any)."""
        fb = self.fallback
        return fb.fork() if fb is not None and hasattr(fb, "fork") else fb

    def observe(self, context: Sequence[int], draft: Sequence[int], top_k_ids: Sequence[Sequence[int]]) -> None:
        if self.fallback is not None:
            self.fallback.observe(context, draft, top_k_ids)  # type: ignore[attr-defined]

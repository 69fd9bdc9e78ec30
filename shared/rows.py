"""A row of a paged forward: a sequence, how much of it is cached, the ids that follow (a chain, or a token
tree's nodes at the positions their depth gives them)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.tree import depths


@dataclass(frozen=True)
class Row:
    # the sequence (an id from KVPool.allocate)
    seq_id: int
    # positions already cached (the row's first token sits at position `num_cached_tokens`)
    num_cached_tokens: int
    # token ids to run after them
    ids: list[int]
    # logits wanted for the last `num_logits` ids (0: none, e.g. a prefill)
    num_logits: int
    # a token tree (shared/tree.py) stored from offset `tree_base` of the sequence on: the parents of all
    # its nodes so far (node j at offset tree_base + j; -1: the positions before tree_base), this row's ids
    # among them. A node sits at position tree_base - 1 + its depth and sees the positions before tree_base
    # and its own ancestors only. None: every token is a chain (storage offset = position).
    tree: tuple[int, ...] | None = None
    tree_base: int = 0

    def positions(self) -> list[int]:
        """Each token's position (its storage offset is num_cached_tokens + t either way)."""
        return self.positions_at(self.num_cached_tokens, self.num_cached_tokens + len(self.ids))

    def positions_at(self, lo: int, hi: int) -> list[int]:
        """The positions of the sequence's storage offsets lo .. hi - 1: an offset before `tree_base` is its own
        position, tree node j's (offset tree_base + j) is tree_base - 1 + its depth."""
        base, depth = self.tree_base, depths(self.tree or ())
        return [s if s < base or not depth else base - 1 + depth[s - base] for s in range(lo, hi)]

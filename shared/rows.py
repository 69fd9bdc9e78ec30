"""A row of a paged forward: a sequence, how much of it is cached, the ids that follow (a chain, or a token
tree's nodes at the positions their depth gives them)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.tree import depths


@dataclass(frozen=True)
class Row:
    # the sequence (an id from KVPool.allocate)
    slot: int
    # positions already cached (the row's first token sits at position `past`)
    past: int
    # token ids to run after them
    ids: list[int]
    # logits wanted for the last `keep` ids (0: none, e.g. a prefill)
    keep: int
    # a token tree (shared/tree.py) stored from offset `tree_base` of the sequence on: the parents of all
    # its nodes so far (node j at offset tree_base + j; -1: the positions before tree_base), this row's ids
    # among them. A node sits at position tree_base - 1 + its depth and sees the positions before tree_base
    # and its own ancestors only. None: every token is a chain (storage offset = position).
    tree: tuple[int, ...] | None = None
    tree_base: int = 0

    def positions(self) -> list[int]:
        """Each token's position (its storage offset is past + t either way)."""
        return [_position(s, self.tree_base, self._depths()) for s in range(self.past, self.past + len(self.ids))]

    def _depths(self) -> list[int]:
        return depths(self.tree or ())


def _position(offset: int, base: int, depth: list[int]) -> int:
    return offset if offset < base or not depth else base - 1 + depth[offset - base]

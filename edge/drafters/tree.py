"""Growing a token tree from a draft's own confidence (EAGLE-2, arXiv 2406.16858).

A node's value is the product of the draft's q along its path: under a calibrated draft, the chance the
target accepts it (the verify rule, shared/tree.py, accepts a node iff the target's draw matched every
token of its path). Growth, one batched draft step per level:

1. the root's `width` most likely tokens are the first level;
2. each further level expands the `width` most valuable nodes of the level before (one batched step of
   the draft over them, each seeing the context and its own path), taking each one's `width` most likely
   children;
3. of every node grown, the `nodes` most valuable are kept. A child is never worth more than its parent
   (q <= 1) and ties go to the earlier node, so the kept set is a tree; it keeps the growth order, which is
   topological.

Ranking and values use the draft's processed q (the session's penalty, temperature, top-k, top-p); a greedy
session ranks by the penalised softmax at temperature 1 (its processed q is one-hot). q on the wire is the
node's processed q given its path (floored to the smallest positive float: the rule needs none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from shared.config import SamplingConfig
from shared.sampling import process_logits

from .base import DraftBlock

# a draft step over frontier nodes: (their indices among the grown nodes, their tokens, their parents' indices,
# -1 for the root) -> the logits after each ([w, vocab])
Expand = Callable[[list[int], list[int], list[int]], torch.Tensor]
TINY_Q = 1e-30


class TreeStopped(Exception):
    """Growth was asked to stop between two levels (edge/prefetch.py drafting a tree ahead)."""


@dataclass(frozen=True)
class TreeShape:
    # nodes sent at most
    nodes: int = 32
    # levels grown
    depth: int = 6
    # children taken per expanded node, and nodes expanded per level
    width: int = 4


def ranking_config(cfg: SamplingConfig) -> SamplingConfig:
    return replace(cfg, temperature=1.0) if cfg.greedy else cfg


def grow_tree(root_logits: torch.Tensor, expand: Expand, shape: TreeShape, cfg: SamplingConfig,
              context: Sequence[int], vocab: int) -> DraftBlock:
    """The tree for the token after `context`: `root_logits` ([vocab]) are the draft's there; `expand` runs
    the draft over frontier nodes. Returns a block with tokens, parents, q and values."""
    rank_cfg = ranking_config(cfg)
    seen0 = torch.zeros(vocab, dtype=torch.bool)  # [vocab]
    seen0[torch.as_tensor(list(context), dtype=torch.long)] = True
    tokens: list[int] = []
    parents: list[int] = []
    qs: list[float] = []
    values: list[float] = []
    paths: list[list[int]] = []

    def children(parent: int, logits: torch.Tensor) -> list[int]:
        seen = seen0.clone()
        if parent >= 0:
            seen[torch.as_tensor([tokens[a] for a in paths[parent]], dtype=torch.long)] = True
        q = process_logits(logits[None].float(), rank_cfg, seen[None])[0]  # [vocab]
        top = q.topk(min(shape.width, vocab))
        base = values[parent] if parent >= 0 else 1.0
        made = []
        for tok, prob in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            if prob <= 0:
                break
            tokens.append(int(tok))
            parents.append(parent)
            qs.append(max(float(prob), TINY_Q))
            values.append(base * float(prob))
            paths.append((paths[parent] if parent >= 0 else []) + [len(tokens) - 1])
            made.append(len(tokens) - 1)
        return made

    level = children(-1, root_logits)
    for _ in range(shape.depth - 1):
        frontier = sorted(level, key=lambda j: (-values[j], j))[: shape.width]
        if not frontier:
            break
        frontier.sort()
        logits = expand(frontier, [tokens[j] for j in frontier], [parents[j] for j in frontier])  # [w, vocab]
        level = [c for i, j in enumerate(frontier) for c in children(j, logits[i])]
    keep = sorted(sorted(range(len(tokens)), key=lambda j: (-values[j], j))[: shape.nodes])
    new_index = {j: i for i, j in enumerate(keep)}
    return DraftBlock(tokens=[tokens[j] for j in keep], q_probs=[qs[j] for j in keep], kind="sampled",
                      parents=[-1 if parents[j] < 0 else new_index[parents[j]] for j in keep],
                      values=[values[j] for j in keep])


def round_depth(depth: int, remaining: int) -> int:
    """The levels a round's tree is grown to: the controller's depth, within the tokens the generation has left (a
    round commits at most depth + 1). The round and the tree grown ahead for it both call this, so their shapes
    agree whenever the guess holds (a differing shape makes every tree grown ahead a miss)."""
    return min(depth, remaining - 1)


def main_path(block: DraftBlock) -> list[int]:
    """The tokens of the path that takes the most valuable child at every level, from the root to a leaf."""
    assert block.parents is not None and block.values is not None
    path: list[int] = []
    at = -1
    while True:
        kids = [j for j, p in enumerate(block.parents) if p == at]
        if not kids:
            return path
        at = max(kids, key=lambda j: (block.values[j], -j))  # type: ignore[index]
        path.append(block.tokens[at])


def prune(block: DraftBlock, n: int) -> DraftBlock:
    """The block's `n` most valuable nodes (still a tree, in topological order)."""
    assert block.parents is not None and block.values is not None
    if n >= block.k:
        return block
    vals = block.values
    keep = sorted(sorted(range(block.k), key=lambda j: (-vals[j], j))[:n])
    new_index = {j: i for i, j in enumerate(keep)}
    return DraftBlock(tokens=[block.tokens[j] for j in keep], q_probs=[block.q_probs[j] for j in keep],
                      kind=block.kind, parents=[-1 if block.parents[j] < 0 else new_index[block.parents[j]]
                                                for j in keep], values=[vals[j] for j in keep],
                      copied=None if block.copied is None else [block.copied[j] for j in keep])

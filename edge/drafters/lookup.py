"""Copy branches: what followed the context's last few tokens earlier in it, grafted into a token tree.

Text often repeats its own context: a summary quotes its passage, an answer from a document copies its
phrases, code repeats its names, a translation carries names and numbers over (prompt lookup decoding;
SpecInfer merges several drafts into one tree the same way). `lookup_path` finds the latest earlier
occurrence of the context's longest suffix of `max_match` down to `min_match` tokens and returns the tokens
that followed it (a run that reaches the context's end goes on copying its own copy, so a text repeating
with period d predicts d tokens and then the same again); `graft` merges that path into the draft's tree,
following the nodes that already carry its tokens and adding the rest as new nodes.

The tree rule (shared/tree.py) accepts a node iff the target's own draw matched its whole path, whatever
proposed it, so a grafted tree is exactly as exact as any other: text and seeds are unchanged, only the
tokens per verify call move. A grafted node's value (the controller ranks and prices nodes by it,
edge/policy/tree.py) is `conf ** j` at depth j, where `conf` is the running share of copy nodes the target
accepted given their parent was; a node the draft also proposed keeps the larger of its two values, so
values never rise along a path and pruning still keeps a tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import DraftBlock
from .tree import TINY_Q


def lookup_path(context: Sequence[int], depth: int, max_match: int = 4, min_match: int = 2,
                scan: int = 8192) -> list[int]:
    """`depth` tokens that followed the latest earlier occurrence of the longest suffix of `context`
    (`max_match` down to `min_match` tokens) within its last `scan` tokens, continued periodically past the
    context's end; [] when none recurs."""
    if depth < 1 or len(context) <= min_match:
        return []
    ctx = torch.as_tensor(list(context[-scan:]), dtype=torch.long)  # [L]
    n_ctx = ctx.numel()
    for n in range(min(max_match, n_ctx - 1), min_match - 1, -1):
        windows = ctx[:-1].unfold(0, n, 1)  # [L - n, n]: every window ending before the last token
        hits = (windows == ctx[-n:]).all(1).nonzero()  # [h, 1] starts of earlier occurrences
        if hits.numel():
            start = int(hits[-1, 0]) + n
            path, period = ctx[start:start + depth].tolist(), n_ctx - start
            for j in range(len(path), depth):  # past the context's end the copy copies itself (a repeating run)
                path.append(path[j - period])
            return path
    return []


def graft(block: DraftBlock, path: Sequence[int], conf: float) -> DraftBlock:
    """`block` (a tree with values) with `path` merged in from the root; `copied` marks the nodes only the
    path proposed. New nodes follow the old ones, so the order stays topological."""
    assert block.parents is not None and block.values is not None
    tokens, parents, qs, values = list(block.tokens), list(block.parents), list(block.q_probs), list(block.values)
    copied = list(block.copied) if block.copied is not None else [False] * block.k
    children: dict[tuple[int, int], int] = {(p, t): j for j, (p, t) in enumerate(zip(parents, tokens, strict=True))}
    at, value = -1, 1.0
    for tok in path:
        value *= conf
        j = children.get((at, tok))
        if j is None:
            j = len(tokens)
            tokens.append(int(tok))
            parents.append(at)
            qs.append(max(conf, TINY_Q))
            values.append(value)
            copied.append(True)
            children[(at, tok)] = j
        else:
            values[j] = max(values[j], value)
        at = j
    return DraftBlock(tokens=tokens, q_probs=qs, kind=block.kind, parents=parents, values=values, copied=copied)


def path_values(block: DraftBlock, path: Sequence[int], conf: float) -> list[float | None]:
    """Per node of `block`, its value as a node of the grafted `path` (`conf ** j` at depth j), None off it."""
    assert block.parents is not None
    out: list[float | None] = [None] * block.k
    children = {(p, t): j for j, (p, t) in enumerate(zip(block.parents, block.tokens, strict=True))}
    at, value = -1, 1.0
    for tok in path:
        j = children.get((at, tok))
        if j is None:  # pruned away
            break
        value *= conf
        out[j], at = value, j
    return out


class CopyConfidence:
    """The running share of copy-path nodes the target accepted, among those whose parent it accepted
    (exponentially weighted; `prior` before any)."""

    def __init__(self, prior: float = 0.5, weight: float = 0.1) -> None:
        self.value, self.weight = prior, weight

    def observe(self, block: DraftBlock, path: Sequence[int], accepted: Sequence[int]) -> None:
        """One verified round of the sent tree `block` into which `path` was grafted; `accepted`: the
        accepted nodes, root first. Counts the path's nodes from the root down to its first miss."""
        assert block.parents is not None
        children = {(p, t): j for j, (p, t) in enumerate(zip(block.parents, block.tokens, strict=True))}
        at = -1
        for i, tok in enumerate(path):
            j = children.get((at, tok))
            if j is None:  # pruned away: not sent, not counted
                break
            hit = i < len(accepted) and accepted[i] == j
            self.value = (1 - self.weight) * self.value + self.weight * float(hit)
            if not hit:
                break
            at = j

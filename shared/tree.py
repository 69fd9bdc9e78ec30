"""Token trees: several guesses per position, verified in one forward (SpecInfer, arXiv 2305.09781).

A tree is its nodes in topological order: node j has a token, a parent (`-1`: the committed context S
is its parent; else an earlier node's index), and the draft's probability q of its token given its path.
A node's depth is 1 for the root's children; node j sits at position |S| + depth(j) - 1. A chain is the
tree whose node j has parent j - 1.

The rule (draw and match). Walk from the root: at the current node, draw the target's token x from p
(the processed target distribution after S + the path so far) exactly as target-only decoding draws it
at that position (greedy: the argmax; sampled: `sample_index(p, position_uniform(seed, position,
SAMPLE))`). If a child of the node carries x, that child is accepted and the walk goes on from it; if none
does, x is the token of the round ("correction" when the node had children, "bonus" at a leaf).

Exactness, for any tree and any temperature: every emitted token is the target's own draw from p after
the tokens before it, with the same uniform target-only decoding would use at that position; the tree
only decides how many of those draws one forward can make (a draw lands on a node's child iff the tree
guessed it). So the text is the target's own, and with one seed it is the same text as `/v1/generate`
and any other tree or chain drafted by this rule. Siblings must carry distinct tokens. The rule needs no
q at all (q only feeds metrics), so nothing but the tree crosses the wire; with a deterministic tree the
chance of accepting a node's child is p(children), the most any exact rule can get from that candidate
set (an exact rule emits x ~ p, and x is a child with exactly that probability).

`correction="shortcut"` (the lossy mode, named and opt-in) tries the children in order with min(1, p/q)
and samples p unconditionally after the last rejection: biased towards the drafts, kept so the exactness
tests have a known-biased variant to fail on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.errors import InvalidArgument
from shared.rng import COIN, SAMPLE, position_uniform
from shared.target_probs import TargetProbs


def check_tree(parents: Sequence[int], tokens: Sequence[int]) -> None:
    """InvalidArgument unless `parents` is a topological tree over `tokens` with distinct sibling tokens."""
    if len(parents) != len(tokens):
        raise InvalidArgument(f"len(tree_parents) = {len(parents)} but there are {len(tokens)} draft tokens")
    seen: set[tuple[int, int]] = set()
    for j, (par, tok) in enumerate(zip(parents, tokens, strict=True)):
        if not isinstance(par, int) or isinstance(par, bool) or not -1 <= par < j:
            raise InvalidArgument(f"tree_parents[{j}] = {par!r} is not -1 (the context) or an earlier node's index")
        if (par, tok) in seen:
            raise InvalidArgument(f"tree node {j} repeats token {tok} of a sibling")
        seen.add((par, tok))


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (1 for the root's children)."""
    out: list[int] = []
    for par in parents:
        out.append(1 if par < 0 else out[par] + 1)
    return out


def paths(parents: Sequence[int]) -> list[list[int]]:
    """Each node's path from the root: its ancestors then itself, as node indices."""
    out: list[list[int]] = []
    for j, par in enumerate(parents):
        out.append(([] if par < 0 else out[par]) + [j])
    return out


def is_chain(parents: Sequence[int]) -> bool:
    return all(par == j - 1 for j, par in enumerate(parents))


@dataclass
class TreeOutcome:
    # the accepted nodes, root to leaf (indices into the tree); accepted_len = len(path)
    path: list[int]
    # the token after the accepted path
    next_token: int
    # "correction" (the draw matched no child) or "bonus" (the path ended at a leaf)
    next_kind: str
    # per node: min(1, p(token) / q) (greedy: 1.0 if the token is the argmax), for metrics
    alphas: list[float] = field(default_factory=list)

    @property
    def accepted_len(self) -> int:
        return len(self.path)


def verify_tree(p: torch.Tensor | TargetProbs, tokens: Sequence[int], parents: Sequence[int],
                q_probs: Sequence[float], *, seed: int, ctx_len: int, greedy: bool,
                correction: str = "strict") -> TreeOutcome:
    """Walk the tree by the module's rule.

    p: [n + 1, vocab] processed target distributions: row 0 after S (|S| = ctx_len), row j + 1 after S and
    node j's path; dense or as the forward left them (shared/target_probs.py).
    """
    n = len(tokens)
    if isinstance(p, torch.Tensor):
        p = TargetProbs.dense(p)
    if p.rows != n + 1:
        raise InvalidArgument(f"p has {p.rows} rows, expected {n + 1}")
    check_tree(parents, tokens)
    children: dict[int, dict[int, int]] = {}
    for j, (par, tok) in enumerate(zip(parents, tokens, strict=True)):
        children.setdefault(par, {})[int(tok)] = j
    if greedy:
        alphas = [1.0 if p.argmax(par + 1) == int(tok) else 0.0 for par, tok in zip(parents, tokens, strict=True)]
    else:
        alphas = [min(1.0, p.at(par + 1, int(tok)) / float(q))
                  for par, tok, q in zip(parents, tokens, q_probs, strict=True)]
    path: list[int] = []
    node = -1
    while True:
        pos = ctx_len + len(path) + 1  # the position of the token drawn after the path
        kids = children.get(node, {})
        if greedy:
            x = p.argmax(node + 1)
        elif correction == "shortcut":
            x = _shortcut(p, node + 1, kids, tokens, q_probs, seed, pos)
        else:
            x = p.draw(node + 1, position_uniform(seed, pos, SAMPLE))
        if x not in kids:
            return TreeOutcome(path, x, "correction" if kids else "bonus", alphas)
        node = kids[x]
        path.append(node)


def _shortcut(p: TargetProbs, row: int, kids: dict[int, int], tokens: Sequence[int], q_probs: Sequence[float],
              seed: int, pos: int) -> int:
    """The lossy variant: each child in turn with min(1, p/q) (one coin per position), else a draw from p."""
    u = position_uniform(seed, pos, COIN)
    for tok, j in sorted(kids.items(), key=lambda kv: kv[1]):
        if u < min(1.0, p.at(row, tok) / float(q_probs[j])):
            return int(tokens[j])
        u = position_uniform(seed + j + 1, pos, COIN)
    return p.draw(row, position_uniform(seed, pos, SAMPLE))

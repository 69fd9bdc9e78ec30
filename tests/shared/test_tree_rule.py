"""The token-tree rule (shared/tree.py, draw and match): greedy follows the argmax child, a target token that
is a node's second or third child is accepted, malformed trees are refused, and sampled text has exactly the
target's law.

Exactness: Pearson's chi-square goodness of fit at ALPHA = 0.001 (tests/shared/toy_speculation.py) on the
first two emitted tokens (~ p_1(a) p_2(b | a), 36 cells) of a toy pair with V = 6, the target's rows processed
at T = 0.7, over N runs (N = `runs_needed`, at least 20,000, enough for power >= 0.8 against a total-variation
error of 0.02; verifier seed = run index). Each round drafts a branching tree of 2 + 4 + 4 nodes (the draft's top
two children at the root, its top two under each, two more levels on the best branch), and a round that emits
fewer than two tokens is followed by another from the extended context. The same test, run on the lossy
`shortcut` variant, must reject with a p-value below ALPHA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.config import SamplingConfig
from shared.errors import InvalidArgument
from shared.sampling import process_logits
from shared.tree import TreeOutcome, check_tree, depths, is_chain, paths, verify_tree
from tests.shared.toy_speculation import ALPHA, MIN_POWER, chi_square_gof, random_rows, runs_needed

V = 6
CTX_LAST = 0


def _toy() -> tuple[torch.Tensor, torch.Tensor]:
    """(target, draft) rows [V, V]: row a is the law of the token after a, processed at T = 0.7."""
    g = torch.Generator().manual_seed(7)
    cfg = SamplingConfig(temperature=0.7)
    p = process_logits(torch.log(random_rows(g, V, scale=1.5)), cfg).double()
    q = process_logits(torch.log(random_rows(g, V, scale=1.5)), cfg).double()
    return p, q


def _draft_tree(q: torch.Tensor, prev: int) -> tuple[list[int], list[int], list[float]]:
    """(tokens, parents, q) of a branching tree grown from the draft's table by its own confidence."""
    tokens: list[int] = []
    parents: list[int] = []
    qs: list[float] = []

    def children(node: int, last: int, n: int) -> list[int]:
        top = q[last].topk(n)
        out = []
        for tok, prob in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            tokens.append(tok)
            parents.append(node)
            qs.append(prob)
            out.append(len(tokens) - 1)
        return out

    level = children(-1, prev, 2)
    nxt = [c for j in level for c in children(j, tokens[j], 2)]
    deeper = children(nxt[0], tokens[nxt[0]], 2)
    children(deeper[0], tokens[deeper[0]], 2)
    return tokens, parents, qs


def _round(p: torch.Tensor, q: torch.Tensor, prev: int, ctx_len: int, seed: int, correction: str) -> list[int]:
    tokens, parents, qs = _draft_tree(q, prev)
    rows = torch.stack([p[prev]] + [p[t] for t in tokens])  # [n + 1, V]: row j + 1 is after node j's path
    out = verify_tree(rows, tokens, parents, qs, seed=seed, ctx_len=ctx_len, greedy=False, correction=correction)
    return [tokens[j] for j in out.path] + [out.next_token]


def _first_two(p: torch.Tensor, q: torch.Tensor, n: int, correction: str) -> np.ndarray:
    cells = np.empty(n, dtype=np.int64)
    for s in range(n):
        emitted = _round(p, q, CTX_LAST, 10, s, correction)
        if len(emitted) < 2:
            emitted += _round(p, q, emitted[-1], 11, s, correction)
        cells[s] = emitted[0] * V + emitted[1]
    return cells


@pytest.mark.parametrize("correction", ["strict", "shortcut"])
def test_sampled_trees_have_the_targets_law(correction: str) -> None:
    p, q = _toy()
    law = (p[CTX_LAST][:, None] * p).reshape(-1).numpy()
    n = runs_needed(law)
    fit = chi_square_gof(_first_two(p, q, n, correction), law)
    assert fit.power >= MIN_POWER
    if correction == "strict":
        assert fit.impossible == 0 and fit.pvalue > ALPHA, fit
    else:  # the known-biased variant: the test has the power to see it
        assert fit.pvalue < ALPHA, fit


def test_greedy_follows_the_argmax_child_at_any_sibling_rank() -> None:
    """The target's token is the root's third child, then its node's second child: both are accepted, and the
    token after them is the target's argmax there (a correction, since that node has a child that missed)."""
    tokens = [3, 4, 5, 1, 2, 0]
    parents = [-1, -1, -1, 2, 2, 4]
    p = torch.full((7, V), 0.01, dtype=torch.float64)
    p[0, 5] = 1.0  # after the context: 5 (node 2, the third child)
    p[3, 2] = 1.0  # after node 2: 2 (node 4, its second child)
    p[5, 3] = 1.0  # after node 4: 3, which no child carries (node 5 has 0)
    out = verify_tree(p, tokens, parents, [0.5] * 6, seed=0, ctx_len=4, greedy=True)
    assert out == TreeOutcome([2, 4], 3, "correction", out.alphas)
    p[5, 3], p[5, 0] = 0.01, 1.0  # now node 5 matches and is a leaf: its argmax is the bonus
    p[6, 1] = 1.0
    out = verify_tree(p, tokens, parents, [0.5] * 6, seed=0, ctx_len=4, greedy=True)
    assert (out.path, out.next_token, out.next_kind) == ([2, 4, 5], 1, "bonus")


def test_one_seed_gives_the_target_only_draw_whatever_the_tree() -> None:
    """With the same seed, the token after the accepted path is the draw target-only decoding makes there."""
    from shared.rng import SAMPLE, position_uniform, sample_index
    p, q = _toy()
    for s in range(200):
        emitted = _round(p, q, CTX_LAST, 10, s, "strict")
        prev, want = CTX_LAST, []
        for i in range(len(emitted)):
            want.append(sample_index(p[prev], position_uniform(s, 10 + i + 1, SAMPLE)))
            prev = want[-1]
        assert emitted == want


def test_malformed_trees_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="earlier node"):
        check_tree([-1, 1], [1, 2])
    with pytest.raises(InvalidArgument, match="sibling"):
        check_tree([-1, -1], [3, 3])
    with pytest.raises(InvalidArgument, match="len"):
        check_tree([-1], [1, 2])
    check_tree([-1, 0, 0, -1], [1, 2, 3, 2])


def test_shapes_of_a_tree() -> None:
    parents = [-1, -1, 0, 2, 1]
    assert depths(parents) == [1, 1, 2, 3, 2]
    assert paths(parents) == [[0], [1], [0, 2], [0, 2, 3], [1, 4]]
    assert is_chain([-1, 0, 1]) and not is_chain(parents)

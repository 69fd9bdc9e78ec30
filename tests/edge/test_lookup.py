"""Copy branches (edge/drafters/lookup.py): the lookup, the graft into a tree, and its running confidence."""

from __future__ import annotations

import pytest

from edge.drafters.base import DraftBlock
from edge.drafters.lookup import CopyConfidence, graft, lookup_path
from edge.drafters.tree import prune
from shared.tree import check_tree


def test_lookup_takes_the_latest_occurrence_of_the_longest_suffix() -> None:
    ctx = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 1, 2, 3]
    # the suffix [1, 2, 3] recurs only at the start; [2, 3] alone would pick the later 2, 3 -> 7
    assert lookup_path(ctx, 4) == [9, 9, 2, 3]
    assert lookup_path(ctx, 4, max_match=2) == [7, 8, 5, 1]
    assert lookup_path(ctx, 2) == [9, 9]
    assert lookup_path([4, 5, 6, 7], 3) == []  # nothing recurs
    assert lookup_path([5, 5, 5, 5], 3) == [5, 5, 5]  # past the context's end it copies its own copy
    assert lookup_path([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # period 2
    assert lookup_path(ctx, 12) == [9, 9, 2, 3, 7, 8, 5, 1, 2, 3, 9, 9]
    assert lookup_path(ctx, 0) == [] and lookup_path([1, 2], 3) == []


def tree() -> DraftBlock:
    # root children 10 (0.6) and 11 (0.3); 10 -> 12 (0.36), 10 -> 13 (0.12)
    return DraftBlock(tokens=[10, 11, 12, 13], q_probs=[0.6, 0.3, 0.6, 0.2], kind="sampled",
                      parents=[-1, -1, 0, 0], values=[0.6, 0.3, 0.36, 0.12])


def test_graft_follows_shared_nodes_and_keeps_values_falling() -> None:
    g = graft(tree(), [10, 14, 15], conf=0.8)
    check_tree(g.parents, g.tokens)
    assert g.tokens == [10, 11, 12, 13, 14, 15] and g.parents == [-1, -1, 0, 0, 0, 4]
    assert g.copied == [False, False, False, False, True, True]
    assert g.values == pytest.approx([0.8, 0.3, 0.36, 0.12, 0.64, 0.512])
    for j, p in enumerate(g.parents):  # never more valuable than its parent
        assert p < 0 or g.values[j] <= g.values[p]
    small = prune(g, 3)  # the most valuable three: 10, its copy child 14, and 12 ... still a tree
    check_tree(small.parents, small.tokens)
    assert small.tokens == [10, 14, 15] and small.copied == [False, True, True]
    assert graft(tree(), [], 0.8).tokens == tree().tokens


def test_copy_confidence_counts_the_path_down_to_its_first_miss() -> None:
    g = graft(tree(), [10, 14, 15], conf=0.5)
    c = CopyConfidence(prior=0.5, weight=0.5)
    c.observe(g, [10, 14, 15], accepted=[0, 4])  # 10 and 14 taken, 15 missed
    assert c.value == pytest.approx(((0.5 * 0.5 + 0.5) * 0.5 + 0.5) * 0.5)
    c2 = CopyConfidence(prior=0.5, weight=0.5)
    sent = prune(graft(tree(), [10, 14, 15], conf=0.8), 2)  # 10 and 14 only
    assert sent.tokens == [10, 14]
    c2.observe(sent, [10, 14, 15], accepted=[0, 1])  # 15 was not sent: two counted
    assert c2.value == pytest.approx((0.5 * 0.5 + 0.5) * 0.5 + 0.5)

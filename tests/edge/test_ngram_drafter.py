"""N-gram drafter (NASD): storage backoff, online updates, the top-k filler, deterministic drafts."""

from __future__ import annotations

from edge.drafters import NGramDrafter, NGramStorage
from shared.config import SamplingConfig

CFG = SamplingConfig()


def test_backoff_prefers_the_longest_seen_context() -> None:
    s = NGramStorage(order=3)
    s.ingest([1, 2, 3, 9, 5, 3, 7, 3, 7])  # after "3": 9 once, 7 twice; after "2 3": 9; after "1 2 3": 9
    assert s.predict([1, 2, 3]) == (9, 3)
    assert s.predict([8, 2, 3]) == (9, 2)
    assert s.predict([8, 8, 3]) == (7, 1)
    assert s.predict([8, 8, 4]) is None


def test_ties_go_to_the_most_recent_token() -> None:
    s = NGramStorage(order=1)
    s.ingest([4, 1, 4, 2])
    assert s.predict([4]) == (2, 1)
    s.update([4], 1)
    assert s.predict([4]) == (1, 1)


def test_drafts_are_deterministic_with_q_one_and_stop_without_continuation() -> None:
    d = NGramDrafter(order=2)
    block = d.propose([5, 6, 7, 5, 6], k=6, cfg=CFG, seed=0)
    # 5 6 -> 7, 6 7 -> 5, 7 5 -> 6, then 5 6 -> 7 ...: a cycle, so the full k
    assert block.tokens == [7, 5, 6, 7, 5, 6]
    assert block.q_probs == [1.0] * 6 and block.kind == "deterministic"
    empty = NGramDrafter(order=2).propose([1, 2, 3], k=4, cfg=CFG, seed=0)
    assert empty.tokens == [] and empty.k == 0  # "3" was never followed by anything


def test_online_update_learns_every_committed_token() -> None:
    d = NGramDrafter(order=2)
    assert d.propose([1, 2], k=3, cfg=CFG, seed=0).tokens == []
    # the context grew by committed tokens: they are counted before drafting
    assert d.propose([1, 2, 3, 2], k=2, cfg=CFG, seed=0).tokens == [3, 2]
    assert d.storage.weights([2]) == {3: 1.0}


def test_a_new_text_resets_the_storage() -> None:
    d = NGramDrafter(order=2)
    d.propose([1, 2, 1, 2], k=1, cfg=CFG, seed=0)
    assert d.propose([7, 8], k=3, cfg=CFG, seed=0).tokens == []  # not an extension: forgotten


def test_filler_adds_target_top_ids_below_real_counts() -> None:
    d = NGramDrafter(order=2, filler_top_k=2)
    d.propose([1, 2, 3], k=0, cfg=CFG, seed=0)
    # checked positions after [.., 3] and after [.., 3, 4]: the target's top-2 there
    d.observe([1, 2, 3], [4], [[8, 9], [6, 5]])
    assert d.storage.weights([3]) == {8: 0.5, 9: 0.25}
    assert d.storage.weights([3, 4]) == {6: 0.5, 5: 0.25}
    assert d.propose([1, 2, 3], k=2, cfg=CFG, seed=0).tokens == [8]  # nothing ever followed 8: stop
    d.propose([1, 2, 3, 9], k=0, cfg=CFG, seed=0)  # a committed 9 outweighs the filler's 8
    assert d.storage.predict([3]) == (9, 1)


def test_filler_top_k_one_learns_only_the_target_top_choice() -> None:
    d = NGramDrafter(order=2, filler_top_k=1)
    d.propose([1, 2], k=0, cfg=CFG, seed=0)
    d.observe([1, 2], [], [[7, 8, 9]])
    assert d.storage.weights([2]) == {7: 0.5}


def test_without_filler_observations_are_ignored() -> None:
    d = NGramDrafter(order=2, filler_top_k=0)
    d.propose([1, 2], k=0, cfg=CFG, seed=0)
    d.observe([1, 2], [], [[7]])
    assert d.storage.predict([2]) is None

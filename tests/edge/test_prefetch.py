"""Drafting while the cloud verifies: the block drafted ahead is the one the plain path would draft,
the draft model's KV ends where the plain path leaves it, and generations are unchanged."""

from __future__ import annotations

import pytest

from edge.drafters import ModelDrafter
from edge.prefetch import DraftAhead
from shared.config import SamplingConfig
from tests.edge.fake_cloud import FakeCloud

GREEDY = SamplingConfig(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.1)
SAMPLED = SamplingConfig(temperature=1.0, top_p=0.9, top_k=0, repetition_penalty=1.1)
S0 = [5, 17, 42, 8, 99, 3, 17, 42]


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_held_guess_gives_the_block_the_plain_path_would_draft(model_drafter: ModelDrafter,
                                                                  cfg: SamplingConfig) -> None:
    d = model_drafter
    block = d.propose(S0, 3, cfg, seed=7)
    ahead = DraftAhead(d, cfg, seed=7)
    ahead.start(S0, block, 4)
    ahead._thread.join()  # type: ignore[union-attr]  # let it finish all 4 tokens
    guess = ahead._ahead.context[-1]  # type: ignore[union-attr]
    committed = S0 + block.tokens + [guess]
    ready, outcome = ahead.take(committed, 3)  # the next round wants 3 of the 4
    assert ready is not None and outcome.result == "hit" and outcome.used == 3
    held = d.held_ids

    plain = ModelDrafter.fork(d)
    plain_first = plain.propose(S0, 3, cfg, seed=7)
    assert plain_first.tokens == block.tokens
    # the guess is the draft's own next choice after the block
    assert plain.propose(S0 + block.tokens, 1, cfg, seed=7).tokens == [guess]
    fresh = plain.propose(committed, 3, cfg, seed=7)
    assert ready.tokens == fresh.tokens
    assert ready.q_probs == pytest.approx(fresh.q_probs, rel=1e-5)
    assert held == plain.held_ids  # committed + a_1..a_{k-1}, as the plain path leaves it


def test_a_missed_guess_is_dropped_and_the_kv_cropped_back(model_drafter: ModelDrafter) -> None:
    d = model_drafter
    block = d.propose(S0, 4, GREEDY, seed=0)
    before = d.held_ids
    ahead = DraftAhead(d, GREEDY, seed=0)
    ahead.start(S0, block, 5)
    ahead._thread.join()  # type: ignore[union-attr]
    assert len(d.held_ids) > len(before)  # it drafted ahead
    other = (block.tokens[1] + 1) % d.vocab_size
    ready, outcome = ahead.take(S0 + block.tokens[:1] + [other], 4)  # a correction at position 2
    assert ready is None and outcome.result == "miss"
    assert d.held_ids == before


def test_a_stopped_worker_leaves_a_partial_block_that_is_completed_on_the_critical_path(
        make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=40, k_policy="dynamic", k_start=4, k_min=3)
    on = client.generate("The cat sat on the mat. The cat")
    client.settings.draft_ahead = False
    off = client.generate("The cat sat on the mat. The cat")
    assert on.token_ids == off.token_ids
    m = on.metrics
    assert m.ahead_rounds > 0 and m.ahead_hits > 0  # all-accepted greedy rounds whose bonus the draft guessed
    assert m.ahead_hits == sum(1 for r in on.rounds if r.ahead == "hit")
    assert m.ahead_tokens == sum(r.ahead_used for r in on.rounds)
    assert all(r.ahead_used <= r.k for r in on.rounds)
    assert off.metrics.ahead_rounds == 0 and all(r.ahead == "" for r in off.rounds)


def test_sampled_generation_is_the_same_with_and_without_drafting_ahead(make_client) -> None:
    """Draft draws are keyed by position and the verify rule by (seed, position): with the same drafts
    the text is the same token for token."""
    client, _ = make_client(temperature=1.0, top_p=0.9, max_new_tokens=40, seed=3, k_policy="dynamic")
    on = client.generate("import os\nimport")
    client.settings.draft_ahead = False
    off = client.generate("import os\nimport")
    assert on.token_ids == off.token_ids
    assert [r.k for r in on.rounds] == [r.k for r in off.rounds]


def test_the_worker_failing_falls_back_to_plain_drafting(model_drafter: ModelDrafter, monkeypatch) -> None:
    d = model_drafter
    block = d.propose(S0, 2, GREEDY, seed=0)
    before = d.held_ids
    ahead = DraftAhead(d, GREEDY, seed=0)
    real = d.propose

    def broken(*a, **kw):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    monkeypatch.setattr(d, "propose", broken)
    ahead.start(S0, block, 3)
    ahead.stop()
    monkeypatch.setattr(d, "propose", real)
    ready, outcome = ahead.take(S0 + block.tokens + [1], 3)
    assert ready is None and outcome.result == ""
    assert d.held_ids == before


def test_behind_the_servers_lock_the_worker_drafts_only_while_it_holds_the_lock(model_drafter: ModelDrafter) -> None:
    import threading

    from edge.server.shared_draft import LockedDrafter

    lock = threading.Lock()
    locked = LockedDrafter(model_drafter, lock)
    block = locked.propose(S0, 2, GREEDY, seed=0)
    before = model_drafter.held_ids
    ahead = DraftAhead(locked, GREEDY, seed=0)
    with lock:  # another generation is drafting: the worker waits for its turn
        ahead.start(S0, block, 3)
        assert model_drafter.held_ids == before
    ahead.stop()
    ready, outcome = ahead.take(S0 + block.tokens + [(block.tokens[-1] + 1) % model_drafter.vocab_size], 3)
    assert ready is None and outcome.result == "miss" and model_drafter.held_ids == before


def test_drafting_ahead_stops_when_its_guess_never_holds_and_probes_again(model_drafter: ModelDrafter) -> None:
    from edge.prefetch import AheadOutcome

    ahead = DraftAhead(model_drafter, GREEDY, seed=0)
    for _ in range(12):
        ahead._learn(AheadOutcome("miss"), waited=2.0)
    decisions = [ahead.worth_it() for _ in range(ahead.probe_every)]
    assert decisions[:-1] == [False] * (ahead.probe_every - 1) and decisions[-1]  # one probe per stretch
    for _ in range(12):
        ahead._learn(AheadOutcome("hit", 4, 12.0), waited=0.5)
    assert ahead.worth_it()


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_tree_grown_ahead_is_the_tree_the_plain_path_would_grow(model_drafter: ModelDrafter,
                                                                   cfg: SamplingConfig) -> None:
    from edge.drafters.tree import TreeShape, main_path

    d, shape = model_drafter, TreeShape(nodes=12, depth=4, width=3)
    sent = d.propose_tree(S0, shape, cfg, seed=7)
    ahead = DraftAhead(d, cfg, seed=7)
    assert ahead.start_tree(S0, sent, shape, remaining=40)
    ahead._thread.join()  # type: ignore[union-attr]  # let it grow the whole tree
    committed = list(ahead._ahead.context)  # type: ignore[union-attr]
    path = main_path(sent)
    assert committed[:len(S0) + len(path)] == S0 + path and len(committed) == len(S0) + len(path) + 1
    ready, outcome = ahead.take_tree(committed, shape)
    assert ready is not None and outcome.result == "hit" and outcome.used == ready.k
    fresh = ModelDrafter.fork(d).propose_tree(committed, shape, cfg, seed=7)
    assert (ready.tokens, ready.parents) == (fresh.tokens, fresh.parents)
    assert ready.q_probs == pytest.approx(fresh.q_probs, rel=1e-5)
    assert d.held_ids == committed  # the nodes' KV is dropped, the guessed context's kept


def test_a_tree_grown_ahead_is_dropped_when_the_guess_fails_or_growth_was_stopped(model_drafter: ModelDrafter) -> None:
    from edge.drafters.tree import TreeShape, main_path

    d, shape = model_drafter, TreeShape(nodes=12, depth=4, width=3)
    sent = d.propose_tree(S0, shape, GREEDY, seed=0)
    ahead = DraftAhead(d, GREEDY, seed=0)
    assert ahead.start_tree(S0, sent, shape, remaining=40)
    ahead._thread.join()  # type: ignore[union-attr]
    other = S0 + [(sent.tokens[0] + 1) % d.vocab_size]  # a correction at the first position
    ready, outcome = ahead.take_tree(other, shape)
    assert ready is None and outcome.result == "miss"
    # stopped before its second level: no tree, and the drafter is whole for the next proposal
    assert ahead.start_tree(S0, sent, shape, remaining=40)
    ahead._stop.set()
    ahead._thread.join()  # type: ignore[union-attr]
    guessed = list(ahead._ahead.context)  # type: ignore[union-attr]
    ready, outcome = ahead.take_tree(guessed, shape)
    assert ready is None and outcome.result == "miss"
    assert d.propose_tree(guessed, shape, GREEDY, seed=0).tokens == \
        ModelDrafter.fork(d).propose_tree(guessed, shape, GREEDY, seed=0).tokens
    # no room for another level after the guess: nothing is grown
    assert not ahead.start_tree(S0, sent, shape, remaining=len(main_path(sent)) + 2)


def test_catching_up_feeds_the_draft_the_context_in_a_worker(model_drafter: ModelDrafter) -> None:
    d = model_drafter
    ahead = DraftAhead(d, GREEDY, seed=0)
    assert ahead.catch_up(S0)
    ahead.stop(finish=True)  # (a stop before the prompt is read skips the timing: no answer waits for it)
    # and one step after its own greedy guess, timed once: what a drafted token costs, before any round
    guess = int(ModelDrafter.fork(d).logits_after(S0).argmax())
    assert d.held_ids == [*S0, guess] and ahead.step_ms is not None and ahead.step_ms > 0
    assert d.propose(S0, 3, GREEDY, seed=0).tokens == ModelDrafter.fork(d).propose(S0, 3, GREEDY, seed=0).tokens
    step = ahead.step_ms
    assert ahead.catch_up([*S0, 1, 2])  # streamed tokens later: no second timing
    ahead.stop(finish=True)
    assert d.held_ids == [*S0, 1, 2] and ahead.step_ms == step


def test_waits_for_a_catch_up_are_counted_apart_from_drafting_ahead(model_drafter: ModelDrafter) -> None:
    """The way controller leaves the wait for the draft to read a prompt (or streamed tokens) out of a round's
    cost: stop() books it in catch_up_ms as well as wait_ms; a drafting-ahead worker's wait only in wait_ms."""
    import threading

    d = model_drafter
    ahead = DraftAhead(d, GREEDY, seed=0)
    release, feed = threading.Event(), ahead._feed

    def slow(context: list[int]) -> None:
        release.wait()
        feed(context)

    ahead._feed = slow  # type: ignore[method-assign]
    assert ahead.catch_up(S0)
    threading.Timer(0.05, release.set).start()
    ahead.stop()
    assert ahead.catch_up_ms == ahead.wait_ms >= 40
    caught = ahead.catch_up_ms
    block = d.propose(S0, 2, GREEDY, seed=0)
    assert ahead.start(S0, block, 3)
    ahead.stop()
    assert ahead.catch_up_ms == caught and ahead.wait_ms >= caught


def test_a_tree_still_growing_when_its_guess_holds_is_finished_not_dropped(model_drafter: ModelDrafter,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing a tree takes longer than a verify: the answer comes while the worker grows. When the main path
    was kept and the guess holds, the round waits for the rest of the tree instead of growing it anew."""
    import time

    from edge.drafters.tree import TreeShape, main_path

    d, shape = model_drafter, TreeShape(nodes=12, depth=4, width=3)
    sent = d.propose_tree(S0, shape, GREEDY, seed=0)
    guess = ModelDrafter.fork(d).propose(S0 + main_path(sent), 1, GREEDY, seed=0).tokens
    committed = S0 + main_path(sent) + guess
    want = ModelDrafter.fork(d).propose_tree(committed, shape, GREEDY, seed=0).tokens
    grow = d.propose_tree

    def slow(*a, **kw):  # type: ignore[no-untyped-def]
        time.sleep(0.2)  # the answer comes before the tree is grown
        return grow(*a, **kw)

    monkeypatch.setattr(d, "propose_tree", slow)
    ahead = DraftAhead(d, GREEDY, seed=0)
    assert ahead.start_tree(S0, sent, shape, remaining=40)
    ready, outcome = ahead.take_tree(committed, shape)
    assert ready is not None and outcome.result == "hit" and ready.tokens == want

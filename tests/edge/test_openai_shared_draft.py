"""The OpenAI server's draft model: weights loaded once, one drafter state per generation, forwards serialised."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from edge.drafters import ModelDrafter, NGramDrafter
from edge.server.shared_draft import LockedDrafter, SharedDraftModel
from edge.settings import EdgeSettings
from shared.config import SamplingConfig

GREEDY = SamplingConfig(temperature=0)


def test_interleaved_generations_draft_as_if_each_had_the_model_alone(tiny_pair: tuple[Path, Path]) -> None:
    shared = SharedDraftModel(EdgeSettings(draft=str(tiny_pair[1])))
    a, b = shared.for_generation(), shared.for_generation()
    assert isinstance(a, LockedDrafter) and isinstance(a.inner, ModelDrafter) and isinstance(b, LockedDrafter)
    assert shared.model is not None and a.inner.model is shared.model.model and b.inner.model is shared.model.model
    ctx_a, ctx_b = [5, 9, 14], [200, 3]
    alone_a, alone_b = ModelDrafter(tiny_pair[1]), ModelDrafter(tiny_pair[1])
    for _ in range(3):  # rounds of a and b alternate on the shared weights; each keeps its own KV cache
        block_a, block_b = a.propose(ctx_a, 3, GREEDY, 0), b.propose(ctx_b, 3, GREEDY, 0)
        assert block_a.tokens == alone_a.propose(ctx_a, 3, GREEDY, 0).tokens
        assert block_b.tokens == alone_b.propose(ctx_b, 3, GREEDY, 0).tokens
        ctx_a, ctx_b = ctx_a + block_a.tokens[:2], ctx_b + block_b.tokens[:1] + [7]


def test_a_generation_waits_for_the_model_while_another_drafts_and_counts_the_wait(
        tiny_pair: tuple[Path, Path]) -> None:
    shared = SharedDraftModel(EdgeSettings(draft=str(tiny_pair[1])))
    d = shared.for_generation()
    assert isinstance(d, LockedDrafter)
    shared.lock.acquire()  # another generation is drafting
    done = threading.Event()
    t = threading.Thread(target=lambda: (d.propose([1, 2], 2, GREEDY, 0), done.set()))
    t.start()
    assert not done.wait(0.2)  # blocked on the shared model
    shared.lock.release()
    t.join(30)
    assert done.is_set() and d.wait_s >= 0.2


def test_the_ngram_drafter_is_fresh_per_generation(tiny_pair: tuple[Path, Path]) -> None:
    shared = SharedDraftModel(EdgeSettings(draft="ngram", tokenizer=str(tiny_pair[0])))
    a, b = shared.for_generation(), shared.for_generation()
    assert isinstance(a, NGramDrafter) and isinstance(b, NGramDrafter) and a is not b
    a.propose([1, 2, 3, 1, 2], 2, GREEDY, 0)
    assert b.propose([1, 2], 2, GREEDY, 0).tokens == []  # b learnt nothing from a's text


def test_a_finished_generations_state_is_reused_so_states_never_outnumber_generations(
        tiny_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation gives its fork back at its end; the next resets and reuses it (drafting as a fresh fork), so
    the forks made (llama.cpp: contexts) are the most generations that ran at once, not every request's."""
    shared = SharedDraftModel(EdgeSettings(draft=str(tiny_pair[1])))
    assert shared.model is not None
    forks: list[object] = []
    fork = type(shared.model).fork
    monkeypatch.setattr(type(shared.model), "fork", lambda self: forks.append(1) or fork(self))
    a, b = shared.for_generation(), shared.for_generation()
    assert isinstance(a, LockedDrafter) and isinstance(b, LockedDrafter)
    a.propose([5, 9, 14, 3], 3, GREEDY, 0)
    a.release()
    a.release()  # once only
    for _ in range(5):  # one generation at a time after them: the pool's state every time
        c = shared.for_generation()
        assert isinstance(c, LockedDrafter) and c.inner.kv_len == 0  # type: ignore[attr-defined]
        assert c.propose([200, 3], 3, GREEDY, 0).tokens == ModelDrafter(tiny_pair[1]).propose([200, 3], 3, GREEDY, 0).tokens
        c.release()
    assert len(forks) == 2

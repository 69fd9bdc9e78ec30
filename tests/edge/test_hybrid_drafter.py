"""Hybrid drafter: confident n-gram positions first (point masses), the draft model for the rest."""

from __future__ import annotations

import torch

from edge.drafters import HybridDrafter, ModelDrafter, NGramDrafter
from shared.config import SamplingConfig
from tests.edge.fake_cloud import FakeCloud

CFG = SamplingConfig(temperature=1.0, top_p=0.9)


def test_confident_ngram_tokens_come_first_as_point_masses(model_drafter: ModelDrafter) -> None:
    h = HybridDrafter(model_drafter, NGramDrafter(order=3), min_level=2)
    ctx = [5, 6, 7, 8, 5, 6, 7]  # "6 7" -> 8 seen: a level-2 (and level-3) continuation
    block = h.propose(ctx, k=4, cfg=CFG, seed=1)
    assert block.tokens[0] == 8 and block.q_probs[0] == 1.0 and block.kind == "sampled"
    assert torch.equal(block.q_full[0], torch.nn.functional.one_hot(torch.tensor(8), h.vocab_size).double())
    # after "7 8 5", "8 5" -> 6 -> "5 6" -> 7: the n-gram keeps going while confident
    assert block.tokens[:4] == [8, 5, 6, 7] and block.q_probs == [1.0] * 4


def test_without_a_confident_continuation_the_model_drafts(model_drafter: ModelDrafter) -> None:
    h = HybridDrafter(model_drafter, NGramDrafter(order=3), min_level=2)
    ctx = [1, 2, 3, 4]  # only level-1 evidence at best
    block = h.propose(ctx, k=3, cfg=CFG, seed=2)
    model_drafter.reset()
    alone = model_drafter.propose(ctx, k=3, cfg=CFG, seed=2)
    assert block.tokens == alone.tokens and block.q_probs == alone.q_probs


def test_hybrid_greedy_output_equals_target_greedy(make_client, fake_cloud: FakeCloud,  # type: ignore[no-untyped-def]
                                                   model_drafter: ModelDrafter) -> None:
    h = HybridDrafter(model_drafter, NGramDrafter(order=4), min_level=2)
    client, _ = make_client(h, temperature=0, max_new_tokens=24)
    prompt = "a = 1\nb = 2\na = 1\nb = 2\na = 1\n"
    out = client.generate(prompt)
    ref = fake_cloud.generate(client.encode(prompt), client.settings.sampling(), 0, 24, 1.0).token_ids
    assert out.token_ids == ref

"""The KV-cache facts the verify rule relies on, on a real (tiny, random) transformers causal LM:
one forward over append + k drafts gives the logits of k + 1 one-token steps, and rolling back
by cropping the cache reproduces them. Float32, CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

VOCAB = 97
K = 4
ATOL = 1e-5


@pytest.fixture(scope="module")
def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def tokens() -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, VOCAB, (12,), generator=g).tolist()
    draft = torch.randint(0, VOCAB, (K,), generator=g).tolist()
    return ctx, draft


def crop_to(cache: DynamicCache, length: int) -> None:
    """Roll the cache back to its first `length` positions. In transformers 5.x `crop` takes the
    (negative) number of positions to remove; a positive argument raises."""
    cache.crop(length - cache.get_seq_length())


@torch.no_grad()
def prefill(model: GPT2LMHeadModel, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def test_one_pass_over_the_draft_equals_incremental_steps(model, tokens) -> None:
    ctx, draft = tokens
    # the cloud holds S minus the append token; one forward over append + k drafts
    cache = prefill(model, ctx[:-1])
    chunk = [ctx[-1]] + draft
    one_pass = model(torch.tensor([chunk]), past_key_values=cache, use_cache=True).logits[0]  # [k + 1, V]
    assert cache.get_seq_length() == len(ctx) + K

    step_cache = prefill(model, ctx[:-1])
    steps = torch.cat([model(torch.tensor([[t]]), past_key_values=step_cache, use_cache=True).logits[0]
                       for t in chunk])  # [k + 1, V]
    torch.testing.assert_close(one_pass, steps, atol=ATOL, rtol=0)

    no_cache = model(torch.tensor([ctx + draft])).logits[0, len(ctx) - 1 :]  # [k + 1, V]
    torch.testing.assert_close(one_pass, no_cache, atol=ATOL, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("accepted", [0, 2, K])
def test_cropping_the_cache_and_rerunning_reproduces_the_logits(model, tokens, accepted: int) -> None:
    ctx, draft = tokens
    cache = prefill(model, ctx[:-1])
    chunk = [ctx[-1]] + draft
    first = model(torch.tensor([chunk]), past_key_values=cache, use_cache=True).logits[0]  # [k + 1, V]

    # keep S + the accepted drafts; the rest of the draft is recomputed from the cropped cache
    keep = len(ctx) + accepted
    crop_to(cache, keep)
    assert cache.get_seq_length() == keep
    if accepted < K:
        again = model(torch.tensor([draft[accepted:]]), past_key_values=cache, use_cache=True).logits[0]
        torch.testing.assert_close(again, first[accepted + 1 :], atol=ATOL, rtol=0)
        crop_to(cache, keep)

    # a different continuation after the crop (a correction, then a new draft) sees no stale entries
    other = [(t + 1) % VOCAB for t in draft[:3]]
    after = model(torch.tensor([other]), past_key_values=cache, use_cache=True).logits[0]  # [3, V]
    reference = model(torch.tensor([ctx + draft[:accepted] + other])).logits[0, keep:]  # [3, V]
    torch.testing.assert_close(after, reference, atol=ATOL, rtol=0)


def test_dynamic_cache_crop_takes_a_negative_count_in_this_transformers(model, tokens) -> None:
    """Guards the rollback idiom above: crop(n > 0) is refused, crop(0) changes nothing."""
    ctx, _ = tokens
    cache = prefill(model, ctx)
    with pytest.raises(ValueError):
        cache.crop(3)
    cache.crop(0)
    assert cache.get_seq_length() == len(ctx)
    cache.crop(-3)
    assert cache.get_seq_length() == len(ctx) - 3

"""The KV pool: a row's logits in a batch equal the same row run alone, and the model's own forward.

Tiny random models (tests/tiny_models.py): GPT-2 (absolute positions), Llama (GQA, RoPE), Mistral
(sliding window 8), Gemma2 and Gemma3 (sliding and global layers). Tolerance: 1e-4 absolute on logits of
magnitude ~2 in float32 (observed differences ~1e-6: the batch only changes summation order).
"""

from __future__ import annotations

import pytest
import torch

from shared.hf_model import load_causal_lm
from shared.kvpool import KVPool, Row, attention_layout
from tests.tiny_models import build

TOL = 1e-4


@pytest.fixture(scope="module", params=["gpt2", "llama", "mistral", "gemma2", "gemma3"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    d = build(request.param, tmp_path_factory.mktemp(request.param))
    torch.set_num_threads(1)
    return load_causal_lm(d, "cpu", torch.float32)  # sdpa, or eager where the model has no sdpa (Gemma2)


def seqs(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (length,), generator=g).tolist() for _ in range(n)]


@torch.inference_mode()
def test_batched_rows_equal_rows_run_alone_and_the_plain_forward(model: torch.nn.Module) -> None:
    """Five sequences with different cached lengths (3..27, past the window) and different new
    lengths (1..6), one forward; then each alone in a fresh pool; then the uncached forward."""
    ids = seqs(5, 34)
    past = [3, 27, 10, 0, 16]
    new = [5, 1, 6, 4, 2]
    batched = KVPool(attention_layout(model.config), 256, "cpu", torch.float32)
    slots = [batched.allocate() for _ in ids]
    batched.forward(model, [Row(s, 0, x[:c], 0) for s, x, c in zip(slots, ids, past, strict=True) if c])
    for s, c in zip(slots, past, strict=True):
        batched.lengths[s] = c
    rows = [Row(s, c, x[c: c + n], n) for s, x, c, n in zip(slots, ids, past, new, strict=True)]
    together = batched.forward(model, rows)
    for x, c, n, got in zip(ids, past, new, together, strict=True):
        alone = KVPool(attention_layout(model.config), 256, "cpu", torch.float32)
        s = alone.allocate()
        if c:
            alone.forward(model, [Row(s, 0, x[:c], 0)])
            alone.lengths[s] = c
        (single,) = alone.forward(model, [Row(s, c, x[c: c + n], n)])
        plain = model(input_ids=torch.tensor([x[: c + n]])).logits[0, c: c + n].float()
        assert got.shape == (n, model.config.vocab_size)
        assert (got - single).abs().max() < TOL
        assert (got - plain).abs().max() < TOL


@torch.inference_mode()
def test_crop_then_rewrite_gives_the_uncropped_answer(model: torch.nn.Module) -> None:
    """Write 20 positions, crop to 12, feed other tokens, crop back, feed the originals: as if never cropped."""
    (x,) = seqs(1, 24, seed=1)
    pool = KVPool(attention_layout(model.config), 256, "cpu", torch.float32)
    s = pool.allocate()
    pool.forward(model, [Row(s, 0, x[:20], 0)])
    pool.lengths[s] = 20
    pool.crop(s, 12)
    pool.forward(model, [Row(s, 12, [7, 8, 9, 10, 11], 0)])  # a rejected continuation
    pool.lengths[s] = 17
    pool.crop(s, 12)
    (got,) = pool.forward(model, [Row(s, 12, x[12:24], 12)])
    plain = model(input_ids=torch.tensor([x])).logits[0, 12:24].float()
    assert (got - plain).abs().max() < TOL


@torch.inference_mode()
def test_non_adjacent_slots_are_gathered_with_the_same_result(model: torch.nn.Module) -> None:
    ids = seqs(4, 12, seed=2)
    pool = KVPool(attention_layout(model.config), 256, "cpu", torch.float32)
    slots = [pool.allocate() for _ in ids]
    pool.forward(model, [Row(s, 0, x[:8], 0) for s, x in zip(slots, ids, strict=True)])
    for s in slots:
        pool.lengths[s] = 8
    a, b = pool.forward(model, [Row(slots[0], 8, ids[0][8:], 4), Row(slots[3], 8, ids[3][8:], 4)])  # slots 0 and 3
    for got, x in ((a, ids[0]), (b, ids[3])):
        plain = model(input_ids=torch.tensor([x])).logits[0, 8:].float()
        assert (got - plain).abs().max() < TOL


def test_released_slots_are_reused_lowest_first() -> None:
    pool = KVPool(attention_layout(build_config()), 64, "cpu", torch.float32)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.release(b)
    pool.release(a)
    assert (a, b, c) == (0, 1, 2) and pool.allocate() == 0 and pool.allocate() == 1 and pool.allocate() == 3


def build_config() -> object:
    import transformers as tf

    return tf.LlamaConfig(num_hidden_layers=2)

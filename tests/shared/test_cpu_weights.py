"""Packed CPU weights (shared/cpu_weights.py) give the plain model's logits, tied tables stay readable."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from shared import cpu_weights
from shared.cpu_weights import linear, pack_weights, packed_parameter, packing_available

needs_onednn = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")


def _tiny_llama(tied: bool) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def _logits(model: Any, ids: list[int], n_new: int) -> torch.Tensor:
    """Logits of the last n_new tokens, read through the cache after the rest (a verify's shape)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.tensor([ids[:-n_new]]), past_key_values=cache, use_cache=True)
        return model(input_ids=torch.tensor([ids[-n_new:]]), past_key_values=cache, use_cache=True).logits[0]


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_gives_the_plain_logits(tied: bool) -> None:
    """1, 3 and 9 new tokens after a 20-token context: every logit within 1e-4 of the plain model's
    (float32; the sums differ only in order), the same argmax; a tied table is copied (its bytes returned)
    and the embedding still reads the plain rows; untied weights are replaced, not copied."""
    plain = _tiny_llama(tied)
    packed = copy.deepcopy(plain)
    extra = pack_weights(packed)
    assert extra == (300 * 64 * 4 if tied else 0)
    assert packed.model.layers[0].mlp.up_proj.weight.is_mkldnn
    assert packed.lm_head.weight.is_mkldnn is (not tied)
    assert not packed.model.embed_tokens.weight.is_mkldnn
    ids = torch.randint(0, 300, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    for n in (1, 3, 9):
        a, b = _logits(plain, ids, n), _logits(packed, ids, n)
        assert (a - b).abs().max().item() < 1e-4, n
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_onednn
def test_a_wrongly_packed_weight_is_caught() -> None:
    """The comparison above fails when a packed layer computes something else: one layer's weight packed
    from another tensor (a stand-in for a packing bug) moves the logits far past 1e-4."""
    plain = _tiny_llama(True)
    packed = copy.deepcopy(plain)
    pack_weights(packed)
    layer = packed.model.layers[1].mlp.down_proj
    layer.weight = torch.nn.Parameter(cpu_weights.pack(torch.randn(layer.out_features, layer.in_features)),
                                      requires_grad=False)
    ids = list(range(20))
    assert (_logits(plain, ids, 3) - _logits(packed, ids, 3)).abs().max().item() > 1e-2


def test_without_onednn_weights_are_transposed_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """No oneDNN: each Linear weight is the transpose of a contiguous [in, out] tensor; values and logits
    are the plain model's."""
    monkeypatch.setattr(cpu_weights, "packing_available", lambda: False)
    plain = _tiny_llama(False)
    moved = copy.deepcopy(plain)
    assert pack_weights(moved) == 0
    w = moved.model.layers[0].self_attn.q_proj.weight
    assert not w.is_contiguous() and w.t().is_contiguous()
    assert torch.equal(w, plain.model.layers[0].self_attn.q_proj.weight)
    ids = list(range(12))
    assert (_logits(plain, ids, 3) - _logits(moved, ids, 3)).abs().max().item() < 1e-4


@needs_onednn
def test_packed_parameter_multiplies_like_the_plain_one() -> None:
    """`linear` with a packed parameter: within 1e-4 of x @ w.T for 1, 2 and 8 rows."""
    w = torch.nn.Parameter(torch.randn(40, 16), requires_grad=False)
    p = packed_parameter(w)
    assert p.is_mkldnn and p.shape == w.shape
    for n in (1, 2, 8):
        x = torch.randn(n, 16)
        assert (linear(x, p) - x @ w.T).abs().max().item() < 1e-4

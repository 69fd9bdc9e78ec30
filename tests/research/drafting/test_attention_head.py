"""The attention head's module: cache, window, RoPE, files, and its start from the target."""

from __future__ import annotations

from pathlib import Path

import torch

from research.heads.attention_head import (
    AttentionHead,
    AttentionHeadConfig,
    config_for_target,
    initial_head,
    is_attention_head,
    rope,
    window_mask,
)


def random_head(window: int = 64, seed: int = 0) -> AttentionHead:
    """A small head with every weight random (std 0.3), so each part of the forward shows in its output."""
    cfg = AttentionHeadConfig(hidden_size=32, vocab_size=100, n_out=40, embed_dim=8, width=48, heads=4,
                              kv_heads=2, head_dim=12, ffn_size=64, window=window)
    torch.manual_seed(seed)
    head = AttentionHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(std=0.3)
        head.out_ids.copy_(torch.arange(40) * 2)
    return head.eval()


def sequence(b: int = 2, t: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(b, t, 32, generator=g)  # [B, T, d]
    tokens = torch.randint(0, 100, (b, t), generator=g)  # [B, T]
    return states, tokens, torch.arange(t).expand(b, t) + 3  # positions [B, T]


def test_forward_with_a_cached_prefix_equals_the_whole_forward() -> None:
    head = random_head()
    s, x, p = sequence()
    whole, k_all, v_all = head(s, x, p)
    _, k, v = head(s[:, :6], x[:, :6], p[:, :6])
    rest, k2, v2 = head(s[:, 6:], x[:, 6:], p[:, 6:], k, v)
    torch.testing.assert_close(rest, whole[:, 6:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([k, k2], 2), k_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([v, v2], 2), v_all, atol=1e-5, rtol=1e-5)


def test_sliding_window_hides_keys_older_than_the_window() -> None:
    head = random_head(window=3)
    s, x, p = sequence()
    base, _, _ = head(s, x, p)
    changed = s.clone()
    changed[:, :5] += 1.0  # positions 3..7: outside the window of queries 8.. (indices 5..)
    after, _, _ = head(changed, x, p)
    torch.testing.assert_close(after[:, 7:], base[:, 7:])
    assert not torch.allclose(after[:, 5], base[:, 5])  # index 5 still sees indices 3 and 4
    alone, _, _ = head(s[:, 7:], x[:, 7:], p[:, 7:])  # index 9 sees indices 7..9 only: nothing else
    torch.testing.assert_close(alone[:, 2], base[:, 9], atol=1e-5, rtol=1e-5)


def test_an_explicit_window_mask_by_position_equals_the_default() -> None:
    head = random_head(window=4)
    s, x, p = sequence()
    default, _, _ = head(s, x, p)
    explicit, _, _ = head(s, x, p, mask=window_mask(p, p, 4))
    torch.testing.assert_close(explicit, default)


def test_rope_matches_llamas_rotation() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    cfg = LlamaConfig(hidden_size=48, num_attention_heads=4, head_dim=12, rope_theta=100000.0)
    q = torch.randn(2, 4, 5, 12)  # [B, H, T, Dh]
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 9, 30, 31, 200]])  # [B, T]
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(rope(q, pos, 100000.0), want, atol=1e-5, rtol=1e-5)


def test_save_and_load_round_trip_in_bfloat16(tmp_path: Path) -> None:
    head = random_head()
    head.save(tmp_path)
    assert is_attention_head(tmp_path) and not is_attention_head(tmp_path / "nothing")
    with torch.no_grad():  # what the file holds: every weight rounded to bfloat16
        for t in list(head.parameters()) + list(head.buffers()):
            if t.is_floating_point():
                t.copy_(t.to(torch.bfloat16).float())
    s, x, p = sequence()
    want, _, _ = head(s, x, p)
    plain = AttentionHead.load(tmp_path, pack=False)
    assert plain.cfg == head.cfg and torch.equal(plain.out_ids, head.out_ids)
    torch.testing.assert_close(plain(s, x, p)[0], want, atol=1e-5, rtol=1e-5)
    packed = AttentionHead.load(tmp_path)
    g = packed(s, x, p)[0]
    torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed.logits(g), head.logits(want), atol=1e-3, rtol=1e-4)


def test_a_new_head_reads_frozen_rows_from_the_target(tiny_target: Path, tiny_model) -> None:
    ids = torch.tensor([5, 9, 2, 700])
    cfg = config_for_target(tiny_target, len(ids), embed_dim=16, width=32, heads=2, kv_heads=1, head_dim=16,
                            ffn_size=64, window=8)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.tokenizer_fingerprint != "") == (64, 4096, True)
    head = initial_head(tiny_target, ids, cfg)
    torch.testing.assert_close(head.out, tiny_model.get_output_embeddings().weight[ids])
    assert torch.equal(head.out_ids, ids)
    trained = {n for n, p in head.named_parameters() if p.requires_grad}
    assert "embed.weight" not in trained and "out" not in trained and "fc.weight" in trained
    assert abs(float(head.embed.weight.std()) - 1.0) < 1e-3

"""Tiny random-weight models of several architectures, built from transformers' config classes.

`build(arch, out_dir)` saves a loadable model directory (config, safetensors weights and the demo
tokenizer, vocab 4096) for the architecture matrix: GPT-2, Llama (GQA), Qwen3, Mistral (sliding
window), Gemma2 and Gemma3 (sliding + global layers), Phi3, GPT-NeoX, and hybrids that must be
refused (Jamba, LFM2, Mamba). Windows are small (8) so short tests run past them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import transformers as tf

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "models" / "demo-target"
VOCAB = 4096
WINDOW = 8
# common sizes: 2 layers, width 64, 4 query heads
_ATTN: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=256)

CONFIGS: dict[str, Any] = {
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "llama": lambda: tf.LlamaConfig(**_ATTN, num_key_value_heads=2),
    "qwen3": lambda: tf.Qwen3Config(**_ATTN, num_key_value_heads=2, head_dim=16),
    "mistral": lambda: tf.MistralConfig(**_ATTN, num_key_value_heads=2, sliding_window=WINDOW),
    "gemma2": lambda: tf.Gemma2Config(**_ATTN, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW),
    "gemma3": lambda: tf.Gemma3TextConfig(**{**_ATTN, "num_hidden_layers": 3}, num_key_value_heads=2,
                                          head_dim=16, sliding_window=WINDOW,
                                          sliding_window_pattern=2),  # type: ignore[call-arg]
    "phi3": lambda: tf.Phi3Config(**_ATTN, num_key_value_heads=2, pad_token_id=0),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**_ATTN),
    "jamba": lambda: tf.JambaConfig(**_ATTN, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                                    expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                                    mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
    "lfm2": lambda: tf.Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  layer_types=["conv", "full_attention"]),
    "mamba": lambda: tf.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8),
}
# what the verifier and the draft can serve (rollback by position); the rest must be refused at load
ATTENTION = ["gpt2", "llama", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "gpt_neox"]
# the end-to-end matrix over the real server: GPT-2 is the demo pair's architecture (every other e2e
# test) and Gemma3 covers Gemma2's sliding + global layers, so they run in the in-process tests only
SERVED = ["llama", "qwen3", "mistral", "gemma3", "phi3", "gpt_neox"]
RECURRENT = ["jamba", "lfm2", "mamba"]


def build(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """A tiny random `arch` causal LM saved in out_dir (with the demo tokenizer); returns out_dir."""
    cfg = CONFIGS[arch]()
    cfg.eos_token_id = 0
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper than the default init, so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    model.save_pretrained(out_dir)
    for f in TOKENIZER_DIR.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def build_feature_head(target_dir: Path, out_dir: Path, n_out: int | None = None, seed: int = 0) -> Path:
    """An untrained feature-fed head for the model in target_dir (research/heads/feature_head.py): its
    output rows are the target's own for the first `n_out` ids (all by default), its blocks random, so
    the first draft after a feature is the target's own distribution over those ids."""
    from research.heads.feature_head import FeatureHead, FeatureHeadConfig
    from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint

    target = tf.AutoModelForCausalLM.from_pretrained(target_dir)
    table = target.get_output_embeddings().weight.detach().float()  # [V, d]
    n = n_out or table.shape[0]
    cfg = FeatureHeadConfig(hidden_size=table.shape[1], vocab_size=table.shape[0], n_out=n, embed_dim=16,
                            ffn_size=64, blocks=1, target_model_id=target_dir.name,
                            tokenizer_fingerprint=tokenizer_fingerprint(load_tokenizer(target_dir)))
    torch.manual_seed(seed)
    head = FeatureHead(cfg)
    with torch.no_grad():
        head.out_ids.copy_(torch.arange(n))
        head.out.copy_(table[:n])
        head.embed.weight.normal_()
        for b in head.blocks:
            b.down.weight.normal_(std=0.02)  # type: ignore[union-attr, operator]
    head.save(out_dir)
    return out_dir


def build_compact_draft(model_dir: Path, out_dir: Path, out_ids: torch.Tensor, rank: int | None = None) -> Path:
    """The model in model_dir as a compact draft (edge/drafters/compact.py): its embedding as an SVD of
    rank `rank` (full rank by default: the same table up to rounding), its output rows for `out_ids` only."""
    from edge.drafters.compact import save_compact

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    embed = model.get_input_embeddings().weight.detach().float()  # type: ignore[operator]  # [V, d]
    u, s, vt = torch.linalg.svd(embed, full_matrices=False)
    r = rank or embed.shape[1]
    rows = model.get_output_embeddings().weight.detach().float()[out_ids]  # [n, d]
    save_compact(model, out_ids, rows, u[:, :r] * s[:r], vt[:r], out_dir, dtype=torch.float32)
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out_dir / f.name)
    return out_dir

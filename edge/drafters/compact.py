"""A compact draft directory: a Hugging Face causal LM whose two vocabulary tables are stored small.

A draft cut from the target (its first layers, its embeddings) carries the target's 49,152-row
tables, which would dwarf its layers on disk and make its output layer the largest cost per token.
Such a directory holds, beside `config.json` and the layers in `model.safetensors`, a file
`compact.safetensors` with

    embed.lowrank [V, r], embed.up [r, d]   input embedding E ~ lowrank @ up (rebuilt once at load)
    out.ids [n] (int64), out.weight [n, d]   the output layer over the n most frequent ids (FR-Spec,
                                             arXiv 2502.14856): q is 0 on every other id

At load the model is built from its config, the layers are loaded, the embedding is rebuilt and the
output layer replaced by the n-row one; `ModelDrafter` then spreads its n logits over the vocabulary
(-inf elsewhere). q stays the draft's own probability, so the verify rule and the residual need
nothing new: the target's mass on ids the draft never proposes comes back through the residual.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shared.attention_layout import UnsupportedModel
from shared.cpu_weights import pack_weights

COMPACT = "compact.safetensors"
TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def is_compact(model_dir: Path) -> bool:
    return (Path(model_dir) / COMPACT).is_file()


def load_compact(model_dir: Path, device: str, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
    """(the model in eval mode with its n-row output layer, the ids of those rows [n])."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with no_init_weights():  # every weight is read below: a random start would only cost time
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(load_file(str(model_dir / "model.safetensors")), strict=False)
    if unexpected or set(missing) - set(TABLES):
        raise UnsupportedModel(f"{model_dir}: model.safetensors does not fit its config (missing "
                               f"{sorted(set(missing) - set(TABLES))[:3]}, unexpected {unexpected[:3]})")
    t = load_file(str(model_dir / COMPACT))
    embed = (t["embed.lowrank"].float() @ t["embed.up"].float()).to(dtype)  # [V, d]
    inp = model.get_input_embeddings()
    if embed.shape != inp.weight.shape:
        raise UnsupportedModel(f"{model_dir}: {COMPACT} rebuilds a {tuple(embed.shape)} embedding, the config "
                               f"has {tuple(inp.weight.shape)}")
    ids, rows = t["out.ids"].long(), t["out.weight"].to(dtype)  # [n], [n, d]
    if rows.shape != (ids.numel(), embed.shape[1]) or int(ids.min()) < 0 or int(ids.max()) >= embed.shape[0]:
        raise UnsupportedModel(f"{model_dir}: {COMPACT} has out.weight {tuple(rows.shape)} for {ids.numel()} "
                               f"ids in [0, {embed.shape[0]})")
    with torch.no_grad():
        inp.weight.copy_(embed)
        head = torch.nn.Linear(embed.shape[1], ids.numel(), bias=False, dtype=dtype)
        head.weight.copy_(rows)
    model.set_output_embeddings(head)
    model.to(torch.device(device))
    pack_weights(model)  # its output rows are its own: no copy
    return model.eval(), ids.to(device)


def save_compact(model: Any, out_ids: torch.Tensor, out_weight: torch.Tensor, lowrank: torch.Tensor,
                 up: torch.Tensor, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `model`'s config and layers (not its vocabulary tables) and the compact tables to out_dir."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    layers = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k not in TABLES}
    save_file(layers, str(out_dir / "model.safetensors"))
    save_file({"embed.lowrank": lowrank.detach().to(dtype).contiguous(), "embed.up": up.detach().to(dtype).contiguous(),
               "out.ids": out_ids.detach().long().contiguous(), "out.weight": out_weight.detach().to(dtype).contiguous()},
              str(out_dir / COMPACT))

"""Loading a Hugging Face causal LM for rollback by position, and the check that it works.

Both roles load their model here: the cloud its target, the edge its draft. `load_causal_lm`
refuses recurrent models before their weights are read and picks an attention implementation
that takes explicit masks; `check_rollback` proves once, on a short random sequence, that the
model's forward through a paged `KVPool` (prefill, crop, two rows in one flattened batch) gives its own plain
forward's logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shared.cpu_weights import pack_weights
from shared.kvpool import KVPool, Row, UnsupportedModel, attention_layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# check_rollback: largest |batched - plain| logit difference allowed, relative to 1 + max |logit|
ROLLBACK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}


def eos_ids(model: torch.nn.Module) -> list[int]:
    out: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None)
        for e in ([eos] if isinstance(eos, int) else list(eos or [])):
            if int(e) not in out:
                out.append(int(e))
    return out


def load_causal_lm(model_dir: Path, device: str, dtype: torch.dtype, *, tensor_parallel: bool = False) -> Any:
    """A causal LM in eval mode whose attention takes explicit masks (sdpa, else eager). With
    `tensor_parallel` (torch.distributed initialized) this rank's shard of the model's tensor plan."""
    if not Path(model_dir).is_dir():  # never a hub download: every model here is a local directory
        raise UnsupportedModel(f"no model directory {model_dir}: it does not exist")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise UnsupportedModel(f"cannot read the model config in {model_dir}: {str(e).splitlines()[0]}") from None
    attention_layout(config)  # refuse recurrent models before loading their weights
    model = None
    extra: dict[str, Any] = {}
    if tensor_parallel:
        from transformers.distributed import DistributedConfig

        extra["distributed_config"] = DistributedConfig(tp_plan="auto")
    for impl in ("sdpa", "eager"):
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=impl, **extra)
            break
        except ValueError as e:
            if impl == "eager":
                raise UnsupportedModel(f"cannot load {model_dir}: {str(e).splitlines()[0]}") from None
    assert model is not None
    model.to(torch.device(device))  # type: ignore[arg-type]
    # bytes of the packed copies of tied weights (shared/cpu_weights.py); shards are placed by their plan
    setattr(model, "packed_copy_bytes", 0 if tensor_parallel else pack_weights(model))  # noqa: B010
    return model.eval()


@torch.inference_mode()
def check_rollback(model: Any, pool: KVPool, vocab: int, dtype: torch.dtype) -> None:
    """Two sequences through the pool (a prefill, a crop, then both in one batch) must give the logits of
    the model's own uncached forward; UnsupportedModel otherwise. Leaves the pool empty."""
    n = min(24, pool.max_positions)
    g = torch.Generator().manual_seed(0)
    a_ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    b_ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    dev = next(model.parameters()).device
    refs = [model(input_ids=torch.tensor([x], device=dev)).logits[0].float() for x in (a_ids, b_ids)]
    pool.prepare(model)
    a, b = pool.allocate(), pool.allocate()
    h = n // 2
    pool.forward(model, [Row(a, 0, a_ids[:h], 0), Row(b, 0, b_ids[: h + 2], 0)])
    # b is cropped back by 3 (its last positions are rewritten), then both rows run together
    out = pool.forward(model, [Row(a, h, a_ids[h:], n - h), Row(b, h - 1, b_ids[h - 1:], n - h + 1)])
    pool.release(a)
    pool.release(b)
    worst = max(float((out[0] - refs[0][h:]).abs().max()), float((out[1] - refs[1][h - 1:]).abs().max()))
    scale = 1.0 + float(max(r.abs().max() for r in refs))
    if not worst <= ROLLBACK_TOLERANCE[dtype] * scale:
        raise UnsupportedModel(
            f"model type {model.config.model_type!r}: batched forwards with per-row positions and masks do not "
            f"reproduce the plain forward (max logit difference {worst:.3g}); it cannot be served exactly")

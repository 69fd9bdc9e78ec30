"""The target model: loading, its public facts (GET /v1/model), and forwards over a KV cache.

Only the model worker thread calls `forward`; everything here is synchronous.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from shared.protocol import ModelInfo

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the KV of the first `length` positions (no-op when the cache is not longer)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5: a negative argument removes that many positions


def _eos_ids(model: torch.nn.Module) -> list[int]:
    out: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None)
        for e in ([eos] if isinstance(eos, int) else list(eos or [])):
            if int(e) not in out:
                out.append(int(e))
    return out


class TargetModel:
    """A Hugging Face causal LM in eval mode, plus what a session needs to size its KV cache."""

    def __init__(self, model_dir: Path, device: str = "cpu", dtype: str = "float32") -> None:
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
        self.model.to(self.device)  # type: ignore[arg-type]
        self.model.eval()
        cfg = self.model.config.get_text_config()
        n_ctx = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
        self.info = ModelInfo(
            model_id=model_dir.resolve().name, vocab_size=int(self.model.get_output_embeddings().weight.shape[0]),
            eos_ids=_eos_ids(self.model), max_context=int(n_ctx), dtype=dtype, device=str(self.device))
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        itemsize = torch.tensor([], dtype=DTYPES[dtype]).element_size()
        # K and V, every layer, every kv head: bytes one position of one session's cache takes
        self.kv_bytes_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * itemsize
        log.info("target loaded: %s", self.info)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, ids: list[int], cache: DynamicCache, keep: int) -> torch.Tensor:
        """Run `ids` after the cache's positions; returns the last `keep` rows of logits, float32.

        The cache grows by len(ids) positions.
        """
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0].float()  # [keep, vocab]

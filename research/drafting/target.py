"""The target model for data work: loading, chat prefixes, and batched sampling.

`sample_batch` decodes many rows in one forward per step with the product's own processing
(`shared.sampling.process_logits`: repetition penalty, temperature, top-p), so a sampled answer has the
law the edge and cloud would give it. Rows are left-padded; a row leaves the batch (and its cache) as
soon as it emits a stop id, so finished rows cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.config import SamplingConfig
from shared.sampling import process_logits

REPO = Path(__file__).resolve().parents[2]
TARGET_DIR = REPO / "models" / "smollm2-135m-instruct"


def load_target(path: Path = TARGET_DIR, threads: int = 2) -> tuple[Any, Any]:
    """(tokenizer, model) in float32 on the CPU, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return tok, model


def chat_ids(tok: Any, user: str) -> list[int]:
    """The chat template's ids for one user message, up to the assistant's turn."""
    ids = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def user_turn_prefix(tok: Any) -> str:
    """The template's text up to where the user's message begins (system turn included)."""
    marker = "\x00MARK\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False,
                                   tokenize=False)
    return str(text[: text.index(marker)])


@dataclass
class Sampling:
    # processing, as the edge would ask for it (temperature 0: greedy)
    cfg: SamplingConfig
    # most new tokens per row
    max_new: int
    # ids that end a row (emitted, then the row stops)
    stop_ids: tuple[int, ...]


@torch.inference_mode()
def sample_batch(model: Any, prompts: list[list[int]], s: Sampling, gen: torch.Generator) -> list[list[int]]:
    """Each row's new ids (its stop id included when it stopped) for `prompts`, decoded together."""
    from transformers import DynamicCache
    b, width = len(prompts), max(len(p) for p in prompts)
    vocab = model.config.vocab_size
    pad = s.stop_ids[0]
    ids = torch.full((b, width), pad, dtype=torch.long)  # [B, W] left-padded
    mask = torch.zeros((b, width), dtype=torch.long)  # [B, W]
    seen = torch.zeros((b, vocab), dtype=torch.bool)  # [B, V] tokens in each row's context
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
        seen[r, torch.tensor(p)] = True
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W] per-row positions
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
    out: list[list[int]] = [[] for _ in range(b)]
    live = torch.arange(b)  # [L] original row of each live row
    stops = torch.tensor(s.stop_ids)
    for _ in range(s.max_new):
        probs = process_logits(logits, s.cfg, seen)  # [L, V]
        tok = (probs.argmax(-1) if s.cfg.greedy
               else torch.multinomial(probs, 1, generator=gen)[:, 0])  # [L]
        for r, t in zip(live.tolist(), tok.tolist(), strict=True):
            out[r].append(t)
        seen[torch.arange(len(live)), tok] = True
        keep = ~torch.isin(tok, stops)  # [L]
        if not bool(keep.all()):
            if not bool(keep.any()):
                break
            idx = keep.nonzero()[:, 0]  # [L']
            cache.batch_select_indices(idx)
            live, tok, mask, pos, seen = live[idx], tok[idx], mask[idx], pos[idx], seen[idx]
        mask = torch.cat([mask, torch.ones((len(live), 1), dtype=torch.long)], 1)  # [L, W + t]
        pos = pos[:, -1:] + 1  # [L, 1]
        logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True).logits[:, -1]  # [L, V]
    return out

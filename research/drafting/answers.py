"""The target's answers to its own requests, in batched forwards.

Each request is answered once, by the product's processing with the edge's default repetition penalty
(1.1): greedy for half of them, sampled at T = 0.7 (top-p 0.9) and at T = 1.0 (top-p 0.95) for a quarter
each, chosen by the request's index so a rerun answers alike. Rows are sorted by prompt length within a
shard, so left padding stays small. An answer that shares an 8-gram with an evaluation text is dropped.
"""

from __future__ import annotations

from typing import Any

import torch

from research.drafting.heldout import HeldOut
from research.drafting.target import Sampling, chat_ids, sample_batch
from shared.config import SamplingConfig

PENALTY = 1.1


def answer_config(index: int) -> SamplingConfig:
    """Greedy for even indices, T = 0.7 for 1 mod 4, T = 1.0 for 3 mod 4."""
    if index % 2 == 0:
        return SamplingConfig(temperature=0.0, repetition_penalty=PENALTY)
    if index % 4 == 1:
        return SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=PENALTY)
    return SamplingConfig(temperature=1.0, top_p=0.95, repetition_penalty=PENALTY)


def write_answers(tok: Any, model: Any, requests: list[dict[str, Any]], first_index: int, seed: int,
                  batch: int, max_new: int, held: HeldOut) -> tuple[list[dict[str, Any]], int]:
    """Answer rows (request text, its chat ids' length, the answer's ids, the processing) and how many
    were dropped as sharing an 8-gram with an evaluation text."""
    gen = torch.Generator().manual_seed(seed)
    stop = (int(tok.eos_token_id),)
    by_cfg: dict[tuple[float, float], list[tuple[int, list[int]]]] = {}
    for j, req in enumerate(requests):
        cfg = answer_config(first_index + j)
        by_cfg.setdefault((cfg.temperature, cfg.top_p), []).append((j, chat_ids(tok, req["text"])))
    rows: list[dict[str, Any]] = []
    dropped = 0
    for (t, top_p), items in by_cfg.items():
        items.sort(key=lambda x: len(x[1]))
        cfg = SamplingConfig(temperature=t, top_p=top_p, repetition_penalty=PENALTY)
        for b0 in range(0, len(items), batch):
            chunk = items[b0:b0 + batch]
            outs = sample_batch(model, [ids for _, ids in chunk], Sampling(cfg, max_new, stop), gen)
            for (j, ids), new in zip(chunk, outs, strict=True):
                if not held.clean(tok.decode(new)):
                    dropped += 1
                    continue
                rows.append({"request": requests[j]["text"], "kind": requests[j]["kind"], "prompt_len": len(ids),
                             "ids": ids + new, "temperature": t, "top_p": top_p, "penalty": PENALTY})
    return rows, dropped

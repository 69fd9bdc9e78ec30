"""The target as teacher: its answers to prompts and its states over text, in shards of a work directory.

One data path for every draft the work directory feeds: answers are sampled by `drafting.target.sample_batch`
(the product's processing), then the target is teacher-forced over prompt + answer (`drafting.states.
target_states`, window 1), so a row's states are f_t for t from the prompt's last position to the answer's
last but one: f_t chose token t + 1. Given rows (text chunks of Python's own source from position 0, or fixed answers)
are teacher-forced the same way. What a shard keeps of those states is the caller's (`keep`): the feature-fed
head keeps them (float16), the distilled draft the target's top-k log-probabilities.

A shard is `<work>/<name>-<first prompt index:05d>.pt`, a list of records each with `ids`, `start` (the
prompt's length: states[i] sits at position start - 1 + i) and the prompt; it is written atomically and
skipped when present, so rerunning resumes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from research.drafting.loop import save_checkpoint
from research.drafting.states import target_states
from research.drafting.target import Sampling, chat_ids, sample_batch
from shared.config import SamplingConfig

log = logging.getLogger(__name__)

# (model, rows with ids, prompt_len, temperature, prompt; their states [n, d] float32) -> shard records
Keep = Callable[[Any, list[dict[str, Any]], list[torch.Tensor]], list[dict[str, Any]]]


@dataclass
class Answering:
    # prompts per forward, and per shard
    batch: int
    # most answer tokens
    max_new: int
    # every `sample_every`-th batch is sampled at `temperature`, the others greedy (0: all greedy)
    sample_every: int = 0
    # the sampled batches' temperature
    temperature: float = 0.7
    # most shards written (the shortest prompts first)
    max_shards: int = 1 << 30


def shard_names(work: Path, name: str) -> list[str]:
    return sorted(f.name for f in work.glob(f"{name}-*.pt"))


def load_shards(work: Path, name: str, names: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of every shard of `name` (or of the shard files `names`), in shard order."""
    recs: list[dict[str, Any]] = []
    for f in names if names is not None else shard_names(work, name):
        recs.extend(torch.load(work / f, weights_only=False))
    return recs


def teacher_states(model: Any, rows: list[dict[str, Any]], batch: int = 8) -> list[torch.Tensor]:
    """Each row's states ([len(ids) - prompt_len, d], float32): f_t for t = prompt_len - 1 .. len(ids) - 2."""
    return [r["states"] for r in target_states(model, rows, 1, batch, dtype=torch.float32)]


def write_answer_shards(work: Path, name: str, tok: Any, model: Any, prompts: list[str], a: Answering,
                        keep: Keep) -> None:
    """The target's answers to `prompts` (sorted by length), one shard of `a.batch` per forward."""
    eos = int(tok.eos_token_id)
    items = sorted(((chat_ids(tok, p), i) for i, p in enumerate(prompts)), key=lambda x: len(x[0]))
    for b0 in range(0, min(len(items), a.max_shards * a.batch), a.batch):
        shard = work / f"{name}-{b0:05d}.pt"
        if shard.exists():
            continue
        t0 = time.time()
        chunk = items[b0:b0 + a.batch]
        sampled = a.sample_every > 0 and (b0 // a.batch) % a.sample_every == a.sample_every - 1
        t = a.temperature if sampled else 0.0
        news = sample_batch(model, [ids for ids, _ in chunk], Sampling(SamplingConfig(temperature=t), a.max_new, (eos,)),
                            torch.Generator().manual_seed(b0))
        rows = [{"ids": ids + new, "prompt_len": len(ids), "temperature": t, "prompt": prompts[i]}
                for (ids, i), new in zip(chunk, news, strict=True)]
        save_checkpoint(shard, keep(model, rows, teacher_states(model, rows)))
        n = sum(len(new) for new in news)
        log.info("[%s] %d: %d answers, %d tokens, %.0f s, T=%s", name, b0, len(chunk), n, time.time() - t0, t)


def text_rows(chunks: list[list[int]]) -> list[dict[str, Any]]:
    """Rows of text chunks (`drafting.corpus.text_chunks`): states from position 0."""
    return [{"ids": c, "prompt_len": 1, "temperature": -1.0, "prompt": None} for c in chunks]


def write_teacher_shards(work: Path, name: str, model: Any, rows: list[dict[str, Any]], keep: Keep,
                         batch: int = 8) -> None:
    """The target teacher-forced over given rows (ids, prompt_len: text, or fixed answers), `batch` a shard."""
    for b0 in range(0, len(rows), batch):
        shard = work / f"{name}-{b0:05d}.pt"
        if shard.exists():
            continue
        chunk = rows[b0:b0 + batch]
        save_checkpoint(shard, keep(model, chunk, teacher_states(model, chunk, batch)))
        log.info("[%s] %d: %d rows, %d tokens", name, b0, len(chunk), sum(len(r["ids"]) for r in chunk))

"""The target's states over its own answers, teacher-forced: what the attention head learns from.

The state f_t is the target's output-layer input (last hidden state, after the final norm) at position t,
after reading x_0..x_t; `softmax(E f_t)` is its distribution of x_{t+1}. For each answer row (chat prompt
ids + answer ids, `prompt_len`) one batched forward of the target (rows sorted by length, padded on the
right, with an attention mask) gives every f_t; a row keeps its ids and the float16 states for t from
`max(0, prompt_len - window)` (the last prompt positions are the head's context) to `len(ids) - 2` (whose
next token exists). One `.pt` file per answers shard, under a work directory outside the git tree
(`<work>/states/00003.pt`), written atomically and skipped when present: rerunning resumes. A kept
position costs 1,152 bytes (576 float16 values).

Held-out shards (index % every == 0) are never trained on; the output rows (FR-Spec, arXiv 2502.14856)
are the `n_out` ids most frequent in the training shards' answers, counted once and kept in
`<work>/freq.json` with the shards they were counted on, so later shards never move a checkpoint's rows.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from research.drafting.shards import read_shard, shard_indices, shard_path

log = logging.getLogger(__name__)


def states_path(work: Path, index: int) -> Path:
    """`work/states/00042.pt`: the states of answers shard 42."""
    return work / "states" / f"{index:05d}.pt"


def is_heldout(index: int, every: int) -> bool:
    """Shard `index` is held out for evaluation (never trained on)."""
    return every > 0 and index % every == 0


def state_start(prompt_len: int, window: int) -> int:
    """The first position whose state a row keeps: the last `window` prompt positions are context."""
    return max(0, prompt_len - window)


@torch.inference_mode()
def target_states(model: Any, rows: list[dict[str, Any]], window: int, batch: int,
                  dtype: torch.dtype = torch.float16) -> list[dict[str, Any]]:
    """For each row: its ids (int32), prompt_len, the answer's temperature, `start` and the states f_t
    ([n, d], `dtype`) for t in start .. len(ids) - 2, in the order of `rows`; `batch` rows per forward."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["ids"]))
    out: list[dict[str, Any]] = [{} for _ in rows]
    for b0 in range(0, len(order), batch):
        chunk = order[b0:b0 + batch]
        width = max(len(rows[i]["ids"]) for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)  # [B, W] padded on the right
        mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [B, W]
        for r, i in enumerate(chunk):
            n = len(rows[i]["ids"])
            ids[r, :n] = torch.tensor(rows[i]["ids"])
            mask[r, :n] = 1
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, W, d]
        for r, i in enumerate(chunk):
            row = rows[i]
            n, start = len(row["ids"]), state_start(row["prompt_len"], window)
            out[i] = {"ids": torch.tensor(row["ids"], dtype=torch.int32), "prompt_len": int(row["prompt_len"]),
                      "temperature": float(row.get("temperature", 0.0)), "start": start,
                      "states": hidden[r, start:n - 1].to(dtype).clone()}  # [n - 1 - start, d]
    return out


def write_states(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """One states file, atomically (temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"meta": meta, "rows": rows}, tmp)
    os.replace(tmp, path)


def load_states(path: Path) -> list[dict[str, Any]]:
    """A states file's rows, memory-mapped (the page cache holds what training reads)."""
    return list(torch.load(path, mmap=True, weights_only=True)["rows"])


def make_states(work: Path, data: Path, model: Any, window: int, batch: int) -> list[int]:
    """The states of every answers shard under `data` that has none under `work` yet; returns the
    indices written."""
    done = []
    for i in shard_indices(data, "answers"):
        path = states_path(work, i)
        if path.exists():
            continue
        src = shard_path(data, "answers", i)
        rows = [r for r in read_shard(src) if len(r["ids"]) - r["prompt_len"] >= 2]
        states = target_states(model, rows, window, batch)
        meta = {"source": str(src), "target": str(getattr(model, "name_or_path", "")), "window": window,
                "rows": len(states), "positions": sum(int(r["states"].shape[0]) for r in states)}
        write_states(path, states, meta)
        log.info("states %s: %d rows, %d positions", path.name, meta["rows"], meta["positions"])
        done.append(i)
    return done


def answer_tokens(rows: Iterable[dict[str, Any]]) -> torch.Tensor:
    """Every answer token of `rows` ([N])."""
    parts = [torch.as_tensor(r["ids"][r["prompt_len"]:], dtype=torch.long) for r in rows]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def frequent_ids(rows: Iterable[dict[str, Any]], vocab: int, n_out: int) -> torch.Tensor:
    """The `n_out` ids most frequent in the answers of `rows` ([n_out], most frequent first; ties and
    ids never seen in id order)."""
    counts = torch.bincount(answer_tokens(rows), minlength=vocab)  # [V]
    return torch.argsort(counts, descending=True, stable=True)[:n_out]


def coverage(ids: torch.Tensor, rows: Iterable[dict[str, Any]]) -> float:
    """The share of the answer tokens of `rows` that `ids` contains."""
    toks = answer_tokens(rows)
    return float(torch.isin(toks, ids).float().mean()) if toks.numel() else 0.0


def output_ids(work: Path, data: Path, vocab: int, n_out: int, every: int) -> dict[str, Any]:
    """The output rows for `n_out` (FR-Spec): counted once on the training shards then present, kept in
    `work/freq.json` ({"ids", "shards", "coverage_heldout", "coverage_train"}); delete it to count again
    (and train afresh)."""
    path = work / "freq.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved["n_out"] == n_out:
            return dict(saved)
    idx = shard_indices(data, "answers")
    train = [r for i in idx if not is_heldout(i, every) for r in read_shard(shard_path(data, "answers", i))]
    held = [r for i in idx if is_heldout(i, every) for r in read_shard(shard_path(data, "answers", i))]
    ids = frequent_ids(train, vocab, n_out)
    res = {"n_out": n_out, "ids": ids.tolist(), "shards": [i for i in idx if not is_heldout(i, every)],
           "coverage_train": coverage(ids, train), "coverage_heldout": coverage(ids, held)}
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res))
    return res

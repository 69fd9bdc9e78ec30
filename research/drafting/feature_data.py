"""The feature-fed head's and the cut draft's data: the target's states over its answers and over text,
the frequency-ranked output rows (FR-Spec) and the target's top labels over them.

Shards come from `drafting.teacher` (`keep_states`: each record keeps the float16 states, as `hidden`).
`frequency_order` counts the training answers' tokens once (plus the target's expected counts at every 4th
position) into `<work>/freq.json`; `labels` keeps, per shard set trained on, the target's top LABEL_K ids
over those rows and their log-probabilities (`<work>/labels-<name>-<n_out>.pt`), recomputed when the set
has gained shards, so training never runs the whole output layer for its targets.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from research.drafting.target import TARGET_DIR
from research.drafting.teacher import load_shards, shard_names

log = logging.getLogger(__name__)

LABEL_K = 32  # the target's top ids kept per position (over the output rows)


@dataclass
class HeadsConfig:
    """Every knob of the feature-fed head's and the cut draft's training (research/scripts/train_heads.py's options)."""

    work: Path  # data and checkpoints (outside the work tree)
    target: Path = TARGET_DIR  # the target model's directory
    data: str = "chat"  # comma-separated shard sets trained on: chat, docs, text
    n_out: int = 16384  # rows of the frequency-ranked output layer
    threads: int = 2  # torch threads
    train_minutes: float = 60  # budget: minutes of steps ...
    train_steps: int = 0  # ... or steps, when > 0
    batch: int = 32  # the head: windows per step,
    window: int = 48  # start positions per window,
    unroll: int = 6  # drafted positions scored per start
    log_every: int = 20  # steps between log lines
    lr: float = 1e-3  # the head's peak learning rate
    feat_weight: float = 1.0  # weight of SmoothL1 to the target's states
    logit_weight: float = 0.1  # weight of SmoothL1 to the target's raw logits at its top ids
    decay: float = 0.8  # weight of unrolled step j: decay ** (j - 1)
    draft_layers: int = 3  # the cut draft: the target's first layers it keeps,
    draft_rank: int = 128  # its input embedding's rank,
    draft_window: int = 192  # tokens per training window,
    draft_batch: int = 8  # windows per step,
    draft_lr: float = 3e-4  # peak learning rate

    def record(self) -> dict[str, Any]:
        """The knobs as the checkpoint records them."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self).items()}


@torch.inference_mode()
def keep_states(model: Any, rows: list[dict[str, Any]], states: list[torch.Tensor]) -> list[dict[str, Any]]:
    """Shard records keeping the target's states (float16) as `hidden` (`drafting.teacher.Keep`)."""
    return [{"ids": r["ids"], "start": r["prompt_len"], "hidden": s.half().clone(), "temperature": r["temperature"],
             "prompt": r["prompt"]} for r, s in zip(rows, states, strict=True)]


def target_tables(target: Path) -> tuple[torch.Tensor, int]:
    """The target's output embedding [V, d] (its input one when tied) and the vocabulary's size."""
    from safetensors.torch import load_file
    w = load_file(str(target / "model.safetensors"))
    table = w.get("lm_head.weight", w["model.embed_tokens.weight"]).float()
    return table, table.shape[0]


def frequency_order(cfg: HeadsConfig) -> dict[str, Any]:
    """Token counts of the target's training answers (`chat` shards), and how much of the held-out answers
    (`eval`) the top N cover. Counted once (the shards it counted are recorded): the ranking decides every
    head's and draft's output rows, so checkpoints stay valid when the answers phase adds shards; delete
    freq.json to count again (and train afresh)."""
    out = cfg.work / "freq.json"
    if out.exists():
        return dict(json.loads(out.read_text()))
    table, vocab = target_tables(cfg.target)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for r in load_shards(cfg.work, "chat"):
        counts += torch.bincount(torch.tensor(r["ids"][r["start"]:]), minlength=vocab).double()
        # plus the target's expected counts (its distribution at every 4th position): ranks the tokens
        # the answers happen not to contain by how likely the target makes them
        h = r["hidden"][::4].float()  # [n / 4, d]
        counts += 4 * torch.softmax(h @ table.T, -1).sum(0).double()
    order = torch.argsort(counts, descending=True, stable=True)
    ev = torch.cat([torch.tensor(r["ids"][r["start"]:]) for r in load_shards(cfg.work, "eval")])
    rank = torch.empty(vocab, dtype=torch.long)
    rank[order] = torch.arange(vocab)
    sizes = [n for n in (2048, 4096, 8192, 12288, 16384, 24576, 32768) if n <= vocab]
    cover = {n: float((rank[ev] < n).float().mean()) for n in sizes}
    res = {"train_tokens": int(counts.sum() / 2), "distinct": int((counts > 0).sum()), "eval_tokens": int(ev.numel()),
           "coverage": cover, "order": order.tolist(), "shards": shard_names(cfg.work, "chat")}
    out.write_text(json.dumps(res))
    return res


def output_rows(cfg: HeadsConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The output rows' ids ([n_out], most frequent first) and the target's rows for them ([n_out, d])."""
    ids = torch.tensor(frequency_order(cfg)["order"][:cfg.n_out])
    return ids, target_tables(cfg.target)[0][ids]


def make_labels(cfg: HeadsConfig, name: str, names: list[str] | None = None) -> None:
    """The target's top LABEL_K ids (indices into the output rows) and log-probabilities over them at every
    stored position of the shards `names` (all of `name`'s by default), once per shard set."""
    out = cfg.work / f"labels-{name}-{cfg.n_out}.pt"
    names = shard_names(cfg.work, name) if names is None else names
    made_from = {"shards": names, "order": frequency_order(cfg)["order"][:cfg.n_out]}
    if out.exists():
        held = torch.load(out)
        if isinstance(held, dict) and held.get("made_from") == made_from:
            return
    torch.set_num_threads(cfg.threads)
    rows = output_rows(cfg)[1]  # [N, d]
    labels = []
    t0 = time.time()
    for r in load_shards(cfg.work, name, names):
        lp = torch.log_softmax(r["hidden"].float() @ rows.T, -1)  # [n, N]
        val, ix = lp.topk(LABEL_K, -1)  # [n, K]
        labels.append({"ix": ix.int(), "lp": val.half()})
    torch.save({"made_from": made_from, "labels": labels}, out)
    log.info("[labels] %s: %d answers, %.0f s", name, len(labels), time.time() - t0)


def training_set(cfg: HeadsConfig) -> tuple[list[dict[str, Any]], list[dict[str, torch.Tensor]]]:
    """The records and labels of every shard set in `cfg.data` (the target's answers, Python's text)."""
    recs: list[dict[str, Any]] = []
    labels: list[dict[str, torch.Tensor]] = []
    for name in cfg.data.split(","):
        names = shard_names(cfg.work, name)  # the answers phase may add shards meanwhile
        make_labels(cfg, name, names)
        recs += load_shards(cfg.work, name, names)
        labels += list(torch.load(cfg.work / f"labels-{name}-{cfg.n_out}.pt")["labels"])
    assert len(recs) == len(labels)
    return recs, labels


def train_positions(cfg: HeadsConfig) -> dict[str, int]:
    """Stored positions per shard set trained on (the reports' record of the data)."""
    return {n: int(sum(r["hidden"].shape[0] for r in load_shards(cfg.work, n))) for n in cfg.data.split(",")}

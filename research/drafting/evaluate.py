"""The attention head measured as the edge drafts with it, and its export with the record of its making.

On held-out answer rows (answers shards with index % heldout_every == 0, never trained on): from every
start t, the head has the target's real states f_s for s <= t and the committed token x_{t+1}; it drafts
k tokens greedily on its own predicted states and its own argmax tokens (`drafting.train.unroll` with
`own_tokens`), and draft j is compared with the answer's token x_{t+j+1}.

- `by_position[j - 1]`: the share of starts whose draft j agrees, among those whose drafts before j all
  agreed (what a greedy verify accepts at position j given it got there).
- `tokens_per_call[k]`: the mean over starts of min(run, k) + 1, where run counts the leading agreeing
  drafts: the tokens one greedy verify call of a chain of k commits (the accepted drafts and the
  target's own next token).

Starts are the t whose first draft is an answer token (t + 2 >= prompt_len) and whose `k` drafts all lie
in the row. By default only greedy answers (temperature 0) are scored: their tokens are the target's own
choices under the product's processing (repetition penalty 1.1), so agreement there is acceptance.

`prompt_rows` makes such rows for any prompts (the benchmarks' own: the target answers them greedily, then
its states are taken as for training), so either head can be scored offline on exactly what a benchmark
asks; a live figure far below it then points at drafting, one close to it at the data's coverage.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from research.drafting.answers import PENALTY
from research.drafting.states import is_heldout, load_states, output_ids, target_states
from research.drafting.target import Sampling, chat_ids, sample_batch
from research.drafting.train import TrainConfig, trained_head, unroll
from research.heads.attention_head import AttentionHead
from research.heads.feature_head import FeatureHead
from shared.config import SamplingConfig
from shared.features import decode_states, encode_states


@torch.no_grad()
def row_hits(head: AttentionHead | FeatureHead, row: dict[str, Any], k: int) -> torch.Tensor:
    """[N, k] bool: for each start of `row` (a states row), whether draft j agrees with the answer. The
    feature-fed head (research/heads/feature_head.py), the baseline, is scored on the same starts: from f_t
    it steps through x_{t+1}, then through its own argmax drafts, carrying one state (as FeatureDrafter does)."""
    S = row["states"].float()  # [n, d]
    ids = row["ids"].long()  # [L]
    n, start = S.shape[0], row["start"]
    P = start + torch.arange(n)  # [n] positions t
    X = ids[start + 1:start + 1 + n]  # [n] x_{t+1}
    keep = (P + 2 >= row["prompt_len"]) & (P + k + 1 <= ids.numel() - 1)  # [n]
    if not bool(keep.any()):
        return torch.zeros(0, k, dtype=torch.bool)
    if isinstance(head, FeatureHead):
        s, x, steps = S, X, []
        for _ in range(k):
            s = head.step(s, x)  # [n, d]
            x = head.out_ids[head.logits(s).argmax(-1)]  # [n]
            steps.append(x)
        drafts = torch.stack(steps, 1)  # [n, k]
    else:
        preds = unroll(head, S[None], X[None], P[None], k, own_tokens=True)  # k x [1, n, d]
        drafts = torch.stack([head.out_ids[head.logits(g[0]).argmax(-1)] for g in preds], 1)  # [n, k]
    truth = ids[(P[:, None] + torch.arange(2, k + 2)).clamp(max=ids.numel() - 1)]  # [n, k] x_{t+j+1}
    return (drafts == truth)[keep]  # [N, k]


def summarise(hits: torch.Tensor) -> dict[str, Any]:
    """Agreement by draft position and tokens per verify call for chains 2..k, from hits ([N, k] bool)."""
    n, k = hits.shape
    alive = torch.cumprod(hits.int(), 1)  # [N, k] drafts 1..j all agreed
    before = torch.cat([torch.ones(n, 1, dtype=torch.int), alive[:, :-1]], 1)  # [N, k] drafts 1..j-1 agreed
    run = alive.sum(1)  # [N] leading agreeing drafts
    return {"starts": n,
            "by_position": [round(float(alive[:, j].sum() / before[:, j].sum().clamp(min=1)), 4) for j in range(k)],
            "tokens_per_call": {kk: round(float(run.clamp(max=kk).float().mean() + 1), 4) if n else 0.0
                                for kk in range(2, k + 1)}}


def evaluate(head: AttentionHead | FeatureHead, rows: list[dict[str, Any]], k: int = 8) -> dict[str, Any]:
    """`summarise` over every start of `rows` (either head)."""
    parts = [row_hits(head, r, k) for r in rows]
    res = summarise(torch.cat(parts) if parts else torch.zeros(0, k, dtype=torch.bool))
    return {"rows": len(rows), **res}


@torch.inference_mode()
def prompt_rows(tok: Any, model: Any, prompts: list[str], window: int, max_new: int = 256,
                batch: int = 8) -> list[dict[str, Any]]:
    """States rows (as `drafting.states.target_states` makes them) of the target's greedy answers, with the
    edge's repetition penalty, to each of `prompts`, in order; `batch` prompts per forward."""
    s = Sampling(SamplingConfig(temperature=0.0, repetition_penalty=PENALTY), max_new, (int(tok.eos_token_id),))
    chats = [chat_ids(tok, p) for p in prompts]
    news: list[list[int]] = []
    for b0 in range(0, len(chats), batch):
        news += sample_batch(model, chats[b0:b0 + batch], s, torch.Generator())
    rows = [{"prompt_len": len(c), "ids": c + n, "temperature": 0.0} for c, n in zip(chats, news, strict=True)]
    return target_states(model, rows, window, batch)


def on_wire(rows: list[dict[str, Any]], encoding: str) -> list[dict[str, Any]]:
    """`rows` with their states as the edge receives them: through `encoding` ("float16" or "int8", one
    scale per state: shared/features.py) and back, so a head is scored on the precision it drafts from."""
    return [{**r, "states": decode_states(encode_states(r["states"], encoding, 0))} for r in rows]


def open_rows(rows: list[dict[str, Any]], w: int, first: int = 64, k: int = 8) -> list[dict[str, Any]]:
    """`rows` as a session opened with `feature_window` w sees their start: of the prompt's states only its
    last w (the open answer's), and only the answer's first `first` starts (t = prompt_len - 2 ..; later
    ones see the answer's own states in their window whatever the open sent), with the `k` tokens their
    drafts are compared to."""
    out = []
    for r in rows:
        pl, start = r["prompt_len"], r["start"]
        drop = max(0, pl - w - start)  # states of prompt positions before pl - w
        last = pl + first - 3  # the last start kept
        n = max(0, min(r["states"].shape[0] - drop, last - start - drop + 1))
        out.append({**r, "states": r["states"][drop:drop + n], "start": start + drop, "ids": r["ids"][:last + k + 2]})
    return [r for r in out if r["states"].shape[0] > 0]


def heldout_rows(cfg: TrainConfig, greedy_only: bool = True) -> tuple[list[dict[str, Any]], list[int]]:
    """The first `cfg.eval_rows` held-out states rows (greedy answers only by default) and their shards."""
    d = Path(cfg.work) / "states"
    shards = sorted(i for i in (int(p.stem) for p in d.glob("*.pt")) if is_heldout(i, cfg.heldout_every))
    rows = [r for i in shards for r in load_states(d / f"{i:05d}.pt")
            if not greedy_only or r.get("temperature", 0.0) == 0.0]
    return rows[:cfg.eval_rows], shards


def export(cfg: TrainConfig, out_dir: Path, command: str) -> dict[str, Any]:
    """The checkpoint's head into `out_dir` (attention_head.json, .safetensors), measured as the edge
    loads it (bfloat16 weights, run in float32) into report.json, with training.json: the commands, data,
    steps and time that made it."""
    head, state = trained_head(cfg)
    head.save(out_dir)
    edge = AttentionHead.load(out_dir)
    rows, held = heldout_rows(cfg)
    freq = output_ids(Path(cfg.work), Path(cfg.data), head.cfg.vocab_size, cfg.n_out, cfg.heldout_every)
    report = {"heldout_greedy": evaluate(edge, rows, cfg.eval_k), "heldout_shards": held,
              "n_out": cfg.n_out, "coverage_heldout": freq["coverage_heldout"], "steps": state["step"]}
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    training = {"export_command": command, "train_commands": state.get("commands", []), "target": cfg.target,
                "data": {"root": cfg.data, "train_shards": state["shards"], "heldout_shards": held,
                         "train_positions": state["positions"], "train_answer_tokens": state.get("answer_tokens", 0)},
                "steps": state["step"], "minutes": round(state["seconds"] / 60, 1),
                "config": state.get("config", asdict(cfg)), "log": state["log"]}
    (out_dir / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    return report


@torch.no_grad()
def pair_agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position ([..., V] logits of the target p and the draft q at the same positions): whether
    their greedy choices agree, and beta = sum_x min(p(x), q(x)) at T = 1, the chance a sampled draft
    token is accepted (both [...])."""
    p, q = torch.softmax(p_logits.float(), -1), torch.softmax(q_logits.float(), -1)  # [..., V]
    return p.argmax(-1) == q.argmax(-1), torch.minimum(p, q).sum(-1)

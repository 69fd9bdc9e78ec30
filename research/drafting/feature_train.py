"""The feature-fed head (research/heads/feature_head.py) trained on the target's stored states, and export.

The target stays frozen: the head's output rows are the target's own for the frequency-ranked ids, its
input embedding a projection of the target's table onto its top principal directions (both frozen).
The loss is unrolled: from every window position's state the head steps `unroll` times on the target's
tokens, carrying its own states, and step j is scored by cross-entropy over every output row against the
target's top LABEL_K (renormalised), SmoothL1 to the target's state there, and SmoothL1 to the target's
raw logits at its top ids. The loop is `drafting.loop.fit`, checkpointed to `<work>/head.pt`; the export
writes the head (bfloat16 weights) and report.json: `drafting.evaluate.evaluate` on the held-out answers
(agreement by draft position, tokens per verify call), as the edge loads the head.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from research.drafting.evaluate import evaluate
from research.drafting.feature_data import (
    LABEL_K,
    HeadsConfig,
    frequency_order,
    target_tables,
    train_positions,
    training_set,
)
from research.drafting.loop import Budget, fit, new_state, save_checkpoint, warmup_cosine
from research.drafting.teacher import load_shards
from research.heads.feature_head import FeatureHead, FeatureHeadConfig

log = logging.getLogger(__name__)


class Windows:
    """Training windows over the answers: the target's states, the tokens they predict, their top labels."""

    def __init__(self, recs: list[dict[str, Any]], labels: list[dict[str, torch.Tensor]], width: int) -> None:
        self.width = width
        keep = [i for i, r in enumerate(recs) if r["hidden"].shape[0] > 8]
        self.hidden = [recs[i]["hidden"] for i in keep]
        self.tokens = [torch.tensor(recs[i]["ids"][recs[i]["start"]:]) for i in keep]
        self.ix = [labels[i]["ix"] for i in keep]
        self.lp = [labels[i]["lp"] for i in keep]
        self.sizes = torch.tensor([h.shape[0] for h in self.hidden], dtype=torch.float64)

    def batch(self, b: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """H [B, W, d]; A [B, W] (A[:, i] is the token H[:, i] predicts); IX, LP [B, W, K]; valid [B, W]."""
        d, w = self.hidden[0].shape[1], self.width
        out = {"H": torch.zeros(b, w, d), "A": torch.zeros(b, w, dtype=torch.long),
               "IX": torch.zeros(b, w, LABEL_K, dtype=torch.long), "LP": torch.zeros(b, w, LABEL_K),
               "valid": torch.zeros(b, w, dtype=torch.bool)}
        for r, i in enumerate(torch.multinomial(self.sizes, b, replacement=True, generator=gen).tolist()):
            n = self.hidden[i].shape[0]
            o = int(torch.randint(0, max(1, n - w + 1), (1,), generator=gen))
            m = min(w, n - o)
            out["H"][r, :m] = self.hidden[i][o:o + m].float()
            out["A"][r, :m] = self.tokens[i][o:o + m]
            out["IX"][r, :m] = self.ix[i][o:o + m].long()
            out["LP"][r, :m] = self.lp[i][o:o + m].float()
            out["valid"][r, :m] = True
        return out


def unrolled_loss(head: FeatureHead, bt: dict[str, torch.Tensor], cfg: HeadsConfig) -> tuple[torch.Tensor, list[float]]:
    """The unrolled loss of one batch (module docstring). The raw-logit term matters because softmax
    forgets a shift of the logits and the repetition penalty does not (it divides positive logits and
    multiplies negative ones). Returns the loss and, per step, how often the head's argmax over every
    output row is the target's top id."""
    H, A, IX, LP, valid = bt["H"], bt["A"], bt["IX"], bt["LP"], bt["valid"]
    n = H.shape[1] - cfg.unroll
    s = H[:, :n]  # [B, n, d]
    loss = H.new_zeros(())
    agree = []
    for j in range(1, cfg.unroll + 1):
        s = head.step(s, A[:, j - 1: n + j - 1])  # [B, n, d]
        ok = valid[:, j: n + j].float()  # [B, n]
        ix, lp = IX[:, j: n + j], LP[:, j: n + j]  # [B, n, K]
        raw = head.logits(s)  # [B, n, n_out]
        logq = torch.log_softmax(raw, -1)  # [B, n, n_out]
        ce = -(torch.softmax(lp, -1) * logq.gather(-1, ix)).sum(-1)  # [B, n]
        fl = torch.nn.functional.smooth_l1_loss(s, H[:, j: n + j], reduction="none").mean(-1)  # [B, n]
        term = ce + cfg.feat_weight * fl  # [B, n]
        if cfg.logit_weight:
            with torch.no_grad():
                target_raw = head.logits(H[:, j: n + j]).gather(-1, ix)  # [B, n, K]: E h at the target's top ids
            term = term + cfg.logit_weight * torch.nn.functional.smooth_l1_loss(
                raw.gather(-1, ix), target_raw, reduction="none").mean(-1)
        loss = loss + cfg.decay ** (j - 1) * (term * ok).sum() / ok.sum().clamp(min=1)
        with torch.no_grad():
            agree.append(float(((logq.argmax(-1) == ix[..., 0]).float() * ok).sum() / ok.sum().clamp(min=1)))
    return loss, agree


def new_head(cfg: HeadsConfig) -> FeatureHead:
    """A head with the target's output rows for the frequency-ranked ids and its projected input table."""
    from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint
    table, vocab = target_tables(cfg.target)
    hc = FeatureHeadConfig(hidden_size=table.shape[1], vocab_size=vocab, n_out=cfg.n_out,
                           embed_dim=min(FeatureHeadConfig.embed_dim, table.shape[1]), target_model_id=cfg.target.name,
                           tokenizer_fingerprint=tokenizer_fingerprint(load_tokenizer(cfg.target)))
    head = FeatureHead(hc)
    ids = torch.tensor(frequency_order(cfg)["order"][:cfg.n_out])
    head.out_ids.copy_(ids)
    head.out.data.copy_(table[ids])
    centred = table - table.mean(0)
    _, _, v = torch.linalg.svd(centred, full_matrices=False)  # v [d, d]
    proj = centred @ v[: hc.embed_dim].T  # [V, embed_dim]
    head.embed.weight.data.copy_(proj / proj.std())
    return head


def fit_checkpointed(ck: Path, key: str, module: torch.nn.Module, lr: float, warmup: int, cfg: HeadsConfig,
                     seed: int, batch_loss: Callable[[torch.Generator], tuple[torch.Tensor, dict[str, Any]]]) -> None:
    """`drafting.loop.fit` on `module`'s trainable parameters (AdamW, warm-up then cosine to 10 %) for the
    config's budget, checkpointed to `ck` (the module under `key`, the optimizer, the state) every 5 minutes
    and at the end, resumed from it when it exists; batches are drawn with a generator seeded by the step."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    state = new_state()
    if ck.exists():
        saved = torch.load(ck, weights_only=False)
        module.load_state_dict(saved[key])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
    log.info("[%s] from step %d", key, state["step"])
    gen = torch.Generator().manual_seed(seed + state["step"])
    state["args"] = cfg.record()
    budget = Budget(steps=cfg.train_steps, minutes=0.0 if cfg.train_steps else cfg.train_minutes)
    fit(params, opt, lambda: batch_loss(gen), warmup_cosine(lr, warmup), budget, state, log_every=cfg.log_every,
        tag=key, save=lambda: save_checkpoint(ck, {key: module.state_dict(), "opt": opt.state_dict(), "state": state}))


def train_feature_head(cfg: HeadsConfig) -> None:
    """Train (or resume) the head to the budget; checkpoint `head.pt`."""
    torch.set_num_threads(cfg.threads)
    head = new_head(cfg)
    data = Windows(*training_set(cfg), cfg.window + cfg.unroll)
    log.info("head: %d answers, %d positions", len(data.hidden), int(data.sizes.sum()))

    def batch_loss(gen: torch.Generator) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, agree = unrolled_loss(head, data.batch(cfg.batch, gen), cfg)
        return loss, {"agree": [round(a, 3) for a in agree]}

    fit_checkpointed(cfg.work / "head.pt", "head", head, cfg.lr, 100, cfg, 1000, batch_loss)


def states_rows(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shard records as `drafting.states` rows (hidden[i] sits at position start - 1 + i), for evaluation."""
    return [{"states": r["hidden"], "ids": torch.as_tensor(r["ids"]), "start": r["start"] - 1,
             "prompt_len": r["start"], "temperature": r.get("temperature", 0.0)} for r in recs]


def export_feature_head(cfg: HeadsConfig, out: Path) -> dict[str, Any]:
    """The trained head into `out` (bfloat16 weights, config) and report.json: agreement on the held-out
    answers and on a training sample, measured as the edge loads the head."""
    torch.set_num_threads(cfg.threads)
    saved = torch.load(cfg.work / "head.pt", weights_only=False)
    head = new_head(cfg)
    head.load_state_dict(saved["head"])
    head.eval().save(out)
    edge = FeatureHead.load(out)  # what the edge loads (bfloat16 weights, float32 compute)
    evals = load_shards(cfg.work, "eval")
    report = {"train_positions": train_positions(cfg), "eval_prompts": len(evals), "steps": saved["state"]["step"],
              "train_minutes": round(saved["state"]["seconds"] / 60, 1), "n_out": cfg.n_out,
              "freq_coverage": frequency_order(cfg)["coverage"],
              "eval": evaluate(edge, states_rows(evals)),
              "train_sample": evaluate(edge, states_rows(load_shards(cfg.work, "chat")[:48])),
              "train_args": saved["state"].get("args", {})}  # what the training ran with
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report

"""The tokens-only draft cut from the target: its first layers, distilled on the target's stored labels.

The draft keeps the target's embedding as a rank-`draft_rank` PCA (frozen), its first `draft_layers`
decoder layers and final norm, and its output rows for the `n_out` most frequent ids; all but the
embedding train. Windows of whole texts (prompt and answer) are scored at the answer's positions: the
cross-entropy of the draft's distribution over its rows against the target's top LABEL_K (renormalised),
plus SmoothL1 of its raw logits at those ids against the target's (E h). The loop is the feature-fed
head's (`drafting.feature_train.fit_checkpointed`, checkpoint `draft-L<layers>.pt`); the export is a
compact directory (edge/drafters/compact.py) with the target's tokenizer files and report.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from research.drafting.evaluate import summarise
from research.drafting.feature_data import LABEL_K, HeadsConfig, output_rows, train_positions, training_set
from research.drafting.feature_train import fit_checkpointed
from research.drafting.teacher import load_shards


def new_draft(cfg: HeadsConfig) -> tuple[Any, dict[str, torch.Tensor]]:
    """The draft (module docstring) and its compact tables (edge/drafters/compact.py)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    mc = AutoConfig.from_pretrained(cfg.target)
    mc.num_hidden_layers = cfg.draft_layers
    mc.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(mc, dtype=torch.float32, attn_implementation="sdpa")
    w = load_file(str(cfg.target / "model.safetensors"))
    keep = {k: v.float() for k, v in w.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < cfg.draft_layers}
    table = keep.pop("lm_head.weight", keep["model.embed_tokens.weight"])  # [V, d]
    mean = table.mean(0)
    _, _, vt = torch.linalg.svd(table - mean, full_matrices=False)
    lowrank = (table - mean) @ vt[:cfg.draft_rank].T  # [V, r]
    up = vt[:cfg.draft_rank]  # [r, d]
    keep["model.embed_tokens.weight"] = lowrank @ up + mean  # the embedding the edge rebuilds
    ids, rows = output_rows(cfg)
    model.load_state_dict(keep, strict=False)
    model.set_output_embeddings(torch.nn.Linear(table.shape[1], ids.numel(), bias=False))
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(rows)
    model.get_input_embeddings().weight.requires_grad_(False)
    # the mean folds into the low-rank factors: one more rank-one term
    tables = {"lowrank": torch.cat([lowrank, torch.ones(lowrank.shape[0], 1)], 1), "up": torch.cat([up, mean[None]]),
              "out_ids": ids}
    return model, tables


class Sequences:
    """Training windows of whole texts (prompt and answer), scored at the answer's positions."""

    def __init__(self, recs: list[dict[str, Any]], labels: list[dict[str, torch.Tensor]], width: int) -> None:
        self.recs, self.labels, self.width = recs, labels, width
        self.sizes = torch.tensor([len(r["ids"]) - r["start"] for r in recs], dtype=torch.float64)

    def batch(self, b: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """ids [B, T]; H [B, T, d] (the target's state where scored); IX, LP [B, T, K]; scored [B, T]."""
        w = self.width
        d = self.recs[0]["hidden"].shape[1]
        out = {"ids": torch.zeros(b, w, dtype=torch.long), "H": torch.zeros(b, w, d),
               "IX": torch.zeros(b, w, LABEL_K, dtype=torch.long), "LP": torch.zeros(b, w, LABEL_K),
               "scored": torch.zeros(b, w, dtype=torch.bool)}
        for r, i in enumerate(torch.multinomial(self.sizes, b, replacement=True, generator=gen).tolist()):
            rec, lab = self.recs[i], self.labels[i]
            ids, first = rec["ids"], rec["start"] - 1  # position `first` + j predicts answer token j
            n = rec["hidden"].shape[0]
            # a window that ends inside the answer, with as much of the text before as fits
            end = min(len(ids), first + 1 + int(torch.randint(1, n + 1, (1,), generator=gen)))
            o = max(0, end - w)
            out["ids"][r, :end - o] = torch.tensor(ids[o:end])
            j0 = max(first, o)  # the first scored position
            a, z = j0 - first, min(end - first, n)  # answer rows a .. z - 1 sit at positions j0 .. end - 1
            span = slice(j0 - o, j0 - o + z - a)
            out["H"][r, span] = rec["hidden"][a:z].float()
            out["IX"][r, span] = lab["ix"][a:z].long()
            out["LP"][r, span] = lab["lp"][a:z].float()
            out["scored"][r, span] = True
        return out


def draft_loss(model: Any, target_rows: torch.Tensor, bt: dict[str, torch.Tensor], logit_weight: float
               ) -> tuple[torch.Tensor, float]:
    """The loss of one batch (module docstring) and the draft's greedy agreement with the target's top id."""
    okf = bt["scored"].float()  # [B, T]
    logits = model(input_ids=bt["ids"]).logits  # [B, T, n_out]
    lq = torch.log_softmax(logits, -1)
    term = -(torch.softmax(bt["LP"], -1) * lq.gather(-1, bt["IX"])).sum(-1)  # [B, T]
    if logit_weight:
        with torch.no_grad():
            want = torch.einsum("btkd,btd->btk", target_rows[bt["IX"]], bt["H"])  # [B, T, K]
        term = term + logit_weight * torch.nn.functional.smooth_l1_loss(
            logits.gather(-1, bt["IX"]), want, reduction="none").mean(-1)
    loss = (term * okf).sum() / okf.sum().clamp(min=1)
    with torch.no_grad():
        agree = float(((logits.argmax(-1) == bt["IX"][..., 0]).float() * okf).sum() / okf.sum().clamp(min=1))
    return loss, agree


def train_cut_draft(cfg: HeadsConfig) -> None:
    """Train (or resume) the draft to the budget; checkpoint `draft-L<layers>.pt`."""
    torch.set_num_threads(cfg.threads)
    model, _ = new_draft(cfg)
    model.train()
    data = Sequences(*training_set(cfg), cfg.draft_window)
    target_rows = output_rows(cfg)[1]  # [n_out, d]

    def batch_loss(gen: torch.Generator) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, agree = draft_loss(model, target_rows, data.batch(cfg.draft_batch, gen), cfg.logit_weight)
        return loss, {"agree": round(agree, 3)}

    fit_checkpointed(cfg.work / f"draft-L{cfg.draft_layers}.pt", "model", model, cfg.draft_lr, 50, cfg, 2000,
                     batch_loss)


@torch.no_grad()
def draft_agreement(drafter: Any, recs: list[dict[str, Any]], k: int = 8) -> dict[str, Any]:
    """`drafting.evaluate.summarise` of a tokens-only draft on answers, teacher-forced: while its greedy
    drafts agree with the target's tokens its context is the target's text, so draft j from start i
    agrees when its greedy choice at position i + j - 1 is the answer's token."""
    parts = []
    for r in recs:
        ids, first = r["ids"], r["start"] - 1
        if len(ids) - first < k + 1:
            continue
        logits = drafter.model(input_ids=torch.tensor([ids[:-1]])).logits[0, first:]  # [n, rows]
        pred = drafter.out_ids[logits.argmax(-1)] if drafter.out_ids is not None else logits.argmax(-1)
        good = pred == torch.tensor(ids[first + 1:])  # [n]
        parts.append(good.unfold(0, k, 1))  # [n - k + 1, k]: draft j from start i is good[i + j - 1]
    return summarise(torch.cat(parts) if parts else torch.zeros(0, k, dtype=torch.bool))


def export_cut_draft(cfg: HeadsConfig, out: Path) -> dict[str, Any]:
    """The trained draft into `out` as a compact directory (bfloat16), with the target's tokenizer files
    and report.json (agreement on the held-out answers), measured as the edge loads it."""
    from edge.drafters.compact import save_compact
    from edge.drafters.model import ModelDrafter
    torch.set_num_threads(cfg.threads)
    saved = torch.load(cfg.work / f"draft-L{cfg.draft_layers}.pt", weights_only=False)
    model, tables = new_draft(cfg)
    model.load_state_dict(saved["model"])
    save_compact(model.eval(), tables["out_ids"], model.get_output_embeddings().weight, tables["lowrank"],
                 tables["up"], out)
    for f in cfg.target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    drafter = ModelDrafter(out)  # what the edge loads
    report = {"layers": cfg.draft_layers, "embed_rank": cfg.draft_rank, "n_out": cfg.n_out,
              "train_positions": train_positions(cfg), "steps": saved["state"]["step"],
              "train_minutes": round(saved["state"]["seconds"] / 60, 1),
              "eval": draft_agreement(drafter, load_shards(cfg.work, "eval")),
              "train_sample": draft_agreement(drafter, load_shards(cfg.work, "chat")[:48]),
              "train_args": saved["state"].get("args", {})}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report

"""A small Llama draft distilled from the target on its top-k log-probabilities (sequence-level KD).

Data (`drafting.teacher` shards under the work directory, `keep_topk`: each record keeps the target's
top `topk` log-probabilities over the vocabulary and their ids at every answer position): its answers to
the chat and code prompts (`drafting.distill_prompts`), chunks of the standard library's source, and
"What does `module.name` do in Python?" answered by that function's docstring (`drafting.corpus`).

The draft is a Llama of `layers` x `width` with tied embeddings, its table initialised from the target's
projected onto its top principal directions (so the output layer starts as a good unigram model); the
loss is the cross-entropy of the draft against the target's renormalised top-k (forward KL up to a
constant). The loop is `drafting.loop.fit` (warm-up 50 steps, cosine over the minutes), checkpointed to
`<work>/ckpt.pt`, which picks up shards a data phase running alongside has written since. The export
measures greedy agreement and beta against the live target on the held-out answers (`pair_agreement`).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from research.drafting.evaluate import pair_agreement
from research.drafting.loop import Budget, fit, new_state, save_checkpoint, warmup_cosine

log = logging.getLogger(__name__)


@dataclass
class DistillConfig:
    """Every knob of the distillation's training and export (scripts/distill_draft.py's options)."""

    work: Path  # data and checkpoint directory
    target: Path  # the target model's directory
    layers: int = 4  # the draft's Llama layers
    width: int = 256  # its residual width (heads of 64)
    batch: int = 8  # records per step
    lr: float = 2e-3  # peak learning rate
    train_minutes: float = 90.0  # minutes of steps
    save_every_s: float = 180.0  # seconds between checkpoints
    topk: int = 32  # teacher log-probs kept per position
    threads: int = 1  # torch threads


def keep_topk(topk: int) -> Any:
    """A `drafting.teacher.Keep` storing the target's top `topk` log-probabilities (float16) and ids."""
    @torch.inference_mode()
    def keep(model: Any, rows: list[dict[str, Any]], states: list[torch.Tensor]) -> list[dict[str, Any]]:
        out = []
        for r, s in zip(rows, states, strict=True):
            val, ind = torch.log_softmax(model.lm_head(s).float(), -1).topk(topk, -1)  # [n, K]
            out.append({"prompt": r["prompt"], "ids": r["ids"], "start": r["prompt_len"], "top_lp": val.half(),
                        "top_ix": ind.int(), "sampled": r["temperature"] > 0})
        return out
    return keep


def doc_rows(tok: Any, docs: list[tuple[str, str]], max_answer: int) -> list[dict[str, Any]]:
    """Chat rows asking what `name` does, answered by its docstring (at most `max_answer` tokens, then eos)."""
    from research.drafting.target import chat_ids
    eos = int(tok.eos_token_id)
    rows = []
    for name, doc in docs:
        prompt = chat_ids(tok, f"What does `{name}` do in Python?")
        answer = tok(doc, add_special_tokens=False).input_ids[:max_answer] + [eos]
        rows.append({"ids": prompt + answer, "prompt_len": len(prompt), "temperature": 0.0, "prompt": None})
    return rows


def make_draft(cfg: DistillConfig) -> Any:
    """The draft (module docstring), seeded."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    target: Any = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32)
    tc = target.config
    lc = LlamaConfig(vocab_size=tc.vocab_size, hidden_size=cfg.width, intermediate_size=cfg.width * 3,
                     num_hidden_layers=cfg.layers, num_attention_heads=max(1, cfg.width // 64),
                     num_key_value_heads=max(1, cfg.width // 128), head_dim=64,
                     max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                     rope_parameters=dict(tc.rope_parameters), tie_word_embeddings=True,
                     bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id)
    torch.manual_seed(0)
    draft = AutoModelForCausalLM.from_config(lc)
    emb = target.get_input_embeddings().weight.detach()  # [V, d]
    _, _, vh = torch.linalg.svd(emb - emb.mean(0, keepdim=True), full_matrices=False)  # vh [d, d]
    small = emb @ vh[:cfg.width].T  # [V, width]
    draft.get_input_embeddings().weight.data.copy_(small * (0.5 / small.std()))  # unit scale, halved
    return draft


def load_records(work: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, held-out `eval-` records) of every shard in `work`."""
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for shard in sorted(work.glob("*.pt")):
        if shard.name != "ckpt.pt":
            (evals if shard.name.startswith("eval-") else train).extend(torch.load(shard, weights_only=False))
    return train, evals


def batch_loss(draft: Any, recs: list[dict[str, Any]]) -> tuple[torch.Tensor, int]:
    """Soft cross-entropy of the draft against the target's renormalised top-k at labelled positions."""
    width = max(len(r["ids"]) for r in recs)
    x = torch.zeros((len(recs), width), dtype=torch.long)  # [B, W] right-padded
    att = torch.zeros_like(x)
    for i, r in enumerate(recs):
        x[i, :len(r["ids"])] = torch.tensor(r["ids"])
        att[i, :len(r["ids"])] = 1
    hidden = draft.model(input_ids=x, attention_mask=att).last_hidden_state  # [B, W, width]
    total, count = hidden.new_zeros(()), 0
    for i, r in enumerate(recs):
        n = r["top_lp"].shape[0]
        # label j predicts ids[start + j] from ids[:start + j]: the logits at position start + j - 1; the
        # output layer (most of the cost) runs only where there is a label
        pos = slice(r["start"] - 1, r["start"] - 1 + n)
        logq = torch.log_softmax(draft.lm_head(hidden[i, pos]), dim=-1)  # [n, V]
        p = torch.softmax(r["top_lp"].float(), dim=-1)  # [n, K] renormalised top-k
        total = total - (p * logq.gather(-1, r["top_ix"].long())).sum()
        count += n
    return total / max(count, 1), count


def train(cfg: DistillConfig) -> dict[str, Any]:
    """Train (or resume) the draft to the budget; returns the run's state."""
    torch.set_num_threads(cfg.threads)
    records = load_records(cfg.work)[0]
    while not records:  # the data phase may still be running in another process: wait for its first shard
        time.sleep(30)
        records = load_records(cfg.work)[0]
    ckpt = cfg.work / "ckpt.pt"
    draft = make_draft(cfg)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    state: dict[str, Any] = {**new_state(), "tokens": 0}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log.info("resumed at step %d (%.1f min trained)", state["step"], state["seconds"] / 60)
    rng = random.Random(state["step"])
    draft.train()

    def loss_of() -> tuple[torch.Tensor, dict[str, Any]]:
        loss, n = batch_loss(draft, rng.sample(records, min(cfg.batch, len(records))))
        state["tokens"] += n
        return loss, {"tokens": state["tokens"]}

    def save() -> None:
        nonlocal records
        save_checkpoint(ckpt, {"model": draft.state_dict(), "opt": opt.state_dict(), "state": state})
        records = load_records(cfg.work)[0]  # shards written since (a data phase running alongside)
        log.info("checkpoint at step %d; %d training sequences", state["step"], len(records))

    return fit(list(draft.parameters()), opt, loss_of, warmup_cosine(cfg.lr, 50), Budget(minutes=cfg.train_minutes),
               state, log_every=20, tag="distill", save=save, checkpoint_s=cfg.save_every_s)


def export(cfg: DistillConfig, out: Path) -> dict[str, Any]:
    """The draft in Hugging Face format (bfloat16 weights) with the target's tokenizer, and
    distill_report.json: greedy agreement and beta at T = 1 against the live target on the held-out
    greedy answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(cfg.threads)
    saved = torch.load(cfg.work / "ckpt.pt", weights_only=False)
    draft = make_draft(cfg)
    draft.load_state_dict(saved["model"])
    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(cfg.target).save_pretrained(out)
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).eval()
    greedy = [r for r in load_records(cfg.work)[1] if not r["sampled"]]
    agree = beta = n = 0.0
    with torch.no_grad():
        for r in greedy:
            x = torch.tensor([r["ids"]])  # [1, T]
            s = r["start"] - 1
            a, b = pair_agreement(target(x).logits[0, s:-1], shipped(x).logits[0, s:-1])  # [n], [n]
            agree, beta, n = agree + float(a.sum()), beta + float(b.sum()), n + a.numel()
    state = saved["state"]
    report = {"eval_prompts": len(greedy), "eval_tokens": int(n), "greedy_agreement": round(agree / max(n, 1), 4),
              "beta_T1": round(beta / max(n, 1), 4), "train_steps": state["step"],
              "train_minutes": round(state["seconds"] / 60, 1), "train_tokens": state["tokens"],
              "shape": {"layers": cfg.layers, "width": cfg.width},
              "parameters_M": round(sum(p.numel() for p in shipped.parameters()) / 1e6, 2),
              "loss_log_tail": state["log"][-5:]}
    (out / "distill_report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report

"""The bundled demo pair: a byte-level BPE tokenizer, a GPT-2 target and a GPT-2 draft distilled from it.

The corpus is the Python standard library's own source (`drafting.corpus`: its held-out files are what
`bench/` prompts come from). The target learns next-token cross-entropy; the draft the forward KL to the
frozen target's distribution at every position (mass-covering, which is what makes beta = sum_x min(p, q)
high). Both train with `drafting.loop.fit` on a wall-clock budget (warm-up over the first 3 % of it, then
cosine to 10 %) in bfloat16 autocast. `report_pair` measures the held-out loss of each, their greedy
agreement and beta (`drafting.evaluate.pair_agreement`) and batch-1 ms/token.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from research.drafting.corpus import read_text
from research.drafting.evaluate import pair_agreement
from research.drafting.loop import Budget, fit

EOS = "<|endoftext|>"
VOCAB = 4096
N_POSITIONS = 512


@dataclass
class ModelShape:
    # transformer blocks
    n_layer: int
    # residual width
    n_embd: int
    # attention heads
    n_head: int


TARGET = ModelShape(n_layer=8, n_embd=256, n_head=8)
DRAFT = ModelShape(n_layer=2, n_embd=128, n_head=4)


def train_tokenizer(files: list[Path], out_dir: Path) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator((read_text(p) for p in files), vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,  # the Rust tokenizer behind the wrapper
        bos_token=EOS, eos_token=EOS, unk_token=EOS, model_max_length=N_POSITIONS,
    )
    tok.save_pretrained(out_dir)
    return tok


def encode_files(tok: PreTrainedTokenizerFast, files: list[Path]) -> np.ndarray:
    """Every file's ids, each followed by eos ([n_tokens] uint16)."""
    eos = tok.eos_token_id
    chunks = [np.asarray(tok(t)["input_ids"] + [eos], dtype=np.uint16) for t in map(read_text, files) if t]
    return np.concatenate(chunks)  # [n_tokens]


def batches(data: np.ndarray, batch: int, seq: int, gen: np.random.Generator) -> Iterator[torch.Tensor]:
    while True:
        starts = gen.integers(0, len(data) - seq - 1, size=batch)
        x = np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int64)  # [batch, seq + 1]
        yield torch.from_numpy(x)


def make_model(shape: ModelShape, tok: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=N_POSITIONS, n_embd=shape.n_embd, n_layer=shape.n_layer,
        n_head=shape.n_head, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(cfg)


def lr_at(peak: float, warm: float = 0.03) -> Callable[[int, float], float]:
    """Linear warm-up over the first `warm` of the budget, then cosine to 10 % of peak."""
    def lr(_step: int, frac: float) -> float:
        if frac < warm:
            return peak * frac / warm
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warm) / (1 - warm)))))
    return lr


def ce_loss(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        logits = model(x[:, :-1]).logits  # [batch, seq, vocab]
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
    return fn


def kl_loss(draft: Any, target: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p_logits = target(x[:, :-1]).logits.float()  # [batch, seq, vocab]
        q_logits = draft(x[:, :-1]).logits.float()  # [batch, seq, vocab]
        # forward KL(p || q): mass-covering, which is what maximises sum min(p, q)
        return F.kl_div(F.log_softmax(q_logits, -1), F.log_softmax(p_logits, -1), log_target=True,
                        reduction="batchmean") / x.size(1)
    return fn


def train_model(model: Any, loss_fn: Callable[[torch.Tensor], torch.Tensor], data: np.ndarray, budget: Budget,
                peak_lr: float, batch: int, seq: int, name: str) -> dict[str, Any]:
    """`fit` on windows of `data`; returns the run's steps, tokens, seconds and final loss (EMA)."""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    it = batches(data, batch, seq, np.random.default_rng(0))

    def loss_of() -> tuple[torch.Tensor, dict[str, Any]]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(next(it)), {}

    model.train()
    state = fit(list(model.parameters()), opt, loss_of, lr_at(peak_lr), budget, {}, log_every=50, tag=name)
    model.eval()
    return {"steps": state["step"], "tokens": state["step"] * batch * seq, "seconds": round(state["seconds"], 1),
            "final_loss_ema": state["loss_ema"]}


@torch.no_grad()
def evaluate(target: Any, draft: Any, data: np.ndarray, seq: int, n_windows: int) -> dict[str, float]:
    """Held-out loss of each, greedy agreement and beta at T = 1 over `n_windows` windows."""
    x = next(batches(data, n_windows, seq, np.random.default_rng(1)))  # [n, seq + 1]
    stats = {"target_val_loss": 0.0, "draft_val_loss": 0.0, "greedy_agreement": 0.0, "beta_t1": 0.0}
    for row in x.split(8):
        p_logits = target(row[:, :-1]).logits.float()  # [b, seq, vocab]
        q_logits = draft(row[:, :-1]).logits.float()  # [b, seq, vocab]
        y = row[:, 1:]
        n = row.size(0) / x.size(0)
        agree, beta = pair_agreement(p_logits, q_logits)  # [b, seq] each
        stats["target_val_loss"] += n * F.cross_entropy(p_logits.transpose(1, 2), y).item()
        stats["draft_val_loss"] += n * F.cross_entropy(q_logits.transpose(1, 2), y).item()
        stats["greedy_agreement"] += n * agree.float().mean().item()
        stats["beta_t1"] += n * beta.mean().item()
    return {k: round(v, 4) for k, v in stats.items()}


@torch.no_grad()
def ms_per_token(model: Any, prompt: torch.Tensor, new_tokens: int, repeats: int = 3) -> float:
    """Batch-1 incremental decoding with a KV cache: median ms per generated token."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = model(prompt, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times.append((time.perf_counter() - t0) * 1000 / new_tokens)
    return round(sorted(times)[len(times) // 2], 3)


def report_pair(target: Any, draft: Any, tok: Any, val_ids: np.ndarray, seq: int, smoke: bool) -> dict[str, Any]:
    """Held-out validation loss, greedy agreement, beta at T=1, and batch-1 ms/token of each."""
    n_windows = 16 if smoke else 256
    report: dict[str, Any] = evaluate(target, draft, val_ids, seq, n_windows)
    prompt = torch.from_numpy(val_ids[:64].astype(np.int64))[None]  # [1, 64]
    n_new = 8 if smoke else 128
    report["target_ms_per_token"] = ms_per_token(target, prompt, n_new)
    report["draft_ms_per_token"] = ms_per_token(draft, prompt, n_new)
    report["cost_ratio_target_over_draft"] = round(report["target_ms_per_token"] / report["draft_ms_per_token"], 2)
    report.update({
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "vocab": len(tok), "held_out_tokens": int(len(val_ids)), "held_out_windows": n_windows, "window": seq,
        "torch_threads": torch.get_num_threads(), "machine": f"{platform.machine()} {platform.processor()}",
        "python": platform.python_version(), "torch": torch.__version__,
    })
    return report

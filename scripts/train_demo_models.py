"""Train the bundled demo pair: a byte-level BPE tokenizer, a GPT-2 target, a distilled GPT-2 draft.

The corpus is the Python standard library's own source, which every Python install has.
Files are split into train / held-out by a hash of their path (stable across versions), so
`bench/` can take prompts the pair never saw.

    python scripts/train_demo_models.py --out models --target-minutes 40 --draft-minutes 15
    python scripts/train_demo_models.py --out /tmp/smoke --smoke      # a few steps, for CI
    python scripts/train_demo_models.py --out models --eval-only      # re-measure the committed pair

Stages: tokenizer -> target (next-token cross-entropy) -> draft (forward KL to the frozen
target's distribution at every position, so that beta = sum_x min(p, q) is high) -> report
(validation loss, greedy agreement, beta, ms/token) written to OUT/training_report.json.
Schedules are by wall-clock time, so a run fits its budget on any CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

log = logging.getLogger("train_demo")
EOS = "<|endoftext|>"
HELD_OUT_MODULUS = 20  # a file is held out when crc32(relative path) % 20 == 0 (~5%)


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
VOCAB = 4096
N_POSITIONS = 512


def is_held_out(rel_path: str) -> bool:
    """True for the ~5% of stdlib files kept out of training (stable: hashes the path)."""
    return zlib.crc32(rel_path.encode()) % HELD_OUT_MODULUS == 0


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, held_out) lists of the standard library's .py files, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[Path] = []
    held: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        (held if is_held_out(rel) else train).append(path)
    return train, held


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def train_tokenizer(files: list[Path], out_dir: Path) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    texts = (read_text(p) for p in files)
    bpe.train_from_iterator(texts, vocab_size=VOCAB, min_frequency=2, special_tokens=[EOS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,  # the Rust tokenizer behind the wrapper
        bos_token=EOS, eos_token=EOS, unk_token=EOS, model_max_length=N_POSITIONS,
    )
    tok.save_pretrained(out_dir)
    return tok


def encode_files(tok: PreTrainedTokenizerFast, files: list[Path]) -> np.ndarray:
    eos = tok.eos_token_id
    chunks = []
    for p in files:
        text = read_text(p)
        if text:
            chunks.append(np.asarray(tok(text)["input_ids"] + [eos], dtype=np.uint16))
    return np.concatenate(chunks)  # [n_tokens]


def batches(data: np.ndarray, batch: int, seq: int, gen: np.random.Generator):
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


def lr_at(frac: float, peak: float, warm: float = 0.03) -> float:
    """Linear warm-up then cosine decay to 10% of peak, as a function of elapsed-time fraction."""
    if frac < warm:
        return peak * frac / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warm) / (1 - warm)))))


def train_loop(model, loss_fn, data, minutes: float, max_steps: int, peak_lr: float, batch: int, seq: int,
               name: str) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = np.random.default_rng(0)
    it = batches(data, batch, seq, gen)
    t0, step, seen, ema = time.perf_counter(), 0, 0, None
    budget = minutes * 60.0
    model.train()
    while step < max_steps:
        frac = (time.perf_counter() - t0) / budget
        if frac >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(frac, peak_lr)
        x = next(it)  # [batch, seq + 1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += batch * seq
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            el = time.perf_counter() - t0
            log.info("%s step %d loss %.3f tok/s %.0f elapsed %.0fs", name, step, ema, seen / el, el)
    model.eval()
    return {"steps": step, "tokens": seen, "seconds": round(time.perf_counter() - t0, 1), "final_loss_ema": ema}


def ce_loss(model):
    def fn(x):
        logits = model(x[:, :-1]).logits  # [batch, seq, vocab]
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
    return fn


def kl_loss(draft, target):
    def fn(x):
        with torch.no_grad():
            p_logits = target(x[:, :-1]).logits.float()  # [batch, seq, vocab]
        q_logits = draft(x[:, :-1]).logits.float()  # [batch, seq, vocab]
        # forward KL(p || q): mass-covering, which is what maximises sum min(p, q)
        return F.kl_div(F.log_softmax(q_logits, -1), F.log_softmax(p_logits, -1), log_target=True,
                        reduction="batchmean") / x.size(1)
    return fn


@torch.no_grad()
def evaluate(target, draft, data: np.ndarray, seq: int, n_windows: int) -> dict:
    gen = np.random.default_rng(1)
    x = next(batches(data, n_windows, seq, gen))  # [n, seq + 1]
    stats = {"target_val_loss": 0.0, "draft_val_loss": 0.0, "greedy_agreement": 0.0, "beta_t1": 0.0}
    for row in x.split(8):
        p_logits = target(row[:, :-1]).logits.float()  # [b, seq, vocab]
        q_logits = draft(row[:, :-1]).logits.float()  # [b, seq, vocab]
        y = row[:, 1:]
        n = row.size(0) / x.size(0)
        stats["target_val_loss"] += n * F.cross_entropy(p_logits.transpose(1, 2), y).item()
        stats["draft_val_loss"] += n * F.cross_entropy(q_logits.transpose(1, 2), y).item()
        stats["greedy_agreement"] += n * (p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean().item()
        beta = torch.minimum(p_logits.softmax(-1), q_logits.softmax(-1)).sum(-1)  # [b, seq]
        stats["beta_t1"] += n * beta.mean().item()
    return {k: round(v, 4) for k, v in stats.items()}


@torch.no_grad()
def ms_per_token(model, prompt: torch.Tensor, new_tokens: int, repeats: int = 3) -> float:
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


def report_pair(target, draft, tok, val_ids: np.ndarray, seq: int, smoke: bool) -> dict:
    """Held-out validation loss, greedy agreement, beta at T=1, and batch-1 ms/token of each."""
    n_windows = 16 if smoke else 256
    report = evaluate(target, draft, val_ids, seq, n_windows)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--target-minutes", type=float, default=40.0)
    ap.add_argument("--draft-minutes", type=float, default=15.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--smoke", action="store_true", help="a few steps on a small corpus, for CI")
    ap.add_argument("--resume", action="store_true",
                    help="continue training the pair saved in OUT (same tokenizer) instead of starting afresh")
    ap.add_argument("--eval-only", action="store_true",
                    help="skip training: load OUT/demo-target and OUT/demo-draft and rewrite the report")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    train_files, held_files = stdlib_files()
    max_steps = 10**9
    if args.smoke:
        train_files, held_files, max_steps = train_files[:40], held_files[:5], 3
    log.info("corpus: %d train files, %d held-out files", len(train_files), len(held_files))
    t_dir, d_dir = args.out / "demo-target", args.out / "demo-draft"
    report_path = args.out / "training_report.json"
    if args.eval_only:
        tok = PreTrainedTokenizerFast.from_pretrained(t_dir)
        target = GPT2LMHeadModel.from_pretrained(t_dir).eval()
        draft = GPT2LMHeadModel.from_pretrained(d_dir).eval()
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        report.update(report_pair(target, draft, tok, encode_files(tok, held_files), args.seq, args.smoke))
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        log.info("report: %s", json.dumps(report))
        return

    t_dir.mkdir(parents=True, exist_ok=True)
    d_dir.mkdir(parents=True, exist_ok=True)
    previous = json.loads(report_path.read_text()) if args.resume and report_path.exists() else {}
    if args.resume:
        tok = PreTrainedTokenizerFast.from_pretrained(t_dir)
        target = GPT2LMHeadModel.from_pretrained(t_dir)
        has_draft = (d_dir / "config.json").exists()
        draft = GPT2LMHeadModel.from_pretrained(d_dir) if has_draft else make_model(DRAFT, tok)
        tok.save_pretrained(d_dir)
    else:
        tok = train_tokenizer(train_files, t_dir)
        tok.save_pretrained(d_dir)
        target, draft = make_model(TARGET, tok), make_model(DRAFT, tok)
    train_ids, val_ids = encode_files(tok, train_files), encode_files(tok, held_files)
    log.info("tokens: train %d, held-out %d", len(train_ids), len(val_ids))

    peak = 1e-3 if args.resume else 2e-3  # a continued run starts from a trained model: a gentler peak
    t_stats = train_loop(target, ce_loss(target), train_ids, args.target_minutes, max_steps, peak,
                         args.batch, args.seq, "target")
    target.save_pretrained(t_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    d_stats = train_loop(draft, kl_loss(draft, target), train_ids, args.draft_minutes, max_steps, 1.5 * peak,
                         args.batch, args.seq, "draft")
    draft.save_pretrained(d_dir)

    report = report_pair(target, draft, tok, val_ids, args.seq, args.smoke)
    runs_t = previous.get("target_training_runs", [previous["target_training"]] if "target_training" in previous else [])
    runs_d = previous.get("draft_training_runs", [previous["draft_training"]] if "draft_training" in previous else [])
    report.update({
        "target_shape": asdict(TARGET), "draft_shape": asdict(DRAFT),
        "target_training_runs": runs_t + [t_stats], "draft_training_runs": runs_d + [d_stats],
        "train_tokens_available": int(len(train_ids)),
    })
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    log.info("report: %s", json.dumps(report))


if __name__ == "__main__":
    main()

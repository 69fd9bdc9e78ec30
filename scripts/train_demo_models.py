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
Schedules are by wall-clock time, so a run fits its budget on any CPU. The work is drafting/'s
(`demo_pair`, `corpus`, `loop`); this is the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402

from research.drafting.corpus import stdlib_files  # noqa: E402
from research.drafting.demo_pair import (  # noqa: E402
    DRAFT,
    TARGET,
    ce_loss,
    encode_files,
    kl_loss,
    make_model,
    report_pair,
    train_model,
    train_tokenizer,
)
from research.drafting.loop import Budget  # noqa: E402

log = logging.getLogger("train_demo")


def wall_clock(minutes: float, max_steps: int) -> Budget:
    """`minutes` of wall-clock time (no pause cap), or `max_steps` steps first when > 0."""
    return Budget(steps=max_steps, minutes=minutes, pause_cap=float("inf"))


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
    max_steps = 0
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
    t_stats = train_model(target, ce_loss(target), train_ids, wall_clock(args.target_minutes, max_steps), peak,
                          args.batch, args.seq, "target")
    target.save_pretrained(t_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    d_stats = train_model(draft, kl_loss(draft, target), train_ids, wall_clock(args.draft_minutes, max_steps),
                          1.5 * peak, args.batch, args.seq, "draft")
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

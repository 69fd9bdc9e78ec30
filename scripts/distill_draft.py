"""Distil a small draft from SmolLM2-135M-Instruct on this CPU; resumable, phase by phase.

    python scripts/distill_draft.py --work runs/distill --out models/smollm2-135m-draft \
        --train-minutes 90 --threads 1

Phases (each skipped when its output exists, so a stopped run resumes where it was):
1. prompts   a varied set of chat and code prompts built from templates x topics (fixed seed); whole
             topics are held out, so the evaluation prompts are unseen in wording and subject.
2. answers   the target's own answers (greedy for two thirds, T = 0.8 samples for the rest), generated
             in batches and teacher-forced once written; the target's log-probabilities at every answer position are kept as soft labels
             (top `--topk`, float16), i.e. sequence-level knowledge distillation.
3. stdlib    extra text that ships with Python (the standard library's source), scored by the target;
   docs      and chat-shaped extra text: "What does `module.name` do in Python?" answered by that
             function's or class's docstring, scored by the target at the answer positions.
4. train     (may run alongside phases 2-3 in a second process: it picks up new shards at each checkpoint)
             the draft: a Llama of `--layers` x `--width` with tied embeddings, its embedding table
             initialised from the target's projected onto its top principal directions (so the output
             layer starts as a good unigram/bigram model); loss = cross-entropy of the draft against the
             target's top-k distribution renormalised (forward KL up to a constant). Time-budgeted,
             checkpointed every few minutes (`ckpt.pt`), resumed by rerunning the same command.
5. export    the draft in Hugging Face format (weights stored as bfloat16 to fit the repository; the
             loader upcasts to float32), the target's tokenizer files beside it, and `report.json` with
             greedy agreement and beta = sum min(p, q) at T = 1 on the held-out prompts' target answers,
             computed against the live target (exact, not from the top-k labels).

The work is drafting/'s (`distill`, `distill_prompts`, `teacher`, `corpus`); this is the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from research.drafting import distill  # noqa: E402
from research.drafting.corpus import stdlib_docstrings, stdlib_files, text_chunks  # noqa: E402
from research.drafting.distill_prompts import build_prompts  # noqa: E402
from research.drafting.target import load_target  # noqa: E402
from research.drafting.teacher import Answering, text_rows, write_answer_shards, write_teacher_shards  # noqa: E402

TARGET = "models/smollm2-135m-instruct"


def data(args: argparse.Namespace, cfg: distill.DistillConfig) -> None:
    tok, model = load_target(cfg.target, cfg.threads)
    keep = distill.keep_topk(cfg.topk)
    if args.phase in ("all", "data"):
        train_prompts, eval_prompts = build_prompts()
        (args.work / "prompts.json").write_text(json.dumps({"train": train_prompts, "eval": eval_prompts}, indent=0))
        write_answer_shards(args.work, "eval", tok, model, eval_prompts, Answering(args.gen_batch, args.max_new), keep)
        write_answer_shards(args.work, "chat", tok, model, train_prompts[:args.train_prompts],
                            Answering(args.gen_batch, args.max_new, sample_every=3, temperature=0.8), keep)
    if args.phase in ("all", "data", "stdlib"):
        chunks = text_chunks(tok, stdlib_files(top_level=True)[0], args.chunk, 4 * args.chunk, args.stdlib_chunks, 1)
        write_teacher_shards(args.work, "stdlib", model, text_rows(chunks), keep)
    if args.phase in ("all", "data", "docs"):
        rows = distill.doc_rows(tok, stdlib_docstrings(args.doc_answers), args.chunk)
        write_teacher_shards(args.work, "docs", model, rows, keep)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/distill"))
    ap.add_argument("--out", default="models/smollm2-135m-draft")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gen-batch", type=int, default=24)
    ap.add_argument("--max-new", type=int, default=160, help="answer tokens at most")
    ap.add_argument("--topk", type=int, default=32, help="teacher log-probs kept per position")
    ap.add_argument("--train-prompts", type=int, default=480)
    ap.add_argument("--stdlib-chunks", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--doc-answers", type=int, default=480, help="docstring answers (phase docs)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--train-minutes", type=float, default=90.0)
    ap.add_argument("--save-every-s", type=float, default=180.0)
    ap.add_argument("--phase", choices=["all", "data", "stdlib", "docs", "train", "export"], default="all")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not Path(TARGET, "config.json").exists():
        print(f"{TARGET} is missing: run `specsplit-models prepare smollm2` first", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    cfg = distill.DistillConfig(work=args.work, target=Path(TARGET), layers=args.layers, width=args.width,
                                batch=args.batch, lr=args.lr, train_minutes=args.train_minutes,
                                save_every_s=args.save_every_s, topk=args.topk, threads=args.threads)
    if args.phase in ("all", "data", "stdlib", "docs"):
        data(args, cfg)
    if args.phase in ("all", "train"):
        distill.train(cfg)
    if args.phase in ("all", "export"):
        print(json.dumps(distill.export(cfg, Path(args.out)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

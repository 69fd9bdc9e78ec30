"""Train the drafts of SmolLM2-135M-Instruct on this CPU; resumable, phase by phase.

    nice -n 19 .venv/bin/python research/scripts/train_heads.py --work /work/runs/heads all

Phases (each skips what its output already holds, so a stopped run resumes where it was):
1. prompts  the training and held-out prompt sets (`research/scripts/head_prompts.py`).
2. answers  the target's own answers to the training prompts, generated in batches of `--gen-batch`
            rows per forward (left-padded, per-row positions), greedy for three batches in four and
            sampled at T = 0.7 for the fourth. Each shard keeps the token ids and the target's last
            hidden state after its final norm (the output layer's input, float16; teacher-forced over the answer
            once it is written) at every position from the prompt's last to the answer's last but one, so the target's full distribution at any
            of those positions is `softmax(E h)` and needs no storage.
3. eval     the same for the held-out prompts (greedy only): what every agreement figure is measured on.
   doc-answers  the same for prompts about the standard library's documented functions (`docs` shards).
   text     the target teacher-forced over Python's own text (`text` shards, same layout).
4. freq     the token frequencies of the target's training answers (counts plus the target's expected
            counts): the frequency-ranked output rows (FR-Spec) and their coverage of the held-out answers.
            Counted once: every head and draft trained later keeps these rows.
5. labels   the target's top-32 ids over those rows and their log-probabilities at every stored position
            of the shard sets trained on (`--data`), recomputed when a set has gained shards.
6. train    the feature-fed head (`research/heads/feature_head.py`) with the target frozen (its output rows
            and a projection of its embeddings, frozen), by an unrolled loss: from every position's state
            the head steps `--unroll` times on the target's tokens, carrying its own states, and each step
            is scored by cross-entropy over every output row against the target's top-32, SmoothL1 to
            the target's state there, and SmoothL1 to the target's raw logits at its top-32 ids.
            Time-budgeted, checkpointed every 5 minutes (`head.pt`), resumed by rerunning the command.
7. export   the head into `--out` (bfloat16 weights), with `report.json`: greedy agreement by draft
            position and tokens per verify call at fixed k on the held-out answers.
8. draft-train, draft-export  the tokens-only draft cut from the target (`new_draft`), distilled the same
            way and exported as a compact directory (`edge/drafters/compact.py`) with its report.

The work is drafting/'s: `teacher` (answers and text shards), `feature_data` (output rows, labels),
`feature_train` (the head, its loop and export), `cut_draft` (the tokens-only draft); this is the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "research" / "scripts"))

from research.drafting.corpus import stdlib_files, text_chunks  # noqa: E402
from research.drafting.cut_draft import export_cut_draft, train_cut_draft  # noqa: E402
from research.drafting.feature_data import HeadsConfig, frequency_order, keep_states, make_labels  # noqa: E402
from research.drafting.feature_train import export_feature_head, train_feature_head  # noqa: E402
from research.drafting.target import load_target  # noqa: E402
from research.drafting.teacher import Answering, text_rows, write_answer_shards, write_teacher_shards  # noqa: E402


def config(args: argparse.Namespace) -> HeadsConfig:
    return HeadsConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(HeadsConfig)
                          if hasattr(args, f.name)})


def answers(args: argparse.Namespace, cfg: HeadsConfig, prompts: list[str], name: str, sample_every: int) -> None:
    tok, model = load_target(cfg.target, cfg.threads)
    write_answer_shards(cfg.work, name, tok, model, prompts,
                        Answering(args.gen_batch, args.max_new, sample_every, 0.7, args.answer_shards), keep_states)


def text(args: argparse.Namespace, cfg: HeadsConfig) -> None:
    """The target teacher-forced over Python's own source (test packages and held-out files left out),
    in chunks of --text-chunk tokens, 8 a shard."""
    tok, model = load_target(cfg.target, cfg.threads)
    w = args.text_chunk
    chunks = text_chunks(tok, stdlib_files(tests=False)[0], w, w, -(-args.text_tokens // w), seed=7)
    write_teacher_shards(cfg.work, "text", model, text_rows(chunks), keep_states)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["prompts", "answers", "doc-answers", "eval", "text", "freq", "train", "export",
                                      "draft-train", "draft-export", "all"])
    ap.add_argument("--work", type=Path, required=True, help="data and checkpoints (outside the work tree)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "research" / "models" / "smollm2-135m-head", help="where export writes")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--train-prompts", type=int, default=4000)
    ap.add_argument("--answer-shards", type=int, default=1 << 30,
                    help="stop the answers phase after this many shards (the shortest prompts first)")
    ap.add_argument("--doc-prompts", type=int, default=1500, help="prompts about the standard library's docs")
    ap.add_argument("--text-tokens", type=int, default=800_000, help="teacher-forced tokens of Python's own text")
    ap.add_argument("--text-chunk", type=int, default=256)
    ap.add_argument("--data", default="chat", help="comma-separated shard sets to train on: chat, docs, text")
    ap.add_argument("--n-out", type=int, default=16384, help="rows of the frequency-ranked output layer")
    ap.add_argument("--train-minutes", type=float, default=60)
    ap.add_argument("--train-steps", type=int, default=0,
                    help="budget in steps instead of minutes (a machine shared with other work slows steps, not this)")
    ap.add_argument("--batch", type=int, default=32, help="windows per step")
    ap.add_argument("--window", type=int, default=48, help="start positions per window")
    ap.add_argument("--unroll", type=int, default=6, help="drafted positions scored per start")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--feat-weight", type=float, default=1.0)
    ap.add_argument("--logit-weight", type=float, default=0.1,
                    help="weight of SmoothL1 between the head's and the target's raw logits at the target's top ids")
    ap.add_argument("--decay", type=float, default=0.8, help="weight of unrolled step j: decay ** (j - 1)")
    ap.add_argument("--draft-layers", type=int, default=3, help="the target's first layers the tokens-only draft keeps")
    ap.add_argument("--draft-rank", type=int, default=128, help="rank of the tokens-only draft's input embedding")
    ap.add_argument("--draft-window", type=int, default=192, help="tokens per training window of the draft")
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--draft-lr", type=float, default=3e-4)
    ap.add_argument("--draft-out", type=Path, default=REPO / "models" / "smollm2-135m-draft-from-target")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    cfg = config(args)
    from head_prompts import build_prompts
    train, evals = build_prompts()
    (args.work / "prompts.json").write_text(json.dumps({"train": train, "eval": evals}, indent=0))
    if args.phase in ("eval", "all"):
        answers(args, cfg, evals, "eval", sample_every=0)
    if args.phase in ("answers", "all"):
        answers(args, cfg, train[:args.train_prompts], "chat", sample_every=4)
    if args.phase in ("doc-answers", "all"):
        from head_prompts import doc_prompts
        answers(args, cfg, doc_prompts(args.doc_prompts), "docs", sample_every=4)
    if args.phase in ("text", "all"):
        text(args, cfg)
    if args.phase in ("freq", "train", "all"):
        for name in cfg.data.split(","):
            make_labels(cfg, name)
    if args.phase in ("train", "all"):
        train_feature_head(cfg)
    if args.phase in ("export", "all"):
        print(json.dumps(export_feature_head(cfg, args.out)["eval"], indent=1))
    if args.phase in ("draft-train", "all"):
        train_cut_draft(cfg)
    if args.phase in ("draft-export", "all"):
        print(json.dumps(export_cut_draft(cfg, args.draft_out)["eval"], indent=1))
    if args.phase == "freq":
        res = frequency_order(cfg)
        print({k: v for k, v in res.items() if k != "order"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

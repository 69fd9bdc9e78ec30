"""The attention head's phases: target states, training, evaluation, export (drafting/ does the work).

    nice -n 19 .venv/bin/python research/scripts/train_attention_head.py states
    nice -n 19 .venv/bin/python research/scripts/train_attention_head.py train --minutes 600
    nice -n 19 .venv/bin/python research/scripts/train_attention_head.py eval
    nice -n 19 .venv/bin/python research/scripts/train_attention_head.py eval --prompts specbench [--feature-head DIR]
    nice -n 19 .venv/bin/python research/scripts/train_attention_head.py export --out research/models/smollm2-135m-attention-head

Every knob of drafting.train.TrainConfig is an option (--work, --batch, --unroll, ...); give the same
ones to every phase. Each phase resumes: `states` skips shards already done, `train` continues from
<work>/ckpt.pt (stop it with SIGTERM or Ctrl-C to checkpoint at once, SIGSTOP / SIGCONT to pause, and
rerun the same command after a kill to lose at most --checkpoint-minutes). Never run in setup or CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from research.drafting.evaluate import evaluate, export, heldout_rows, on_wire, open_rows, prompt_rows  # noqa: E402
from research.drafting.states import make_states, output_ids  # noqa: E402
from research.drafting.target import load_target  # noqa: E402
from research.drafting.train import TrainConfig, train, trained_head  # noqa: E402
from research.heads.attention_head import AttentionHead  # noqa: E402
from research.heads.feature_head import FeatureHead  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, TrainConfig]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["states", "train", "eval", "export"])
    ap.add_argument("--out", type=Path, default=REPO / "research" / "models" / "smollm2-135m-attention-head",
                    help="export: the head directory to write")
    ap.add_argument("--head", type=Path, help="eval: an exported head directory (default: the checkpoint)")
    ap.add_argument("--feature-head", type=Path,
                    help="eval: a feature-fed head directory (e.g. research/models/smollm2-135m-head), on the same rows")
    ap.add_argument("--prompts", choices=["bench", "specbench"],
                    help="eval: score on the target's greedy answers to the real-pair bench's chat prompts or "
                         "the Spec-Bench subset (by category) instead of held-out shards; answers and states "
                         "are made once and kept in <work>/prompts-<name>.pt")
    ap.add_argument("--encoding", choices=["float16", "int8"], default="float16",
                    help="eval: the states' precision on the wire (each row's states encoded and decoded)")
    ap.add_argument("--open-window", type=int, default=None,
                    help="eval: score only the answers' first 64 starts, with the prompt's last this many states "
                         "(what a session opened with feature_window W sees; drafting.evaluate.open_rows)")
    ap.add_argument("--states-batch", type=int, default=16, help="states: rows per target forward")
    for f in dataclasses.fields(TrainConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                        help=f"(default {f.default})")
    args = ap.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    return args, cfg


def prompt_sets(name: str, cfg: TrainConfig) -> dict[str, list[dict]]:
    """name -> states rows of the target's greedy answers: "bench" (bench/real_pair.py's chat prompts, all,
    and the first 4 the bench runs live) or "specbench" (the committed subset's first turns, by category)."""
    import torch
    cache = Path(cfg.work) / f"prompts-{name}.pt"
    if name == "bench":
        from bench.real_pair import PROMPTS
        groups = {"all": list(PROMPTS)}
    else:
        groups = {}
        for line in (REPO / "bench" / "specbench" / "questions.jsonl").read_text().splitlines():
            q = json.loads(line)
            groups.setdefault(q["category"], []).append(q["turns"][0])
    if cache.exists():
        made = torch.load(cache, weights_only=True)
    else:
        tok, model = load_target(Path(cfg.target), cfg.threads)
        made = {g: prompt_rows(tok, model, ps, cfg.window) for g, ps in groups.items()}
        torch.save(made, cache)
    if name == "bench":
        made = {"all": made["all"], "first 4 (live bench)": made["all"][:4]}
    return {**made, "all": [r for g in groups for r in made[g]]} if name == "specbench" else made


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args, cfg = parse(argv)
    command = shlex.join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))
    work = Path(cfg.work)
    if args.phase == "states":
        _, model = load_target(Path(cfg.target), cfg.threads)
        make_states(work, Path(cfg.data), model, cfg.window, args.states_batch)
        freq = output_ids(work, Path(cfg.data), model.config.vocab_size, cfg.n_out, cfg.heldout_every)
        print(json.dumps({k: v for k, v in freq.items() if k != "ids"}))
    elif args.phase == "train":
        state = train(cfg, command)
        print(json.dumps({k: state[k] for k in ("step", "seconds", "positions", "answer_tokens")}))
    elif args.phase == "eval":
        head = (FeatureHead.load(args.feature_head) if args.feature_head else
                AttentionHead.load(args.head) if args.head else trained_head(cfg)[0])
        if args.prompts:
            sets = prompt_sets(args.prompts, cfg)
            print(json.dumps({name: evaluate(head, on_wire(rows, args.encoding), cfg.eval_k)
                              for name, rows in sets.items()}, indent=1))
        else:
            rows = heldout_rows(cfg)[0]
            if args.open_window is not None:
                rows = open_rows(rows, args.open_window, k=cfg.eval_k)
            print(json.dumps(evaluate(head, on_wire(rows, args.encoding), cfg.eval_k), indent=1))
    else:
        print(json.dumps(export(cfg, args.out, command), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

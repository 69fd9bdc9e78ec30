"""Generate the head's training data: requests the target writes, then its answers; shard by shard.

    nice -n 19 .venv/bin/python research/scripts/head_data.py --shards 400 [--specbench question.jsonl]
    nice -n 19 .venv/bin/python research/scripts/head_data.py --templates 36 [--specbench question.jsonl]

Shard i holds the requests written with seed i (`data/head/requests/`) and the answers to them
(`data/head/answers/`); both are gzipped JSON lines of text and token ids, small enough to commit.
With --templates N the requests are instead the product's templated prompts (research/scripts/head_prompts.py:
the feature-fed head's explanations, lists, advice, creative tasks, code and standard-library questions,
its held-out subjects left out), answered the same way into shards 1000 to 1000 + N - 1.
Rerunning resumes at the first missing shard; a lost machine costs at most the shard in progress.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from research.drafting.answers import write_answers  # noqa: E402
from research.drafting.heldout import HeldOut, evaluation_texts  # noqa: E402
from research.drafting.requests import FIXED_FIRST, RequestFilter, fixed_requests, write_requests  # noqa: E402
from research.drafting.shards import DATA, iter_rows, read_shard, shard_indices, shard_path, write_shard  # noqa: E402
from research.drafting.target import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=DATA, help="data directory (default data/head)")
    ap.add_argument("--shards", type=int, default=400, help="stop once this many shards exist")
    ap.add_argument("--requests", type=int, default=192, help="candidate requests written per shard")
    ap.add_argument("--batch", type=int, default=64, help="rows per forward")
    ap.add_argument("--max-new", type=int, default=256, help="most answer tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--specbench", type=Path, help="Spec-Bench's whole question.jsonl, held out too")
    ap.add_argument("--templates", type=int, default=0,
                    help="answer the first N shards of the templated prompts instead (shards 1000..)")
    ap.add_argument("--per-shard", type=int, default=150, help="templated prompts per shard")
    args = ap.parse_args()
    held = HeldOut(evaluation_texts(args.specbench))
    filt = RequestFilter(held)
    if args.templates:
        from head_prompts import build_prompts, doc_prompts
        fixed = fixed_requests(build_prompts()[0] + doc_prompts(), args.per_shard, held)
        todo = range(FIXED_FIRST, FIXED_FIRST + min(args.templates, len(fixed)))
    else:
        for row in iter_rows(args.root, "requests"):
            if row["kind"] != "template":
                filt.add(row["text"])
        todo = range(args.shards)
    tok, model = load_target(threads=args.threads)
    done = set(shard_indices(args.root, "answers"))
    for i in todo:
        if i in done:
            continue
        t0 = time.time()
        req_path = shard_path(args.root, "requests", i)
        if req_path.exists():
            reqs = read_shard(req_path)
        elif args.templates:
            reqs = fixed[i - FIXED_FIRST]
            write_shard(req_path, reqs)
        else:
            reqs = write_requests(tok, model, args.requests, seed=i, batch=args.batch, filt=filt)
            write_shard(req_path, reqs)
        t1 = time.time()
        rows, dropped = write_answers(tok, model, reqs, first_index=i, seed=i, batch=args.batch,
                                      max_new=args.max_new, held=held)
        write_shard(shard_path(args.root, "answers", i), rows)
        n = sum(len(r["ids"]) - r["prompt_len"] for r in rows)
        print(f"shard {i}: {len(reqs)} requests in {t1 - t0:.0f} s ({dict(filt.dropped)} dropped so far), "
              f"{len(rows)} answers, {n} tokens in {time.time() - t1:.0f} s ({n / (time.time() - t1):.0f} tok/s), "
              f"{dropped} dropped for evaluation overlap", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

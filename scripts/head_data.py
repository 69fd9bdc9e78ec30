"""Generate the head's training data: requests the target writes, then its answers; shard by shard.

    nice -n 19 .venv/bin/python scripts/head_data.py --shards 400 [--specbench question.jsonl]

Shard i holds the requests written with seed i (`data/head/requests/`) and the answers to them
(`data/head/answers/`); both are gzipped JSON lines of text and token ids, small enough to commit.
Rerunning resumes at the first missing shard; a lost machine costs at most the shard in progress.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafting.answers import write_answers  # noqa: E402
from drafting.heldout import HeldOut, evaluation_texts  # noqa: E402
from drafting.requests import RequestFilter, write_requests  # noqa: E402
from drafting.shards import DATA, iter_rows, read_shard, shard_indices, shard_path, write_shard  # noqa: E402
from drafting.target import load_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=DATA, help="data directory (default data/head)")
    ap.add_argument("--shards", type=int, default=400, help="stop once this many shards exist")
    ap.add_argument("--requests", type=int, default=192, help="candidate requests written per shard")
    ap.add_argument("--batch", type=int, default=64, help="rows per forward")
    ap.add_argument("--max-new", type=int, default=256, help="most answer tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--specbench", type=Path, help="Spec-Bench's whole question.jsonl, held out too")
    args = ap.parse_args()
    held = HeldOut(evaluation_texts(args.specbench))
    filt = RequestFilter(held)
    for row in iter_rows(args.root, "requests"):
        filt.add(row["text"])
    tok, model = load_target(threads=args.threads)
    done = set(shard_indices(args.root, "answers"))
    for i in range(args.shards):
        if i in done:
            continue
        t0 = time.time()
        req_path = shard_path(args.root, "requests", i)
        if req_path.exists():
            reqs = read_shard(req_path)
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

"""What a token tree's verify row costs the cloud's forward against a chain's of as many tokens, in one run:

    python -m bench.tree_cost [--threads 1] [--sessions 1,4]

The coder target as the cloud loads it (`TargetModel`, --dtype auto, batch-invariant), a context of `CONTEXT`
positions per session, median of `REPEATS` forwards of each shape, new positions cropped back after each: a
chain of k drafts (k + 1 rows), the same k nodes sent as a one-branch tree (every node the child of the one
before: the tree kernel, `attend_tree`), and a tree of two branches (k / 2 nodes each). The engine runs a
one-branch tree as the chain it is (cloud/engine.py `plan_round`): the first ratio is what that saves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.forward_cost import MODELS, cpu_line

CONTEXT = 256
REPEATS = 7


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sessions", default="1,4", help="sessions a forward, comma-separated")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from cloud.runners.torch_runner import TargetModel
    from shared.kvpool import Row

    sessions = [int(x) for x in args.sessions.split(",")]
    load = os.getloadavg()[0]
    m = TargetModel(MODELS["coder"], "cpu", "auto", invariant=True)
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, m.support, (n,), generator=g).tolist()

    slots = []
    for _ in range(max(sessions)):
        s = m.pool.allocate()
        for c in range(0, CONTEXT, 64):
            m.forward([Row(s, c, ids(64), 0)])
        slots.append(s)

    def timed(n: int, tree: tuple[int, ...] | None, S: int) -> float:
        times = []
        for _ in range(REPEATS + 1):
            rows = [Row(x, CONTEXT, ids(n + 1), n + 1, tree=tree, tree_base=CONTEXT + 1) for x in slots[:S]]
            t0 = time.perf_counter()
            m.forward(rows)
            times.append((time.perf_counter() - t0) * 1000)
            for r in rows:
                m.pool.crop(r.seq_id, r.num_cached_tokens)
        return statistics.median(times[1:])  # the first warms the kernels

    print(f"tree-cost: {cpu_line()}; {args.threads} torch thread(s); load average {load:.2f} at the start")
    print("| drafts | sessions | chain ms | one-branch tree / chain | two-branch tree / chain |")
    print("|---|---|---|---|---|")
    for k in (4, 8, 16):
        one = tuple([-1] + list(range(k - 1)))
        h = k // 2
        two = tuple([-1] + list(range(h - 1)) + [-1] + list(range(h, k - 1)))
        for S in sessions:
            chain = timed(k, None, S)
            print(f"| {k} | {S} | {chain:.0f} | {timed(k, one, S) / chain:.3f} | {timed(k, two, S) / chain:.3f} |",
                  flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()

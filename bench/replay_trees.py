"""The capacity curve's recorded trees replayed offline: tokens and target rows a verify round for fixed shapes and
for the edge's own count (edge/policy/tree.py), with no cloud. Greedy verification is deterministic, so a round's
accepted nodes are the longest path matching the reference text; its cost is priced as `base + row x rows` (the
cloud's fit). Reads bench/results/capacity_curve_trees.json, which `specsplit-bench --only capacity-curve` leaves.

    python -m bench.replay_trees [--base-ms 370] [--row-ms 44] [--fresh] [--seeded]

--fresh starts every session with a new controller (as the curve's workers at 16 sessions and more do); without it
each session carries the last one's (TreeControl.carry). --seeded starts each new controller's acceptance by q from
the pool of every earlier session's rounds, as the cloud's open answer gives it (`node_acceptance`,
shared/node_value.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench.capacity_curve import cut
from bench.cloud_proc import REPO
from edge.drafters.base import DraftBlock
from edge.policy.tree import TreeControl
from shared.node_value import NodeCalibration
from shared.tree import depths

N_NEW = 32


def accepted(tokens: list[int], parents: list[int], ref: list[int]) -> list[int]:
    """The nodes a greedy target keeps: the path that follows the reference from the root."""
    at, kept = -1, []
    for tok in ref:
        kids = [j for j, p in enumerate(parents) if p == at and tokens[j] == tok]
        if not kids:
            break
        at = kids[0]
        kept.append(at)
    return kept


def replay(tables: list[dict[str, Any]], policy: str, base: float, row: float, fresh: bool,
           seeded: bool = False) -> tuple[float, float, float]:
    """Tokens a round, rows a round, and tokens per second of priced cost, over every table."""
    tokens = rows = rounds = 0
    ctl: TreeControl | None = None
    pool = NodeCalibration()  # every round's nodes, as the cloud pools one key's
    for t in tables:
        ref = t["reference"]
        ctl = TreeControl(max_nodes=32, copy_branches=False).carry(None if fresh else ctl)
        if seeded:
            ctl.nodes.seed(*pool.counts())
        pos = 0
        while pos < N_NEW:
            tree = t["trees"][pos]
            if policy == "edge":
                tree = {**tree, "values": ctl.ranked(DraftBlock(tree["tokens"], tree["q"], "sampled",
                                                                parents=tree["parents"]))}
                n = ctl.choose(tree["values"])
            else:
                n = int(policy.split("-")[1])
            n = min(n, N_NEW - pos - 1) if N_NEW - pos > 1 else 0
            toks, q, par = cut(tree, "chain" if policy.startswith("chain") else "tree", n) if n else ([], [], None)
            kept = accepted(toks, par if par is not None else list(range(-1, len(toks) - 1)), ref[pos:])
            if policy == "edge" and par is not None:
                ms = base + row * (len(toks) + 1)
                ctl.observe(len(toks), sum(sorted(tree["values"], reverse=True)[:len(toks)]), len(kept),
                            max(depths(par), default=0), ms, ms, row)
                ctl.observe_nodes(DraftBlock(toks, q, "sampled", parents=par), kept)
                pool.observe(par, q, [j in kept for j in range(len(toks))])
            tokens, rows, rounds, pos = tokens + len(kept) + 1, rows + len(toks) + 1, rounds + 1, pos + len(kept) + 1
    return tokens / rounds, rows / rounds, 1000 * tokens / (rounds * base + rows * row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-ms", type=float, default=370.0)
    p.add_argument("--row-ms", type=float, default=44.0)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--seeded", action="store_true")
    args = p.parse_args()
    tables = json.loads((REPO / "bench" / "results" / "capacity_curve_trees.json").read_text())["tables"]
    for policy in ("chain-4", "chain-8", "tree-8", "tree-16", "edge"):
        tpr, rpr, rate = replay(tables, policy, args.base_ms, args.row_ms, args.fresh, args.seeded)
        print(f"{policy:8s} tokens a round {tpr:.2f}, rows a round {rpr:.2f}, tokens per s of priced cost {rate:.3f}")


if __name__ == "__main__":
    main()

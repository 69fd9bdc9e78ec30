"""Whether the graph executor's forwards are batch-invariant on this device: measured at start-up, never assumed.

A row's logits may depend on the bucket its forward ran in (another matrix kernel for another row count, another
attention tiling for another query or key count) and on eager against replayed forwards. `paged_invariance` runs
one sequence's next token through the forwards the scheduler makes and compares the bits with a decode step alone:

- beside 7 other sessions' decode steps, one of them far longer (another key bucket);
- as the first of a verify row of 3 tokens (another query bucket), alone and beside 31 verify rows of 8;
- as a token tree's first node, a sibling beside it and a child under it;
- beside a prefill chunk (an eager forward of exact shapes).

Its scratch sequences live in the target's pool and are released after; a pool too small for them answers
"not measured". The answer is the first difference, named ("" when every probe gave the same bits), and the cases
probed.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from shared.blocks import OutOfBlocks
from shared.kvpool import KVPool
from shared.rows import Row


class Probed(Protocol):
    """What the probe reads of the target (cloud/runners/torch_runner.py's TargetModel)."""
    pool: KVPool
    support: int  # ids the model scores
    info: Any  # its ModelInfo: max_context
    paged: Any  # its graph executor (cloud/runners/graphs.py PagedForward), or None

    def forward(self, rows: list[Row]) -> Any: ...

# the probed sequence's prompt, and the long mate's (its context lands in a larger key bucket)
PROMPT, LONG = 37, 300


def paged_invariance(target: Probed, max_rows: int, seed: int = 0) -> tuple[str, str]:
    """(the first difference or \"\", the cases probed)."""
    pool = target.pool
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, target.support, (n,), generator=g).tolist()

    seqs: list[tuple[int, int]] = []  # (seq_id, committed length)

    def new(n: int) -> int:
        s = pool.allocate()
        seqs.append((s, n))
        return s

    try:
        room = target.info.max_context // 2
        chunk = min(max_rows, 256, room)
        a = new(PROMPT)
        # the mates' lengths vary, one far longer: a forward's key bucket is its longest row's, so short mates
        # beside that one probe the same shapes as long ones (graphs.py `shape_of`), at a seventh of the prefill
        mates = [new(min(LONG, room) if i == 0 else 5 + i) for i in range(31)]
        lengths = dict(seqs)
        batch: list[Row] = []
        for s, n in seqs:  # prefill, as many sequences a forward as a chunk holds
            if batch and sum(len(r.ids) for r in batch) + n > chunk:
                target.forward(batch)
                batch = []
            batch.append(Row(s, 0, rand(n), 0))
        target.forward(batch)
        x = rand(3)

        def first_logits(rows: list[Row]) -> torch.Tensor:
            out = target.forward(rows)[0][0]  # [support]: row 0 is the probed sequence's, its first kept token
            for r in rows:
                pool.crop(r.seq_id, lengths[r.seq_id])
            return out

        ref = first_logits([Row(a, PROMPT, x[:1], 1)])
        cases = {
            "beside 7 decode steps (one of a 300-token context)":
                [Row(a, PROMPT, x[:1], 1)] + [Row(s, lengths[s], rand(1), 1) for s in mates[:7]],
            "as the first of a verify row of 3":
                [Row(a, PROMPT, x, 3)],
            "as the first of a verify row of 3 beside 31 verify rows of 8":
                [Row(a, PROMPT, x, 3)] + [Row(s, lengths[s], rand(8), 8) for s in mates],
            "as a token tree's first node (a sibling beside it, a child under it)":
                [Row(a, PROMPT, x, 3, tree=(-1, -1, 0), tree_base=PROMPT)],
            f"beside a prefill chunk of {chunk} tokens":
                [Row(a, PROMPT, x[:1], 1), Row(new(0), 0, rand(chunk), 1)],
        }
        paged = target.paged
        if paged is not None and paged.graphs and not paged.lazy:  # every larger key bucket captured at start-up
            for w in paged.captured_dims()[2]:
                n = w // 2 + 1  # a context in that key bucket, not the one below
                if w <= 512 or n >= room:
                    continue
                m = new(n)
                for at in range(0, n, chunk):
                    target.forward([Row(m, at, rand(min(chunk, n - at)), 0)])
                cases[f"beside a decode step of a {n}-token context (key bucket {w})"] = \
                    [Row(a, PROMPT, x[:1], 1), Row(m, n, rand(1), 1)]
        for what, rows in cases.items():
            lengths.update(dict(seqs))
            got = first_logits(rows)
            if not torch.equal(got, ref):
                diff = float((got - ref).abs().max())
                return (f"the probed token's logits {what} differ from a decode step alone (max |diff| {diff:.3g})",
                        "")
        return "", "; ".join(cases)
    except OutOfBlocks:
        return "not measured: the KV budget holds too few blocks for the probe's sequences", ""
    finally:
        for s, _ in seqs:
            pool.release(s)

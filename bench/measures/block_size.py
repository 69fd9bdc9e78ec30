"""Forward cost and unused KV positions of the paged pool for several block sizes.

Sixteen verify rows of 5 tokens after contexts of 60..400 positions (seeded) on the demo target,
one torch thread; the median of 9 forwards' CPU time of this thread per block size, and the share of
positions left unused in the rows' last blocks (internal fragmentation).

    .venv/bin/specsplit-bench block-size [--model models/demo-target] [--sizes 4,8,16,32,64,128]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.cloud_proc import REPO

if TYPE_CHECKING:  # torch loads in main(), so `--help` answers at once
    import torch


def measure(model: torch.nn.Module, block: int, rows: int = 16, new: int = 5, seed: int = 0) -> tuple[float, float]:
    import torch

    from shared.kvpool import KVPool, Row, attention_layout

    g = torch.Generator().manual_seed(seed)
    pool = KVPool(attention_layout(model.config), 1 << 20, "cpu", torch.float32, block_size=block)
    pool.prepare(model)
    seqs = [pool.allocate() for _ in range(rows)]
    ctxs = [int(c) for c in torch.randint(60, 400, (rows,), generator=g)]
    ids = [torch.randint(0, 4096, (c + new,), generator=g).tolist() for c in ctxs]
    times = []
    with torch.inference_mode():
        pool.forward(model, [Row(s, 0, x[:c], 0) for s, x, c in zip(seqs, ids, ctxs, strict=True)])
        for _ in range(9):
            t = time.thread_time()
            pool.forward(model, [Row(s, c, x[c: c + new], new) for s, x, c in zip(seqs, ids, ctxs, strict=True)])
            times.append(time.thread_time() - t)
            for s, c in zip(seqs, ctxs, strict=True):
                pool.crop(s, c)
    unused = sum(-(-c // block) * block - c for c in ctxs) / sum(ctxs)
    return sorted(times)[len(times) // 2] * 1000.0, unused


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specsplit-bench block-size", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=REPO / "models" / "demo-target")
    p.add_argument("--sizes", default="4,8,16,32,64,128")
    args = p.parse_args(argv)
    import torch

    from shared.hf_model import load_causal_lm

    torch.set_num_threads(1)
    model = load_causal_lm(args.model, "cpu", torch.float32)
    print("| block size | forward CPU ms (median of 9) | unused positions in last blocks |")
    print("|---|---|---|")
    for b in (int(x) for x in args.sizes.split(",")):
        ms, unused = measure(model, b)
        print(f"| {b} | {ms:.1f} | {unused:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""llama.cpp's kernel paths by micro-batch on the coder target (python -m bench.llama_paths): which batch sizes give a
token the bits of a one-token step, with and without repacked weights, and what micro-batches of the invariant size
cost (shared/llama_invariance.py). One thread; prints a markdown section."""

from __future__ import annotations

import os
import sys
import time

import torch

from bench.coder_pair import TARGET, cpu_info
from shared.llama_runtime import GGUFContext, GGUFModel, Token, find_gguf

SIZES = (2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 32)
PROMPT = [151644, 8948, 198] + list(range(1000, 1061))
TEXT = [13, 220, 1000, 374, 264, 1273, 315, 279, 1156, 2038, 11, 323, 429, 374, 1550, 13] * 2


def logits(model: GGUFModel, chunk: int, ubatch: int = 0) -> torch.Tensor:
    """TEXT's logits after PROMPT, decoded `chunk` tokens a call ([32, vocab])."""
    ctx = GGUFContext(model, 512, 1, 1, n_batch=max(chunk, 64), n_ubatch=ubatch)
    for i, t in enumerate(PROMPT):
        ctx.decode([Token(t, i, (0,), False)])
    out = []
    for at in range(0, len(TEXT), chunk):
        out.append(ctx.decode([Token(t, len(PROMPT) + at + j, (0,), True) for j, t in enumerate(TEXT[at:at + chunk])]))
    return torch.cat(out)


def costs(model: GGUFModel, ubatch: int) -> tuple[float, dict[int, float]]:
    """ms of a 64-token prefill and of a verify of n tokens after it (median of 3), in micro-batches of `ubatch`."""
    ctx = GGUFContext(model, 1024, 1, 1, n_batch=512, n_ubatch=ubatch)
    t0 = time.perf_counter()
    ctx.decode([Token(100 + i, i, (0,), i == 63) for i in range(64)])
    prefill = (time.perf_counter() - t0) * 1000
    out = {}
    for n in (1, 2, 4, 7, 8, 16, 32):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            ctx.decode([Token(200 + i, 64 + i, (0,), True) for i in range(n)])
            times.append((time.perf_counter() - t0) * 1000)
            ctx.seq_rm(0, 64, -1)
        out[n] = sorted(times)[1]
    return prefill, out


def main() -> int:
    path = find_gguf(TARGET)
    if path is None:
        print("needs the coder pair: specsplit-models prepare qwen-coder", file=sys.stderr)
        return 2
    m, load = cpu_info(), os.getloadavg()
    lines = ["## llama.cpp's kernel paths by micro-batch", "",
             f"`python -m bench.llama_paths` · {m['cpu']} (avx512_bf16 {'yes' if m['avx512_bf16'] else 'no'}, "
             f"amx_bf16 {'yes' if m['amx_bf16'] else 'no'}), load average {load[0]:.2f}, one thread; "
             "Qwen2.5-Coder-1.5B Q4_K_M. Largest logit difference from one-token steps when 32 tokens are decoded "
             "n at a time:", "", "| weights | " + " | ".join(str(n) for n in SIZES) + " |",
             "|---|" + "---|" * len(SIZES)]
    for repack in (False, True):
        model = GGUFModel(path, repack=repack)
        base = logits(model, 1)
        diffs = [float((logits(model, n) - base).abs().max()) for n in SIZES]
        lines.append(f"| {'repacked' if repack else 'as stored'} | " + " | ".join(f"{d:.2g}" for d in diffs) + " |")
        del model
    model = GGUFModel(path, repack=False)
    lines += ["", "Cost (ms) of a 64-token prefill and of a verify of n tokens after it, by micro-batch size:", "",
              "| micro-batch | prefill 64 | 1 | 2 | 4 | 7 | 8 | 16 | 32 |", "|---|---|---|---|---|---|---|---|---|"]
    for ub in (512, 7):
        pre, row = costs(model, ub)
        lines.append(f"| {ub} | {pre:.0f} | " + " | ".join(f"{row[n]:.0f}" for n in (1, 2, 4, 7, 8, 16, 32)) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

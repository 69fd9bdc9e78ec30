"""`specsplit-bench --only forward-cost`: what one cloud forward costs, by dtype and batch shape, in one run.

    specsplit-bench --only forward-cost [--forward-models smollm2,coder] [--forward-threads 1] [--out BENCHMARKS.md]

Each target is loaded the way the cloud loads it (`cloud.runners.torch_runner.TargetModel`: float32 weights packed for
oneDNN, the paged KV pool) and timed through `TargetModel.forward` with a KV cache of `CONTEXT` positions per
session (cropped back after each forward), median of `REPEATS`:
- one session's row of n new tokens (1..64): a decode step (1), a verify chain (k + 1), a prefill chunk;
- a token tree of 16 nodes (two branches of depth 8);
- S sessions' decode rows of one token each, and S sessions' chains of 7 tokens, in one forward (S = 4, 16).
Per variant (`--forward-variants`, default DEFAULT_VARIANTS): the dtype, invariant (tiles; the cloud's default) or
plain, and the PyTorch runner's executor: eager (the cloud's own forward, its CPU default for these families) or
transformers (the models' own modules over the same pool). Ratios are against the same variant's one-token forward,
and RATIOS compares variants (invariance's cost, bfloat16 against float32, the own forward against transformers').
The section is spliced between the forward-cost markers.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from bench.cloud_proc import REPO

MODELS = {"smollm2": REPO / "models" / "smollm2-135m-instruct",
          "coder": REPO / "models" / "qwen2.5-coder-1.5b-instruct"}
NAMES = {"smollm2": "SmolLM2-135M-Instruct", "coder": "Qwen2.5-Coder-1.5B-Instruct"}
# (dtype, batch-invariant, the PyTorch runner's --executor): "eager" is the cloud's own forward (its CPU default),
# "transformers" the model's own modules over the same pool
VARIANTS = {f"{d}-{'invariant' if inv else 'plain'}-{ex}": (d, inv, ex)
            for d in ("float32", "bfloat16") for inv in (True, False) for ex in ("eager", "transformers")}
DEFAULT_VARIANTS = ("float32-invariant-eager", "float32-invariant-transformers", "float32-plain-eager",
                    "bfloat16-invariant-eager", "bfloat16-plain-eager")
NEW = (1, 2, 4, 8, 16, 32, 64)
SESSIONS = (4, 16)
CONTEXT = 256
REPEATS = 5
START, END = "<!-- forward-cost:start -->", "<!-- forward-cost:end -->"


def cpu_line() -> str:
    """lscpu's model name and the bfloat16 flags the CPU reports."""
    from shared.dtypes import cpu_bf16_units

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        name = platform.processor() or "?"
    units = cpu_bf16_units()
    return f"{name}; bfloat16 flags: {', '.join(units) if units else 'none'}"


def timed(model: Any, rows_of: Any, repeats: int = REPEATS) -> float:
    """Median ms of `model.forward(rows_of())`, each run's new positions cropped back after it."""
    times = []
    for _ in range(repeats + 1):
        rows = rows_of()
        t0 = time.perf_counter()
        model.forward(rows)
        times.append((time.perf_counter() - t0) * 1000)
        for r in rows:
            model.pool.crop(r.seq_id, r.num_cached_tokens)
    return statistics.median(times[1:])  # the first run warms the kernels


def measure(model_dir: Path, dtype: str, invariant: bool, executor: str = "auto") -> dict[str, float]:
    from cloud.runners.torch_runner import TargetModel
    from shared.kvpool import Row

    m = TargetModel(model_dir, "cpu", dtype, invariant=invariant, executor=executor)
    vocab = m.support
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    slots = []
    for _ in range(max(SESSIONS)):
        s = m.pool.allocate()
        for c in range(0, CONTEXT, 64):  # the context, in prefill chunks
            m.forward([Row(s, c, ids(64), 0)])
        slots.append(s)
    out: dict[str, float] = {}
    for n in NEW:
        out[f"new{n}"] = timed(m, lambda n=n: [Row(slots[0], CONTEXT, ids(n), n)])
    parents = tuple([-1] + list(range(7)) + [-1] + list(range(8, 15)))  # two branches of depth 8
    out["tree16"] = timed(m, lambda: [Row(slots[0], CONTEXT, ids(16), 16, tree=parents, tree_base=CONTEXT)])
    for s in SESSIONS:
        out[f"decode{s}"] = timed(m, lambda s=s: [Row(x, CONTEXT, ids(1), 1) for x in slots[:s]])
        out[f"chain{s}"] = timed(m, lambda s=s: [Row(x, CONTEXT, ids(7), 7) for x in slots[:s]])
    out["tile"] = float(m.row_tile)  # the linear layers' row tile (0: plain)
    return out


Variant = tuple[str, bool, str]
# the ratios under each model's table, where both variants ran
RATIOS: tuple[tuple[str, Variant, Variant], ...] = (
    ("Invariance's cost in bfloat16 (invariant / plain)", ("bfloat16", True, "eager"), ("bfloat16", False, "eager")),
    ("bfloat16 against float32, both invariant (bfloat16 / float32)", ("bfloat16", True, "eager"),
     ("float32", True, "eager")),
    ("The cloud's own forward against transformers' modules, float32 invariant (eager / transformers)",
     ("float32", True, "eager"), ("float32", True, "transformers")))


def render(results: dict[str, dict[Variant, dict[str, float]]], command: str, threads: int, load: str) -> str:
    tiles = ", ".join(sorted({f"{NAMES[k]} {d} {ex} {int(r['tile'])}" for k, by in results.items()
                              for (d, inv, ex), r in by.items() if inv and "tile" in r}))
    lines = [START, "## What a cloud forward costs, float32 against bfloat16, plain against batch-invariant", "",
             f"Command: `{command}` ({cpu_line()}; {threads} torch thread(s); {load}). Each target as the cloud "
             f"loads it, timed through `TargetModel.forward` with a KV cache of {CONTEXT} positions per session, "
             f"median of {REPEATS} (`bench/forward_cost.py`). *Invariant* is the cloud's default "
             "(`--batch-invariant`: linear rows in the tile the cloud measures at its first forward, this "
             f"run: {tiles}; attention rows in tiles of 16 and keys in fixed chunks; one text for "
             "every batch shape), *plain* the kernels as they come; *eager* the cloud's own forward (its default on "
             "a CPU for these families), *transformers* the models' own modules over the same pool. GPU figures "
             "are unmeasured.", ""]
    cols = [f"new{n}" for n in NEW] + ["tree16"] + [f"decode{s}" for s in SESSIONS] + [f"chain{s}" for s in SESSIONS]
    heads = [f"{n} new" for n in NEW] + ["tree of 16"] + [f"{s} x 1 (decode)" for s in SESSIONS] + \
        [f"{s} x 7 (chains)" for s in SESSIONS]
    for key, by in results.items():
        lines += [f"### {NAMES[key]}: ms per forward (and / one new token of the same variant)", "",
                  "| variant | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
        for (dtype, inv, ex), r in by.items():
            one = r["new1"]
            cells = [f"{r[c]:.0f} ({r[c] / one:.2f}x)" if c != "new1" else f"{r[c]:.0f}" for c in cols]
            lines.append(f"| {dtype} {'invariant' if inv else 'plain'} {ex} | " + " | ".join(cells) + " |")
        for what, a, b in RATIOS:
            if a in by and b in by:
                lines += ["", f"{what}: " + ", ".join(
                    f"{h} {by[a][c] / by[b][c]:.2f}x" for c, h in zip(cols, heads, strict=True)) + "."]
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def run(out: Path, command: str, models: tuple[str, ...] = ("smollm2", "coder"), threads: int = 1,
        variants: tuple[str, ...] = DEFAULT_VARIANTS) -> int:
    from bench.real_pair import splice

    torch.set_num_threads(threads)
    missing = [k for k in models if not (MODELS[k] / "config.json").is_file()]
    if missing:
        print(f"missing {', '.join(str(MODELS[k]) for k in missing)}: run `specsplit-models prepare smollm2` / "
              "`specsplit-models prepare qwen-coder`")
        return 2
    load = f"load average {os.getloadavg()[0]:.2f} at the start"
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variant {', '.join(unknown)}: pick from {', '.join(VARIANTS)}")
        return 2
    results: dict[str, dict[Variant, dict[str, float]]] = {}
    for key in models:
        results[key] = {}
        for dtype, inv, ex in (VARIANTS[v] for v in variants):
            r = measure(MODELS[key], dtype, inv, ex)
            results[key][(dtype, inv, ex)] = r
            print(f"forward-cost: {key} {dtype} {'invariant' if inv else 'plain'} {ex}: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in r.items()), flush=True)  # tile: the row tile
    load += f", {os.getloadavg()[0]:.2f} at the end"
    path = splice(render(results, command, threads, load), out, START, END)
    print(f"wrote the forward-cost section into {path}")
    return 0

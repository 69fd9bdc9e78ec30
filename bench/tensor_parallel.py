"""`specsplit-bench --only tp`: one verifier split over N tensor-parallel ranks, N = 1, 2, 3.

    specsplit-bench --only tp [--target DIR] [--out BENCHMARKS.md]

For each N the cloud runs under `torchrun --nproc-per-node N` (N = 1: the plain process); an N its
target's heads do not split over is reported as refused (SmolLM2-135M's 9 heads and 3 KV heads split
over 1 and 3 ranks, not 2). So N = 2 is measured too, a second target follows: the target's twin with
6 attention heads and 6 KV heads (same width, layers and vocabulary; random weights, built in a
temporary directory), which splits over 1, 2 and 3. Measured per target and N:
1. per-rank memory: weight bytes of each rank's shard (the ranks log them at start) and KV bytes per
   rank for the same sessions (the pool's bytes after them; every rank holds the same blocks);
2. tokens/s of one session at a time, greedy, 64 tokens per prompt: cloud_only (the cloud's own
   /v1/generate) and speculative (n-gram drafts over REST).
On a 2-core CPU the ranks share the cores and every layer adds two collectives (all-gathers of the
partial products, added in rank order: batch-invariant forwards), so N > 1 does
not speed anything up here: tensor parallelism is for a target larger than one device, and the
GPU figures (NCCL) are unmeasured. The section is spliced into OUT between the tp markers.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.cloud_proc import REPO, CloudServer

TARGET = REPO / "models" / "smollm2-135m-instruct"
RANKS = (1, 2, 3)
TWIN = "twin-6-heads"
START, END = "<!-- tp:start -->", "<!-- tp:end -->"
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three most important things to pack for a hiking trip are"]


def rank_memory(log_text: str) -> dict[int, dict[str, int]]:
    """rank -> {"weight_bytes", "kv_bytes_per_token"} from the ranks' `rank_memory` log lines."""
    out = {}
    for line in log_text.splitlines():
        if '"rank_memory"' not in line:
            continue
        try:
            d = json.loads(line[line.index("{"):])
        except ValueError:
            continue
        out[int(d["rank"])] = {"weight_bytes": int(d["weight_bytes"]), "kv_bytes_per_token": int(d["kv_bytes_per_token"])}
    return out


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def splittable_twin(target: Path, out: Path, heads: int = 6) -> Path:
    """`target`'s architecture with `heads` attention and KV heads (the same hidden width), random
    weights (seed 0), and `target`'s tokenizer: a model of the same size that splits over 2 and 3."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(target)
    cfg.num_attention_heads = cfg.num_key_value_heads = heads
    cfg.head_dim = cfg.hidden_size // heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    return out


def measure(target: Path, n: int, n_new: int, tokenizer: Any) -> dict[str, Any]:
    from edge.client import EdgeClient
    from edge.drafters import NGramDrafter
    from edge.settings import EdgeSettings

    row: dict[str, Any] = {"ranks": n, "target": target.name}
    cloud = CloudServer(target, torch_threads=1, ranks=n, extra_args=["--log-level", "info"])
    try:
        cloud.start()
    except RuntimeError as e:
        text = cloud.log_path.read_text(errors="replace") if cloud.log_path.exists() else str(e)
        refused = [line for line in text.splitlines() if line.startswith("specsplit-cloud:")]
        row["refused"] = refused[0].split(": ", 2)[-1] if refused else str(e).splitlines()[0]
        cloud.stop()
        print(f"tp: N = {n}: refused: {row['refused']}", flush=True)
        return row
    try:
        info = httpx.get(f"{cloud.url}/v1/model", timeout=30).json()
        row["dtype"], row["batch_invariant"] = str(info.get("dtype", "float32")), bool(info.get("batch_invariant"))
        mem = rank_memory(cloud.log_path.read_text(errors="replace"))
        if not mem:  # one process logs no rank line: its model info and the whole weights, in the cloud's dtype
            import torch
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, row["dtype"]))
            mem = {0: {"weight_bytes": sum(p.numel() * p.element_size() for p in m.parameters()), "kv_bytes_per_token": 0}}
        row["weight_bytes"] = max(v["weight_bytes"] for v in mem.values())
        for mode in ("cloud_only", "speculative"):
            toks, secs = 0, 0.0
            for text in PROMPTS:
                s = EdgeSettings(cloud_url=cloud.url, temperature=0, max_new_tokens=n_new, mode=mode,
                                 timeout_ms=120_000, stop_at_eos=False, stream_switch=False)
                client = EdgeClient(s, drafter=NGramDrafter(order=3), tokenizer=tokenizer)
                t0 = time.perf_counter()
                toks += len(client.generate(text).token_ids)
                secs += time.perf_counter() - t0
            row[f"{mode}_tokens_per_s"] = toks / secs
        row["kv_bytes"] = metric(cloud.url, "specsplit_cloud_kv_pool_bytes")
    finally:
        cloud.stop()
    print(f"tp: N = {n}: {row}", flush=True)
    return row


def render(rows: list[dict[str, Any]], command: str, n_new: int, load: str) -> str:
    dtypes = sorted({str(r["dtype"]) for r in rows if "dtype" in r}) or ["?"]
    invariant = all(r.get("batch_invariant") for r in rows if "dtype" in r)
    lines = [START, "## A target larger than one device: tensor-parallel ranks", "",
             f"Command: `{command}` (the cloud in {' / '.join(dtypes)}, batch-invariant forwards "
             f"{'on' if invariant else 'off'} at every N; {len(PROMPTS)} prompts x {n_new} tokens, greedy, one session at a "
             f"time; {load}). `{TWIN}`: the first target's twin with 6 attention and 6 KV heads (random weights), "
             "so that N = 2 is measured too. This machine has 2 CPU cores: the ranks share them and "
             "each layer adds two collectives (all-gathers of partial products added in rank order), so more ranks "
             "do not speed anything up here; the point is the memory per rank. GPU (NCCL) figures are unmeasured.", "",
             "| target | ranks | weights per rank | of N = 1 | KV bytes per rank | of N = 1 | cloud_only tok/s | "
             "speculative tok/s |", "|---|---|---|---|---|---|---|---|"]
    over = []
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['target']} | {r['ranks']} | refused: {r['refused']} | | | | | |")
            continue
        base = next((b for b in rows if b["target"] == r["target"] and b["ranks"] == 1 and "refused" not in b), None)
        w = f"{r['weight_bytes'] / base['weight_bytes']:.2f}" if base else "-"
        kv = f"{r['kv_bytes'] / base['kv_bytes']:.2f}" if base and base["kv_bytes"] else "-"
        lines.append(f"| {r['target']} | {r['ranks']} | {r['weight_bytes'] / 2**20:.1f} MiB | {w} | "
                     f"{r['kv_bytes'] / 2**20:.2f} MiB | {kv} | {r['cloud_only_tokens_per_s']:.2f} | "
                     f"{r['speculative_tokens_per_s']:.2f} |")
        if base and r["weight_bytes"] > 1.01 * base["weight_bytes"] / r["ranks"]:
            over.append(r)
    if over:  # said only when measured
        lines += ["", "Weights per rank above 1/N: what the tensor plan keeps whole on every rank (embeddings, "
                  "norms; the output layer where it is tied to the embeddings)."]
    lines += ["", END]
    return "\n".join(lines)


def run(out: Path, command: str, target: Path = TARGET, n_new: int = 64, ranks: tuple[int, ...] = RANKS) -> int:
    from transformers import AutoTokenizer

    if not (target / "config.json").is_file():
        print(f"{target} is missing: run `specsplit-models prepare smollm2` (scripts/setup.sh does it), or pass "
              "--target DIR")
        return 2
    load = f"load average {os.getloadavg()[0]:.2f} at the start"
    tokenizer = AutoTokenizer.from_pretrained(target)
    rows = [measure(target, n, n_new, tokenizer) for n in ranks]
    with tempfile.TemporaryDirectory(prefix="specsplit-tp-") as tmp:
        twin = splittable_twin(target, Path(tmp) / TWIN)
        rows += [measure(twin, n, n_new, tokenizer) for n in ranks]
    load += f", {os.getloadavg()[0]:.2f} at the end"
    text = render(rows, command, n_new, load)
    path = splice_tp(text, out)
    print(text)
    print(f"wrote the tp section into {path}")
    return 0


def splice_tp(section: str, out: Path) -> Path:
    """`splice` between the tp markers."""
    text = out.read_text() if out.exists() else ""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        out.write_text(head + section + rest.split(END, 1)[1])
        return out
    out.write_text(text.rstrip("\n") + "\n\n" + section + "\n")
    return out

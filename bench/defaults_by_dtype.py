"""The real pair's defaults against cloud_only in each cloud dtype: one session, greedy, 0 ms round trip.

    python -m bench.defaults_by_dtype [--dtypes float32,bfloat16] [--tokens 64] [--out BENCHMARKS.md]

The target is SmolLM2-135M-Instruct (models/smollm2-135m-instruct) in one `specsplit-cloud` process per dtype
(`--dtype`, batch-invariant forwards on), one torch thread pinned to one core; the edge is this process on
the other core with its defaults (the attention head, trees, drafting ahead, speculate-or-stream). Prompts: the
real-pair bench's chat prompts (bench/real_pair.py PROMPTS) and the Spec-Bench subset's first turns
(bench/specbench/questions.jsonl), each through the chat template, `--tokens` new tokens, no stop at the end of
the answer. Per dtype and prompt set: decode tokens/s of each mode (the tokens after the first over the time
after the first, summed over the prompts, as `real_pair.end_to_end` computes it), the speedup, tokens per verify
call (streamed tokens apart), tokens streamed, and how many prompts' speculative text equals the cloud's own
(greedy text is one text in every mode: shared/invariant.py). The section is spliced into OUT between its markers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.cloud_proc import REPO, CloudServer
from bench.coder_pair import cpu_info, pin
from bench.real_pair import PROMPTS, SPECBENCH, one_client, splice

TARGET = REPO / "models" / "smollm2-135m-instruct"
START, END = "<!-- defaults-by-dtype:start -->", "<!-- defaults-by-dtype:end -->"
# aims of issue 47: the defaults against cloud_only at 0 ms, by prompt set
AIMS = {"chat": 1.6, "Spec-Bench": 1.3}


def prompt_sets() -> dict[str, list[str]]:
    questions = [json.loads(line) for line in SPECBENCH.read_text().splitlines() if line.strip()]
    return {"chat": list(PROMPTS), "Spec-Bench": [q["turns"][0] for q in questions]}


def one_mode(url: str, tokenizer: Any, mode: Any, texts: list[str], n_new: int) -> dict[str, Any]:
    """One client of `mode` over `texts` (`real_pair.one_client`): decode tokens/s, tokens per verify call (streamed
    tokens apart), the texts."""
    t = one_client(url, tokenizer, mode, texts, n_new)
    return {"tokens_per_s": t["tokens_per_s"], "tokens_per_verify": (t["emitted"] - t["streamed"]) / max(t["verify"], 1),
            "streamed": t["streamed"], "texts": t["texts"]}


def run(dtypes: list[str], n_new: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    pin("self", 0)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    rows = []
    for dtype in dtypes:
        with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", "torch", "--dtype", dtype]) as cloud:
            pin(cloud.pid, 1)
            for name, texts in prompt_sets().items():
                base = one_mode(cloud.url, tokenizer, "cloud_only", texts, n_new)
                spec = one_mode(cloud.url, tokenizer, "speculative", texts, n_new)
                equal = sum(a == b for a, b in zip(base["texts"], spec["texts"], strict=True))
                rows.append({"dtype": dtype, "prompts": name, "n": len(texts), "cloud_only": base["tokens_per_s"],
                             "defaults": spec["tokens_per_s"], "tokens_per_verify": spec["tokens_per_verify"],
                             "streamed": spec["streamed"], "equal": equal})
                print(f"defaults-by-dtype: {dtype}, {name}: cloud_only {base['tokens_per_s']:.2f}, defaults "
                      f"{spec['tokens_per_s']:.2f} decode tok/s, {spec['tokens_per_verify']:.2f} tokens/verify, "
                      f"{equal} of {len(texts)} texts equal", flush=True)
    return rows


def render(rows: list[dict[str, Any]], command: str, machine: dict[str, Any], n_new: int, minutes: float) -> str:
    flags = ", ".join(f"{f} {'present' if machine[f] else 'absent'}" for f in ("amx_bf16", "avx512_bf16"))
    lines = [START, "### The real pair's defaults against cloud_only, by the cloud's dtype (one session, greedy, 0 ms)", "",
             f"Command: `{command}` ({minutes:.0f} minutes). CPU: {machine['cpu']} ({flags}); load average "
             f"{machine['load_start']:.2f} at the start, {machine['load_end']:.2f} at the end. The cloud (SmolLM2-135M-"
             "Instruct, batch-invariant forwards) and the edge (its defaults: the attention head, trees, drafting "
             "ahead, speculate-or-stream) each on one torch thread pinned to its own core. Prompts: the real-pair "
             f"chat prompts and the Spec-Bench subset's first turns, {n_new} new tokens each. Decode tokens/s: the "
             "tokens after the first over the time after the first, summed over the prompts. GPU figures are "
             "unmeasured.", "",
             "| cloud dtype | prompts | cloud_only decode tok/s | defaults decode tok/s | speedup | tokens per verify "
             "call (streamed apart) | tokens streamed | texts equal to cloud_only |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["defaults"] / max(r["cloud_only"], 1e-9)
        goal = AIMS[r["prompts"]]
        lines.append(f"| {r['dtype']} | {r['prompts']} ({r['n']}) | {r['cloud_only']:.2f} | {r['defaults']:.2f} | "
                     f"**{ratio:.2f}x** (aim >= {goal:g}x: {'met' if ratio >= goal else 'missed'}) | "
                     f"{r['tokens_per_verify']:.2f} | {r['streamed']} | {r['equal']} of {r['n']} |")
    lines += ["", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.defaults_by_dtype", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    args = ap.parse_args(argv)
    if not (TARGET / "model.safetensors").is_file():
        print(f"{TARGET} is missing: run `specsplit-models prepare smollm2` (scripts/setup.sh does it)")
        return 2
    t0 = time.perf_counter()
    machine = {**cpu_info(), "load_start": os.getloadavg()[0]}
    rows = run([d.strip() for d in args.dtypes.split(",") if d.strip()], args.tokens)
    machine["load_end"] = os.getloadavg()[0]
    command = "python -m bench.defaults_by_dtype " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(rows, command.strip(), machine, args.tokens, (time.perf_counter() - t0) / 60)
    print("\n" + section)
    print(f"wrote the section into {splice(section, args.out, START, END)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which positions of the coder target's greedy text its 0.5B draft predicts: the trace `--only gpu-capacity` replays.

    python -m bench.acceptance_trace [--prompts 20] [--tokens 128] [--out bench/traces/coder_acceptance.json]

For each of the first N HumanEval prompts (bench/humaneval/, sent as the coder pair's chat message), the target
(models/qwen2.5-coder-1.5b-instruct's GGUF, on llama.cpp) writes its greedy answer, up to `--tokens` tokens or its end;
then the draft (models/qwen2.5-coder-0.5b-instruct's GGUF) reads prompt + answer in one pass, and position t is a hit
when the draft's argmax after the first t tokens of the answer is the answer's token t. A greedy chain round starting
at t keeps the drafts up to the first miss, so the trace is the pair's acceptance at every position, its runs and
its misses in their real order; the bench replays it over a target of another shape (random weights), where only
the forward's cost is real. Both models run on this machine's CPU; nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.coder_pair import humaneval_message, humaneval_prompts
from bench.real_pair import chat_ids

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "models" / "qwen2.5-coder-1.5b-instruct"
DRAFT = REPO / "models" / "qwen2.5-coder-0.5b-instruct"
OUT = REPO / "bench" / "traces" / "coder_acceptance.json"


def greedy_answer(ctx: Any, prompt: list[int], n_new: int, eos: set[int]) -> list[int]:
    """The model's greedy continuation of `prompt` (sequence 0 of `ctx`, cleared first), up to n_new tokens or eos."""
    from shared.llama_runtime import Token

    ctx.clear()
    logits = ctx.decode([Token(t, i, (0,), i == len(prompt) - 1) for i, t in enumerate(prompt)])  # [1, vocab]
    out: list[int] = []
    while len(out) < n_new:
        tok = int(logits[-1].argmax())
        out.append(tok)
        if tok in eos:
            break
        logits = ctx.decode([Token(tok, len(prompt) + len(out) - 1, (0,), True)])
    return out


def hits(ctx: Any, prompt: list[int], answer: list[int]) -> list[int]:
    """1 where the model's argmax after prompt + answer[:t] is answer[t], else 0 (one pass, teacher-forced)."""
    from shared.llama_runtime import Token

    ctx.clear()
    ids = prompt + answer
    toks = [Token(t, i, (0,), i >= len(prompt) - 1 and i < len(ids) - 1) for i, t in enumerate(ids)]
    logits = ctx.decode(toks)  # [len(answer), vocab]: after prompt, after prompt + answer[:1], ...
    return [int(int(row.argmax()) == y) for row, y in zip(logits, answer, strict=True)]


def record(n_prompts: int, n_new: int, threads: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from shared.llama_runtime import GGUFContext, GGUFModel, find_gguf

    tok = AutoTokenizer.from_pretrained(TARGET)
    eos = {int(t) for t in ([tok.eos_token_id] if tok.eos_token_id is not None else [])}
    eos |= {int(tok.convert_tokens_to_ids(t)) for t in ("<|im_end|>", "<|endoftext|>")}  # type: ignore[arg-type]
    paths = [find_gguf(p) for p in (TARGET, DRAFT)]
    if None in paths:
        sys.exit(f"no GGUF under {TARGET} or {DRAFT}: run `specsplit-models prepare qwen-coder` first")
    target, draft = (GGUFModel(p, repack=False) for p in paths)  # type: ignore[arg-type]
    tctx, dctx = (GGUFContext(m, n_ctx=2048, threads=threads) for m in (target, draft))
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for p in humaneval_prompts(n_prompts):
        prompt = chat_ids(tok, humaneval_message(p["prompt"]))
        answer = greedy_answer(tctx, prompt, n_new, eos)
        rows.append({"task_id": p["task_id"], "prompt_tokens": len(prompt), "answer": answer,
                     "hits": hits(dctx, prompt, answer)})
        print(f"{p['task_id']}: {len(answer)} tokens, {sum(rows[-1]['hits'])} predicted", file=sys.stderr)
    all_hits = [h for r in rows for h in r["hits"]]
    return {"what": "per position of the coder target's greedy answer: 1 where its 0.5B draft's argmax predicts it",
            "target": TARGET.name + " (Q4_K_M GGUF, llama.cpp)", "draft": DRAFT.name + " (Q4_K_M GGUF, llama.cpp)",
            "prompts": f"bench/humaneval/prompts.jsonl, the first {n_prompts}, as the coder pair's chat message",
            "max_new_tokens": n_new, "hit_rate": round(sum(all_hits) / max(1, len(all_hits)), 4),
            "command": f"python -m bench.acceptance_trace --prompts {n_prompts} --tokens {n_new}",
            "recorded": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "seconds": round(time.time() - t0, 1), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    res = record(a.prompts, a.tokens, a.threads)
    a.out.write_text(json.dumps(res, separators=(",", ":")) + "\n")
    print(f"{a.out}: hit rate {res['hit_rate']} over {sum(len(r['hits']) for r in res['rows'])} positions",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

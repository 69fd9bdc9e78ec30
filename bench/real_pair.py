"""`specsplit-bench --only real-pair`: the real default pair on this machine, in one run.

    specsplit-bench --only real-pair [--out BENCHMARKS.md]

The target is SmolLM2-135M-Instruct (models/smollm2-135m-instruct, made by scripts/setup.sh) and the
draft the distilled models/smollm2-135m-draft. Three tables, all measured in this run:
1. costs: the target's forward time by new tokens per forward (1..17, KV cache, context ~200), the
   draft's time per token, and their ratio; this is what a verify round costs against plain decoding.
2. agreement: on the target's greedy answers to chat prompts the draft never saw in training,
   greedy agreement (argmax equal) and beta = sum min(p, q) at T = 1, per position.
3. end to end: one session, chat prompts through the template, cloud (1 torch thread) and edge
   (1 torch thread) sharing this machine; tokens/s of speculative decoding (model and n-gram
   drafters) against cloud_only, greedy and sampled, at 0 / 10 / 50 ms round trip (a delay proxy).
The section is spliced into OUT between the real-pair markers.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.cloud_proc import REPO, CloudServer
from bench.delay_proxy import DelayProxy

TARGET = REPO / "models" / "smollm2-135m-instruct"
DRAFT = REPO / "models" / "smollm2-135m-draft"
START, END = "<!-- real-pair:start -->", "<!-- real-pair:end -->"
# Chat prompts outside the distillation's templates and topics (scripts/distill_draft.py).
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What should I pack for a three-day hiking trip?",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "How does a refrigerator keep food cold?",
    "Write a SQL query that finds the ten best-selling products.",
    "Give me advice for my first job interview.",
    "Write a Python function that checks whether a list is sorted.",
    "Why do leaves change colour in autumn?",
]
NEW_TOKENS = (1, 2, 3, 5, 9, 17)
RTTS_MS = (0, 10, 50)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def forward_ms(model: Any, ctx: list[int], n_new: int, repeats: int = 7) -> float:
    """Median ms of one forward over n_new tokens after ctx is cached (the cache is cropped back each time)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=torch.tensor([ctx]), past_key_values=cache, use_cache=True)
        new = torch.tensor([ctx[-n_new:]])  # [1, n_new]: any ids; the cost depends on the count only
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=new, past_key_values=cache, use_cache=True)
            times.append((time.perf_counter() - t0) * 1000)
            cache.crop(-n_new)  # remove the n_new tokens just added
    return statistics.median(times)


def costs(target: Any, draft: Any, ctx: list[int]) -> dict[str, Any]:
    rows = {n: forward_ms(target, ctx, n) for n in NEW_TOKENS}
    draft_ms = forward_ms(draft, ctx, 1)
    return {"target_ms": rows, "draft_ms": draft_ms, "ratio": rows[1] / draft_ms}


def agreement(target: Any, draft: Any, tokenizer: Any, n_new: int) -> dict[str, Any]:
    agree = beta = n = 0.0
    with torch.no_grad():
        for text in PROMPTS:
            ids = chat_ids(tokenizer, text)
            out = target.generate(input_ids=torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                                  pad_token_id=tokenizer.eos_token_id)  # [1, len(ids) + m]
            x = out[:, :]
            s = len(ids) - 1
            p = torch.softmax(target(input_ids=x).logits[0, s:-1].float(), dim=-1)  # [m, vocab]
            q = torch.softmax(draft(input_ids=x).logits[0, s:-1].float(), dim=-1)  # [m, vocab]
            agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
            beta += torch.minimum(p, q).sum().item()
            n += p.shape[0]
    return {"prompts": len(PROMPTS), "positions": int(n), "greedy_agreement": agree / n, "beta": beta / n}


def end_to_end(tokenizer: Any, n_new: int, prompts: int) -> list[dict[str, Any]]:
    from edge.client import EdgeClient
    from edge.drafters import ModelDrafter, NGramDrafter
    from edge.settings import EdgeSettings

    model = ModelDrafter(DRAFT)
    rows = []
    with CloudServer(TARGET, torch_threads=1) as cloud:
        for rtt in RTTS_MS:
            with DelayProxy("127.0.0.1", cloud.http_port, rtt_ms=rtt) as proxy:
                for label, temp in (("greedy", 0.0), ("sampled T=0.7", 0.7)):
                    base = EdgeSettings(cloud_url=proxy.url, temperature=temp, max_new_tokens=n_new, seed=1,
                                        timeout_ms=120_000, timeout_fallback=False)
                    for mode, drafter in (("cloud_only", None), ("model", model), ("ngram", None)):
                        toks = secs = accepted = drafted = 0.0
                        for text in PROMPTS[:prompts]:
                            s = base.model_copy(update={"mode": "cloud_only" if mode == "cloud_only" else "speculative"})
                            d = drafter if mode == "model" else NGramDrafter(order=4) if mode == "ngram" else None
                            client = EdgeClient(s, drafter=d, tokenizer=tokenizer)
                            t0 = time.perf_counter()
                            r = client.generate(chat_ids(tokenizer, text))
                            secs += time.perf_counter() - t0
                            toks += len(r.token_ids)
                            accepted += r.metrics.accepted
                            drafted += r.metrics.drafted
                        rows.append({"rtt_ms": rtt, "sampling": label, "mode": mode, "tokens_per_s": toks / secs,
                                     "acceptance": accepted / drafted if drafted else None})
                        print(f"real-pair: rtt {rtt} ms, {label}, {mode}: {toks / secs:.2f} tok/s", flush=True)
    return rows


def render(c: dict[str, Any], a: dict[str, Any], e2e: list[dict[str, Any]], command: str) -> str:
    lines = [START, "## The real pair: SmolLM2-135M-Instruct verifying a distilled draft", "",
             f"Command: `{command}` (cloud and edge on this 2-core CPU, one torch thread each, float32; "
             "the machine was shared with other work, so read ratios, not absolute figures).", "",
             "### What a forward costs (target, KV cache, context "
             f"{c['ctx']} tokens)", "",
             "| new tokens per forward | " + " | ".join(str(n) for n in NEW_TOKENS) + " |",
             "|---" * (len(NEW_TOKENS) + 1) + "|",
             "| target ms | " + " | ".join(f"{c['target_ms'][n]:.0f}" for n in NEW_TOKENS) + " |", "",
             f"Draft: {c['draft_ms']:.1f} ms per token; target/draft cost per token at batch 1: "
             f"**{c['ratio']:.1f}x** (aim >= 5x). A verify round of k = 4 (5 new tokens) costs "
             f"{c['target_ms'][5] / c['target_ms'][1]:.2f} plain decoding steps.", "",
             f"### Draft quality on unseen chat prompts ({a['prompts']} prompts, {a['positions']} positions "
             "of the target's greedy answers)", "",
             "| greedy agreement | beta = sum min(p, q) at T = 1 |", "|---|---|",
             f"| **{a['greedy_agreement']:.3f}** (aim >= 0.6) | **{a['beta']:.3f}** (aim >= 0.65) |", "",
             "### One session end to end (tokens/s; speedup over cloud_only in the same run)", "",
             "| RTT | sampling | cloud_only | model drafter | n-gram drafter | model acceptance |",
             "|---|---|---|---|---|---|"]
    for rtt in RTTS_MS:
        for label in ("greedy", "sampled T=0.7"):
            cell = {r["mode"]: r for r in e2e if r["rtt_ms"] == rtt and r["sampling"] == label}
            base = cell["cloud_only"]["tokens_per_s"]
            acc = cell["model"]["acceptance"]
            lines.append(f"| {rtt} ms | {label} | {base:.2f} | {cell['model']['tokens_per_s']:.2f} "
                         f"(**{cell['model']['tokens_per_s'] / base:.2f}x**) | {cell['ngram']['tokens_per_s']:.2f} "
                         f"({cell['ngram']['tokens_per_s'] / base:.2f}x) | "
                         f"{'-' if acc is None else f'{acc:.2f}'} |")
    lines += ["", END]
    return "\n".join(lines)


def splice(section: str, out: Path) -> Path:
    text = out.read_text() if out.exists() else ""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text)
    return out


def run(out: Path, command: str, n_new: int = 64, prompts: int = 2) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    if not (TARGET / "model.safetensors").is_file():
        print(f"{TARGET} is missing: run `specsplit-models prepare smollm2` (scripts/setup.sh does it)")
        return 2
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    ctx = chat_ids(tokenizer, PROMPTS[0] + " " + PROMPTS[2] + " Explain every line.") * 4
    c = {**costs(target, draft, ctx), "ctx": len(ctx)}
    print(f"real-pair costs: {c}", flush=True)
    a = agreement(target, draft, tokenizer, n_new)
    print(f"real-pair agreement: {a}", flush=True)
    del target, draft
    e2e = end_to_end(tokenizer, n_new, prompts)
    path = splice(render(c, a, e2e, command), out)
    print(f"wrote the real-pair section into {path}")
    return 0

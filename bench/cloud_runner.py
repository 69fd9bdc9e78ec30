"""The cloud's two runners on the coder target, side by side with llama.cpp's own decode (specsplit-bench --only
cloud-runner).

One run, one machine, one core each (this process on core 0, the cloud on core 1):
1. llama.cpp's verify cost: one forward of n new tokens (1..32) after a KV of 64, at 1 and 2 threads;
2. the peer a CPU user picks: llama.cpp's own greedy decode of the same GGUF (one llama_decode a token, one thread);
3. per runner (llama.cpp, PyTorch at --dtype auto): cloud_only decode (POST /v1/generate) and its cloud CPU-s per
   token; on the llama.cpp runner the edge's defaults (llama.cpp draft) at 0 / 50 / 100 ms round trips, every
   text compared with the cloud's own greedy text;
4. capacity: 1, 4, 16 concurrent replayed sessions per runner (bench/loadgen.py; recorded rounds of the edge's
   trees, every answer checked against its recording) against as many cloud_only streams: tokens per cloud
   CPU-second and p50 round time;
5. each cloud's peak resident memory.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.cloud_proc import CloudServer
from bench.coder_pair import (
    DRAFT,
    RTTS_MS,
    TARGET,
    client_for,
    cpu_info,
    cpu_seconds,
    humaneval_message,
    humaneval_prompts,
    pin,
    record_traces,
    replayed_cpu,
    rss_mb,
    settings,
    summary,
    tally,
)
from bench.delay_proxy import DelayProxy
from bench.real_pair import chat_ids, finish
from bench.real_pair import met as _met

START, END = "<!-- cloud-runner:start -->", "<!-- cloud-runner:end -->"
TOKENS = (1, 2, 4, 8, 16, 32)
AIM_PEER = 0.9
AIM_SPEEDUP = {0: 1.3, 50: 1.0, 100: 1.0}
# the decode rule of every text compared here: plain greedy, as the peer decodes (the edge's defaults sample at
# temperature 1 with a repetition penalty of 1.1)
GREEDY: dict[str, Any] = {"temperature": 0.0, "repetition_penalty": 1.0}


def verify_costs(path: Path, threads: int, kv: int = 64, repeats: int = 5) -> dict[int, float]:
    """ms of one llama.cpp forward of n new tokens (logits for all) after a KV of `kv` positions."""
    from shared.llama_runtime import GGUFContext, GGUFModel, Token

    model = GGUFModel(path)
    ctx = GGUFContext(model, 1024, 1, threads)
    ctx.decode([Token(100 + i, i, (0,), i == kv - 1) for i in range(kv)])
    out = {}
    for n in TOKENS:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ctx.decode([Token(200 + i, kv + i, (0,), True) for i in range(n)])
            times.append((time.perf_counter() - t0) * 1000)
            ctx.seq_rm(0, kv, -1)
        out[n] = statistics.median(times)
    print(f"cloud-runner: llama.cpp at {threads} threads, ms by new tokens: {out}", flush=True)
    return out


def plain_decode(path: Path, prompts: list[list[int]], n_new: int) -> dict[str, Any]:
    """llama.cpp's own greedy decode of each prompt, one thread: decode tokens/s after the first token."""
    from shared.llama_runtime import GGUFContext, GGUFModel, Token

    model = GGUFModel(path)
    tokens, seconds, texts = 0, 0.0, []
    for ids in prompts:
        ctx = GGUFContext(model, len(ids) + n_new + 8, 1, 1)
        logits = ctx.decode([Token(t, i, (0,), i == len(ids) - 1) for i, t in enumerate(ids)])[0]
        out = [int(logits.argmax())]
        t0 = time.perf_counter()
        for i in range(n_new - 1):
            logits = ctx.decode([Token(out[-1], len(ids) + i, (0,), True)])[0]
            out.append(int(logits.argmax()))
        seconds += time.perf_counter() - t0
        tokens += n_new - 1
        texts.append(out)
    rate = tokens / seconds
    print(f"cloud-runner: llama.cpp's own decode: {rate:.2f} tokens/s", flush=True)
    return {"tokens_per_s": rate, "texts": texts}


def one_runner(runner: str, tokenizer: Any, drafter: Any, ids: list[list[int]], n_new: int,
               sessions: tuple[int, ...], machine: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {"runner": runner}
    with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", runner], startup_timeout_s=600.0) as cloud:
        machine["pinned"] = machine["pinned"] and pin(cloud.pid, 1)
        client = client_for(settings(cloud.url, n_new, mode="cloud_only", **GREEDY), tokenizer, drafter)
        info = client.model_info()
        res["dtype"], res["reason"] = info.dtype, info.dtype_reason
        c0 = cpu_seconds(cloud.pid)
        alone = tally(client, ids)
        client.close()
        res["cloud_only"] = summary(alone)["tokens_per_s"]
        res["cloud_only_cpu_s_per_token"] = (cpu_seconds(cloud.pid) - c0) / max(alone["emitted"], 1)
        print(f"cloud-runner: {runner}: cloud_only {res['cloud_only']:.2f} tokens/s", flush=True)
        res["e2e"] = []
        if runner == "llamacpp":
            for rtt in RTTS_MS:
                with DelayProxy("127.0.0.1", cloud.http_port, rtt_ms=rtt) as proxy:
                    spec_client = client_for(settings(proxy.url, n_new, **GREEDY), tokenizer, drafter)
                    spec = tally(spec_client, ids)
                    spec_client.close()
                row = summary(spec, rtt_ms=rtt)
                row["equal"] = sum(a == b for a, b in zip(spec["texts"], alone["texts"], strict=True))
                res["e2e"].append(row)
                print(f"cloud-runner: rtt {rtt} ms: {row['tokens_per_s']:.2f} tokens/s, texts equal "
                      f"{row['equal']}/{len(ids)}", flush=True)
            res["cloud_only_texts"] = alone["texts"]
        traces = record_traces(cloud, tokenizer, drafter, ids, n_new)
        sampling = settings(cloud.url, n_new, temperature=0.0).sampling().to_dict()
        res["capacity"] = [row for n in sessions for row in replayed_cpu(cloud, traces, sampling, n_new, n)]
        res["cloud_peak_mb"] = rss_mb(cloud.pid, "VmHWM")
    return res


def run(out: Path, command: str, prompts: int = 6, n_new: int = 96, sessions: tuple[int, ...] = (1, 4, 16)) -> int:
    from edge.drafters.llamacpp import LlamaCppDrafter
    from shared.llama_runtime import find_gguf, unavailable

    gguf = find_gguf(TARGET)
    if unavailable() or gguf is None or find_gguf(DRAFT) is None:
        print(f"cloud-runner: needs llama.cpp and the prepared pair's GGUFs ({unavailable() or 'no model.gguf'})")
        return 2
    import torch
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    res: dict[str, Any] = {"command": command}
    res["verify_costs"] = {t: verify_costs(gguf, t) for t in (1, 2)}  # before this process is pinned to one core
    machine = {**cpu_info(), "load_start": load_start, "pinned": (os.cpu_count() or 1) >= 2 and pin("self", 0)}
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    ids = [chat_ids(tokenizer, humaneval_message(p["prompt"])) for p in humaneval_prompts(prompts)]
    res.update(prompts=len(ids), new_tokens=n_new)
    res["peer"] = plain_decode(gguf, ids, n_new)
    drafter = LlamaCppDrafter(DRAFT, threads=1)
    res["runners"] = [one_runner(r, tokenizer, drafter, ids, n_new, sessions, machine) for r in ("llamacpp", "torch")]
    llama = res["runners"][0]
    res["peer_equal"] = sum(a == b for a, b in zip(res["peer"]["texts"], llama["cloud_only_texts"], strict=True))
    return finish(res, machine, t0, out, "cloud-runner", (START, END), render)


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    peer = res["peer"]["tokens_per_s"]
    lines = [START, "## The cloud on llama.cpp (the coder target's GGUF) against PyTorch and llama.cpp's own decode", "",
             f"`{res['command']}` · {m['cpu']} (avx512_bf16 {'yes' if m['avx512_bf16'] else 'no'}, amx_bf16 "
             f"{'yes' if m['amx_bf16'] else 'no'}), load average {m['load_start'][0]:.2f} at the start and "
             f"{m['load_end'][0]:.2f} at the end, one core each (pinned: {m['pinned']}); {res['prompts']} HumanEval "
             f"prompts, {res['new_tokens']} new tokens each, greedy; {res['total_s'] / 60:.0f} min. GPU figures are "
             "unmeasured.", "",
             "llama.cpp's forward of n new tokens after a KV of 64 (ms; Qwen2.5-Coder-1.5B Q4_K_M):", "",
             "| threads | " + " | ".join(str(n) for n in TOKENS) + " |", "|---|" + "---|" * len(TOKENS)]
    for t, row in res["verify_costs"].items():
        lines.append(f"| {t} | " + " | ".join(f"{row[n]:.0f}" for n in TOKENS) + " |")
    lines += ["", "| runner | cloud_only decode tokens/s | against llama.cpp's own decode | cloud CPU-s per token | "
              "cloud peak RSS |", "|---|---|---|---|---|",
              f"| llama.cpp's own decode (the peer) | {peer:.2f} | 1.00x | - | - |"]
    for r in res["runners"]:
        ratio = r["cloud_only"] / peer
        aim = f" (aim >= {AIM_PEER}: {_met(ratio >= AIM_PEER)})" if r["runner"] == "llamacpp" else ""
        lines.append(f"| {r['runner']} ({r['dtype']}) | {r['cloud_only']:.2f} | {ratio:.2f}x{aim} | "
                     f"{r['cloud_only_cpu_s_per_token']:.3f} | {r['cloud_peak_mb']:.0f} MB |")
    llama = res["runners"][0]
    lines += ["", f"llama.cpp's own greedy texts equal to the llama.cpp cloud's: {res['peer_equal']}/{res['prompts']}.",
              "", "The edge's defaults (llama.cpp draft) on the llama.cpp cloud, against llama.cpp's own decode:", "",
              "| round trip | decode tokens/s | against the peer | aim | tokens per verify call | streamed | "
              "texts equal to the cloud's |", "|---|---|---|---|---|---|---|"]
    for r in llama["e2e"]:
        ratio = r["tokens_per_s"] / peer
        tpv = "-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
        lines.append(f"| {r['rtt_ms']} ms | {r['tokens_per_s']:.2f} | {ratio:.2f}x | >= {AIM_SPEEDUP[r['rtt_ms']]}x: "
                     f"{_met(ratio >= AIM_SPEEDUP[r['rtt_ms']])} | {tpv} | {r['streamed']} of {r['tokens']} | "
                     f"{r['equal']}/{res['prompts']} |")
    lines += ["", "Capacity: replayed sessions (the edge's trees, recorded) against as many cloud_only streams:", "",
              "| runner | sessions | cloud_only tokens per cloud CPU-s | speculative tokens per cloud CPU-s | ratio | "
              "p50 round ms | answers off the recording |", "|---|---|---|---|---|---|---|"]
    for r in res["runners"]:
        for n in sorted({c["sessions"] for c in r["capacity"]}):
            cell = {c["mode"]: c for c in r["capacity"] if c["sessions"] == n}
            base, spec = cell["cloud_only"], cell["speculative"]
            b, s = 1 / max(base["cpu_s_per_token"], 1e-9), 1 / max(spec["cpu_s_per_token"], 1e-9)
            lines.append(f"| {r['runner']} | {n} | {b:.2f} | {s:.2f} | {s / b:.2f}x | {spec['p50_ms']:.0f} | "
                         f"{spec['mismatches'] + base['mismatches']} |")
    lines += ["", END]
    return "\n".join(lines)

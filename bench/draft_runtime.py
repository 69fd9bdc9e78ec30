"""The coder pair's draft on llama.cpp against the draft in PyTorch (specsplit-bench --only draft-runtime).

One run, one machine, one core each (this process and its draft on core 0, the cloud on core 1):
1. the draft's cost: ms per drafted token (a chain of 8) and per tree (TreeControl's first shape: 32 nodes, 6
   levels), greedy, for the 0.5B in PyTorch (float32, bfloat16) and as its GGUF on llama.cpp (one thread);
2. the cloud's one-token step: cloud_only's decode time per token;
3. acceptance with each draft: greedy trees as the edge grows them (no streaming, no drafting ahead), tokens per
   verify call and the first position's acceptance, on HumanEval prompts and one Spec-Bench question per category;
4. end to end: the edge's defaults (llama.cpp draft) against cloud_only at 0 / 50 / 100 ms round trips, decode
   tokens/s, with every text compared to cloud_only's;
5. the edge's memory: a `specsplit-edge generate` process with the GGUF draft, its peak resident set.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.cloud_proc import REPO, CloudServer
from bench.coder_pair import (
    DRAFT,
    RTTS_MS,
    TARGET,
    TREE_FOR_COST,
    client_for,
    cpu_info,
    humaneval_message,
    humaneval_prompts,
    pin,
    rss_mb,
    settings,
    specbench_groups,
    summary,
    tally,
)
from bench.delay_proxy import DelayProxy
from bench.real_pair import chat_ids, draft_ms_per_token, finish
from bench.real_pair import met as _met

START, END = "<!-- draft-runtime:start -->", "<!-- draft-runtime:end -->"
# the aims of this measure
AIM_DRAFT_RATIO = 0.15
AIM_SPEEDUP = {0: 3.0, 50: 2.5, 100: 1.5}
AIM_EDGE_RSS_MB = 1024.0


def draft_cost(drafter: Any, ctx: list[int]) -> dict[str, float]:
    """ms per drafted token (a chain of 8) and the median ms of 3 trees of TREE_FOR_COST, greedy."""
    from shared.config import SamplingConfig

    cfg = SamplingConfig(temperature=0)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        drafter.propose_tree(ctx, TREE_FOR_COST, cfg, 0)
        times.append((time.perf_counter() - t0) * 1000)
    return {"token_ms": draft_ms_per_token(drafter, ctx), "tree_ms": statistics.median(times[1:])}


def draft_costs(ctx: list[int]) -> dict[str, dict[str, float]]:
    import torch

    from edge.drafters import ModelDrafter
    from edge.drafters.llamacpp import LlamaCppDrafter

    out = {}
    llama = LlamaCppDrafter(DRAFT, threads=1)
    out[f"llama.cpp, {llama.path.name} (one thread)"] = draft_cost(llama, ctx)
    del llama
    for name in ("float32", "bfloat16"):
        d = ModelDrafter(DRAFT, dtype=getattr(torch, name))
        out[f"PyTorch {name}"] = draft_cost(d, ctx)
        del d
    for name, c in out.items():
        print(f"draft-runtime: {name}: {c['token_ms']:.1f} ms per drafted token, {c['tree_ms']:.0f} ms per tree",
              flush=True)
    return out


def acceptance(url: str, tokenizer: Any, drafter: Any, ids: list[list[int]], n_new: int,
               per_category: int) -> dict[str, Any]:
    """Greedy trees as the edge grows them, no streaming, no drafting ahead: HumanEval, then Spec-Bench."""
    client = client_for(settings(url, n_new, temperature=0.0, stream_switch=False, draft_ahead=False), tokenizer,
                        drafter)
    res: dict[str, Any] = {"humaneval": summary(tally(client, ids)), "specbench": {}}
    for cat, texts in specbench_groups(per_category).items():
        res["specbench"][cat] = summary(tally(client, [chat_ids(tokenizer, q) for q in texts]))
    client.close()
    h = res["humaneval"]
    print(f"draft-runtime: {type(drafter).__name__}: {h['tokens_per_verify']:.2f} tokens/verify, first position "
          f"{(h['by_position'] or [0.0])[0]:.3f}", flush=True)
    return res


def end_to_end(cloud: CloudServer, tokenizer: Any, drafter: Any, ids: list[list[int]], n_new: int
               ) -> list[dict[str, Any]]:
    rows = []
    for rtt in RTTS_MS:
        with DelayProxy("127.0.0.1", cloud.http_port, rtt_ms=rtt) as proxy:
            got = {}
            for mode in ("cloud_only", "speculative"):
                client = client_for(settings(proxy.url, n_new, temperature=0.0, mode=mode), tokenizer, drafter)
                got[mode] = tally(client, ids)
                client.close()
            alone, spec = summary(got["cloud_only"]), summary(got["speculative"])
            equal = sum(a == b for a, b in zip(got["cloud_only"]["texts"], got["speculative"]["texts"], strict=True))
            rows.append({"rtt_ms": rtt, "cloud_only": alone["tokens_per_s"], "speculative": spec["tokens_per_s"],
                         "tokens_per_verify": spec["tokens_per_verify"], "streamed": spec["streamed"],
                         "tokens": spec["tokens"], "equal": equal, "prompts": len(ids)})
            r = rows[-1]
            print(f"draft-runtime: rtt {rtt} ms: {r['speculative']:.2f} against {r['cloud_only']:.2f} tokens/s "
                  f"({r['speculative'] / r['cloud_only']:.2f}x), texts equal {equal}/{len(ids)}", flush=True)
    return rows


def edge_memory(url: str, prompt: str, n_new: int) -> dict[str, Any]:
    """Peak resident set of one `specsplit-edge generate` process drafting with the GGUF, read from its own
    /proc/PID/status (VmHWM) while it runs: a forked child's ru_maxrss would count this benchmark's pages, which
    it holds until its exec."""
    cmd = [str(REPO / ".venv" / "bin" / "specsplit-edge"), "generate", prompt, "--cloud", url, "--draft", str(DRAFT),
           "--max-new-tokens", str(n_new), "--temperature", "0", "--chat", "--threads", "1",
           "--json"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0.0
    while proc.poll() is None:
        try:
            peak = max(peak, rss_mb(proc.pid, "VmHWM"))
        except OSError:  # it ended between the poll and the read
            break
        time.sleep(0.2)
    proc.wait()
    err = proc.stderr.read() if proc.stderr else ""
    ok = proc.returncode == 0
    if not ok:
        print(f"draft-runtime: the edge process failed: {err.strip()[-400:]}", flush=True)
    return {"peak_mb": peak if peak > 0 else float("nan"), "ok": ok, "wall_s": time.perf_counter() - t0}


def run(out: Path, command: str, prompts: int = 6, n_new: int = 96, per_category: int = 1) -> int:
    from edge.drafters.llamacpp import LlamaCppDrafter
    from shared.llama_runtime import find_gguf, unavailable

    for d in (TARGET, DRAFT):
        if not (d / "config.json").is_file() or find_gguf(DRAFT) is None:
            print(f"{d} is missing (or holds no model.gguf): run `specsplit-models prepare qwen-coder`")
            return 2
    if unavailable():
        print(f"draft-runtime: {unavailable()}")
        return 2
    import torch
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    machine = {**cpu_info(), "load_start": os.getloadavg(), "pinned": (os.cpu_count() or 1) >= 2 and pin("self", 0)}
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    messages = [humaneval_message(p["prompt"]) for p in humaneval_prompts(prompts)]
    ids = [chat_ids(tokenizer, m) for m in messages]
    res: dict[str, Any] = {"command": command, "prompts": len(ids), "new_tokens": n_new}
    res["draft_costs"] = draft_costs(ids[0])
    llama = LlamaCppDrafter(DRAFT, threads=1)
    with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", "torch"], startup_timeout_s=600.0) as cloud:
        machine["pinned"] = machine["pinned"] and pin(cloud.pid, 1)
        info = client_for(settings(cloud.url, n_new, mode="cloud_only"), tokenizer, llama)
        res["dtype"] = info.model_info().dtype
        info.close()
        res["e2e"] = end_to_end(cloud, tokenizer, llama, ids, n_new)
        res["cloud_step_ms"] = 1000 / res["e2e"][0]["cloud_only"]
        res["acceptance"] = {"llama.cpp (GGUF)": acceptance(cloud.url, tokenizer, llama, ids, n_new, per_category)}
        from edge.drafters import ModelDrafter

        torch_draft = ModelDrafter(DRAFT)
        res["acceptance"]["PyTorch float32"] = acceptance(cloud.url, tokenizer, torch_draft, ids, n_new,
                                                          per_category)
        del torch_draft
        res["edge_memory"] = edge_memory(cloud.url, messages[0], n_new)
    return finish(res, machine, t0, out, "draft-runtime", (START, END), render)


def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    step = res["cloud_step_ms"]
    lines = [START, "## The draft on llama.cpp (the coder pair's GGUF draft against PyTorch)", "",
             f"`{res['command']}` · {m['cpu']} (avx512_bf16 {'yes' if m['avx512_bf16'] else 'no'}, amx_bf16 "
             f"{'yes' if m['amx_bf16'] else 'no'}), load average {m['load_start'][0]:.2f} at the start and "
             f"{m['load_end'][0]:.2f} at the end, one core each (pinned: {m['pinned']}); the cloud "
             f"(Qwen2.5-Coder-1.5B-Instruct in PyTorch, {res['dtype']}) one torch thread; {res['prompts']} HumanEval "
             f"prompts, {res['new_tokens']} new tokens each, greedy; {res['total_s'] / 60:.0f} min. GPU figures are "
             "unmeasured.", "",
             "| draft | ms per drafted token | ms per tree (32 nodes, 6 levels) | per token / the cloud's step |",
             "|---|---|---|---|"]
    for name, c in res["draft_costs"].items():
        lines.append(f"| {name} | {c['token_ms']:.1f} | {c['tree_ms']:.0f} | {c['token_ms'] / step:.3f} |")
    llama_cost = next(iter(res["draft_costs"].values()))["token_ms"] / step
    lines += ["", f"The cloud's one-token step (cloud_only decode): {step:.0f} ms. Aim: the draft's token at most "
              f"{AIM_DRAFT_RATIO} of it: {llama_cost:.3f}, {_met(llama_cost <= AIM_DRAFT_RATIO)}.", "",
              "| draft | HumanEval tokens per verify call | first position | "
              + " | ".join(f"Spec-Bench {c}" for c in next(iter(res["acceptance"].values()))["specbench"]) + " |",
              "|---|---|---|" + "---|" * len(next(iter(res["acceptance"].values()))["specbench"])]
    for name, a in res["acceptance"].items():
        h = a["humaneval"]
        cats = " | ".join("-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
                          for r in a["specbench"].values())
        lines.append(f"| {name} | {h['tokens_per_verify']:.2f} | {(h['by_position'] or [0.0])[0]:.3f} | {cats} |")
    lines += ["", "End to end, the edge's defaults (llama.cpp draft, trees, drafting ahead, speculate-or-stream) against "
              "cloud_only, decode tokens/s:", "",
              "| round trip | cloud_only | speculative | ratio | aim | tokens per verify call | streamed | texts equal |",
              "|---|---|---|---|---|---|---|---|"]
    for r in res["e2e"]:
        ratio = r["speculative"] / r["cloud_only"] if r["cloud_only"] else 0.0
        aim = AIM_SPEEDUP[r["rtt_ms"]]
        tpv = "-" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
        lines.append(f"| {r['rtt_ms']} ms | {r['cloud_only']:.2f} | {r['speculative']:.2f} | {ratio:.2f}x | "
                     f">= {aim}x: {_met(ratio >= aim)} | {tpv} | {r['streamed']} of {r['tokens']} | "
                     f"{r['equal']}/{r['prompts']} |")
    mem = res["edge_memory"]
    lines += ["", f"The edge's memory: one `specsplit-edge generate` process drafting with the GGUF peaks at "
              f"{mem['peak_mb']:.0f} MB resident (aim under {AIM_EDGE_RSS_MB:.0f} MB: "
              f"{_met(mem['ok'] and mem['peak_mb'] < AIM_EDGE_RSS_MB)}).", "", END]
    return "\n".join(lines)

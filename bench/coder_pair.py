"""`specsplit-bench --only coder-pair`: the coder pair on this machine, in one run.

    specsplit-bench --only coder-pair [--coder-prompts 6] [--coder-new-tokens 96] [--coder-dtype auto]
                                      [--coder-sessions 1,4,16] [--coder-specbench 1] [--out BENCHMARKS.md]

The target is Qwen2.5-Coder-1.5B-Instruct (models/qwen2.5-coder-1.5b-instruct), the draft Qwen2.5-Coder-0.5B-Instruct
(models/qwen2.5-coder-0.5b-instruct), both made by `specsplit-models prepare qwen-coder`. The cloud is one
`specsplit-cloud` process with one torch thread (`--dtype` from --coder-dtype), the edge is this process with one
torch thread (draft = the 0.5B, head = none); each is pinned to one core of the 2-core machine. The prompts are the
first N HumanEval problems (bench/humaneval/prompts.jsonl), each sent as the chat message
"Complete this Python function:\n```python\n{prompt}```", and the Spec-Bench subset (bench/specbench/) by category.
1. fixed shapes (greedy, no drafting ahead, no streaming): chains of k = 4, 6, 8 and the edge's automatic trees:
   tokens per verify call, acceptance by draft position (tree depth), nodes per round.
2. T = 0.7, seed fixed, automatic trees (no drafting ahead, no streaming): tokens per verify call, and whether each
   prompt's text equals the cloud's own seeded /v1/generate text (cloud_only with the same seed).
3. Spec-Bench by category, the edge's automatic trees without streaming or drafting ahead: tokens per verify call.
4. end to end, greedy: the edge's defaults against cloud_only at 0 / 50 / 100 ms round trip (a delay proxy): decode
   tokens/s as `real_pair.end_to_end` computes it, tokens per verify call, the speedup.
5. the cloud's CPU-seconds per generated token (/proc/<pid>/stat utime + stime) for cloud_only and the defaults: one
   live session (the RTT 0 runs of 4.), and at each --coder-sessions level n edges at once replaying the defaults'
   recorded rounds (they draft nothing: n devices' worth of rounds from one core) against n cloud_only streams.
6. the draft's ms per drafted token (as the edge loads it, and in float32 and bfloat16: a chain and a tree) and the
   edge's and the cloud's resident memory.
The section is spliced into OUT between the coder-pair markers.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.cloud_proc import REPO, CloudServer
from bench.delay_proxy import DelayProxy
from bench.real_pair import chat_ids, draft_ms_per_token, splice
from edge.drafters.tree import TreeShape

TARGET = REPO / "models" / "qwen2.5-coder-1.5b-instruct"
DRAFT = REPO / "models" / "qwen2.5-coder-0.5b-instruct"
HUMANEVAL = REPO / "bench" / "humaneval" / "prompts.jsonl"
SPECBENCH = REPO / "bench" / "specbench" / "questions.jsonl"
START, END = "<!-- coder-pair:start -->", "<!-- coder-pair:end -->"
KS = (4, 6, 8)
RTTS_MS = (0, 50, 100)
T_SAMPLED = 0.7
SEED = 1
# patience only: a 1.5B forward over a tree, or a long prompt's prefill, on one core takes seconds
PATIENCE: dict[str, Any] = {"timeout_ms": 600_000, "open_timeout_s": 600.0}


def humaneval_prompts(n: int, path: Path = HUMANEVAL) -> list[dict[str, str]]:
    """The first n HumanEval problems ({task_id, prompt}), in file order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"task_id": r["task_id"], "prompt": r["prompt"]} for r in rows[:n]]


def humaneval_message(prompt: str) -> str:
    """The chat user message a HumanEval prompt is sent as."""
    return f"Complete this Python function:\n```python\n{prompt}```"


def specbench_groups(per_category: int, path: Path = SPECBENCH) -> dict[str, list[str]]:
    """The first `per_category` first turns of each category: MT-bench's coding questions as "coding", the other
    MT-bench questions as "mt_bench (not coding)", the other categories by name."""
    groups: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            cat = "coding" if q.get("source_category") == "coding" else (
                "mt_bench (not coding)" if q["category"] == "mt_bench" else q["category"])
            groups.setdefault(cat, []).append(q["turns"][0])
    return {"coding": groups.pop("coding", [])[:per_category], **{c: t[:per_category] for c, t in groups.items()}}


# -- the machine and the processes -------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # fields[0] is field 3, state
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int | str = "self", key: str = "VmRSS") -> float:
    """A memory line of /proc/<pid>/status (VmRSS resident now, VmHWM its peak), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def pin(pid: int | str, cpu: int) -> bool:
    """Pin every thread of `pid` to `cpu` (threads started later inherit it); False where that is not possible."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {cpu})
        return True
    except (OSError, AttributeError):
        return False


def cpu_info() -> dict[str, Any]:
    """lscpu's model name and whether the CPU flags amx_bf16 / avx512_bf16 are present."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown")
    except (OSError, subprocess.SubprocessError):
        model = "unknown"
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {"cpu": model, "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags}


def dtype_args(requested: str) -> tuple[list[str], str]:
    """The cloud's --dtype flag for `requested`, or none (its default) with a note when this cloud lacks that choice."""
    from typing import get_args

    from cloud.settings import Dtype

    if requested in get_args(Dtype):
        return ["--dtype", requested], ""
    return [], f"this specsplit-cloud has no --dtype {requested}; it ran at its default"


# -- measuring ------------------------------------------------------------------------------------------------


def settings(url: str, n_new: int, **kw: Any) -> Any:
    """The edge's defaults with the 0.5B draft and no head; `kw` sets the rest."""
    from edge.settings import EdgeSettings

    return EdgeSettings(cloud_url=url, draft=str(DRAFT), max_new_tokens=n_new, seed=SEED,
                        **{**PATIENCE, **kw})


def tally(client: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """One client over the prompts: sums of its metrics, the texts, decode time (after the first token)."""
    t: dict[str, Any] = {"emitted": 0, "streamed": 0, "verify": 0, "drafted": 0, "accepted": 0,
                         "switches": 0, "pos_d": [], "pos_a": [], "decode_tokens": 0, "decode_ms": 0.0, "ttft_ms": [],
                         "texts": [], "starts": []}
    for ids in prompts:
        r = client.generate(ids)
        m = r.metrics
        for key, v in (("emitted", m.emitted), ("streamed", m.streamed), ("verify", m.verify_calls),
                       ("drafted", m.drafted), ("accepted", m.accepted), ("switches", m.switches), ("decode_tokens", max(len(r.token_ids) - 1, 0)),
                       ("decode_ms", m.wall_ms - m.ttft_ms)):
            t[key] += v
        for i, (d, a) in enumerate(zip(m.position_drafted, m.position_accepted, strict=True)):
            if i == len(t["pos_d"]):
                t["pos_d"].append(0)
                t["pos_a"].append(0)
            t["pos_d"][i] += d
            t["pos_a"][i] += a
        t["ttft_ms"].append(m.ttft_ms)
        t["texts"].append(list(r.token_ids))
        t["starts"].append((m.start_way, m.start_note))  # the session's first speculate-or-stream decision, and why
    return t


def summary(t: dict[str, Any], **row: Any) -> dict[str, Any]:
    """Tokens per verify call (streamed tokens left out), acceptance (by position), nodes per round, decode tok/s,
    the median time to the first token (ms, over the prompts)."""
    calls = max(t["verify"], 1)
    # None: no verify call (every token streamed, or cloud_only)
    return {**row, "tokens_per_verify": (t["emitted"] - t["streamed"]) / calls if t["verify"] else None,
            "acceptance": t["accepted"] / max(t["drafted"], 1),
            "by_position": [a / d if d else 0.0 for a, d in zip(t["pos_a"], t["pos_d"], strict=True)][:8],
            # `drafted` counts a tree's nodes too
            "nodes_per_round": t["drafted"] / calls, "streamed": t["streamed"], "switches": t["switches"],
            "tokens_per_s": t["decode_tokens"] / t["decode_ms"] * 1000 if t["decode_ms"] > 0 else 0.0,
            "tokens": t["emitted"], "ttft_ms": sorted(t["ttft_ms"])[len(t["ttft_ms"]) // 2] if t["ttft_ms"] else 0.0}


def client_for(s: Any, tokenizer: Any, drafter: Any) -> Any:
    """A client with its draft loaded and the cloud's model info read before the first prompt."""
    from edge.client import EdgeClient

    client = EdgeClient(s, tokenizer=tokenizer, drafter=None if s.mode == "cloud_only" else drafter.fork())
    client.model_info()
    return client


def fixed_shapes(url: str, tokenizer: Any, drafter: Any, ids: list[list[int]], n_new: int) -> list[dict[str, Any]]:
    rows = []
    fixed = {"temperature": 0.0, "draft_ahead": False, "stream_switch": False}
    for name, shape in [*((f"chain k = {k}", {"fixed_k": k, "tree": "off"}) for k in KS), ("trees (auto)", {})]:
        client = client_for(settings(url, n_new, **fixed, **shape), tokenizer, drafter)
        rows.append(summary(tally(client, ids), shape=name))
        client.close()
        r = rows[-1]
        print(f"coder-pair: greedy {name}: {per_verify(r)} tokens/verify, first position "
              f"{(r['by_position'] or [0.0])[0]:.3f}, {r['nodes_per_round']:.1f} nodes/round", flush=True)
    return rows


def sampled(url: str, tokenizer: Any, drafter: Any, ids: list[list[int]], n_new: int) -> dict[str, Any]:
    kw = {"temperature": T_SAMPLED, "draft_ahead": False, "stream_switch": False}
    spec, ref = (client_for(settings(url, n_new, mode=mode, **kw), tokenizer, drafter)
                 for mode in ("speculative", "cloud_only"))
    ts, tr = tally(spec, ids), tally(ref, ids)
    spec.close()
    ref.close()
    equal = sum(a == b for a, b in zip(ts["texts"], tr["texts"], strict=True))
    row = {**summary(ts), "equal": equal, "prompts": len(ids)}
    print(f"coder-pair: T={T_SAMPLED}, seed {SEED}: {per_verify(row)} tokens/verify, texts equal to the "
          f"cloud's {equal}/{len(ids)}", flush=True)
    return row


def specbench(url: str, tokenizer: Any, drafter: Any, per_category: int, n_new: int) -> list[dict[str, Any]]:
    # no streaming: tokens per verify call of the draft on every category (the defaults stream where drafting
    # does not pay, which left some categories without a verify call)
    client = client_for(settings(url, n_new, temperature=0.0, stream_switch=False, draft_ahead=False), tokenizer,
                        drafter)
    rows = []
    for cat, texts in specbench_groups(per_category).items():
        rows.append(summary(tally(client, [chat_ids(tokenizer, q) for q in texts]), category=cat, questions=len(texts)))
        print(f"coder-pair: spec-bench {cat}: {per_verify(rows[-1])} tokens/verify, {rows[-1]['streamed']} streamed",
              flush=True)
    client.close()
    return rows


def end_to_end(cloud: CloudServer, tokenizer: Any, drafter: Any, ids: list[list[int]], n_new: int
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per RTT and mode: decode tokens/s, tokens per verify call; and the cloud's CPU-seconds per token at RTT 0."""
    rows, cpu = [], []
    for rtt in RTTS_MS:
        with DelayProxy("127.0.0.1", cloud.http_port, rtt_ms=rtt) as proxy:
            for mode in ("cloud_only", "speculative"):
                client = client_for(settings(proxy.url, n_new, temperature=0.0, mode=mode), tokenizer, drafter)
                c0 = cpu_seconds(cloud.pid)
                t = tally(client, ids)
                used = cpu_seconds(cloud.pid) - c0
                client.close()
                rows.append(summary(t, rtt_ms=rtt, mode=mode))
                if rtt == 0:
                    cpu.append(cpu_row(mode, 1, used, t["emitted"]))
                print(f"coder-pair: rtt {rtt} ms, {mode}: {rows[-1]['tokens_per_s']:.2f} decode tok/s, "
                      f"{per_verify(rows[-1])} tokens/verify, cloud {used:.1f} CPU-s", flush=True)
    return rows, cpu


def per_verify(row: dict[str, Any]) -> str:
    return "-" if row["tokens_per_verify"] is None else f"{row['tokens_per_verify']:.2f}"


def cpu_row(mode: str, sessions: int, cpu_s: float, tokens: int) -> dict[str, Any]:
    return {"mode": mode, "sessions": sessions, "cpu_s": cpu_s, "tokens": tokens,
            "cpu_s_per_token": cpu_s / max(tokens, 1)}


def record_traces(cloud: CloudServer, tokenizer: Any, drafter: Any, ids: list[list[int]], n_new: int) -> list[Any]:
    """One greedy generation per prompt with the edge's defaults (trees; no streaming, so every token comes from a
    round), every verify request kept with its answer (bench/traces.py)."""
    from bench.traces import RecordingTransport, Trace
    from edge.client import EdgeClient
    from edge.transport import RestTransport

    s = settings(cloud.url, n_new, temperature=0.0, draft_ahead=False, stream_switch=False)
    transport = RecordingTransport(RestTransport(cloud.url))
    client = EdgeClient(s, tokenizer=tokenizer, drafter=drafter.fork(), transport=transport)  # type: ignore[arg-type]
    traces = []
    for i, prompt in enumerate(ids):
        transport.rounds = []
        r = client.generate(prompt)
        traces.append(Trace(f"humaneval-{i}", "the 0.5B draft, trees", SEED, prompt, list(r.token_ids),
                            transport.rounds))
    client.close()
    return traces


def replayed_cpu(cloud: CloudServer, traces: list[Any], sampling: dict[str, Any], n_new: int,
                 sessions: int) -> list[dict[str, Any]]:
    """`sessions` concurrent edges replaying the recorded rounds (bench/loadgen.py: they draft nothing, so 16
    sessions keep the cloud as busy as 16 devices would), and as many streaming cloud_only's text from
    /v1/generate: the cloud's CPU-s per token for each; every answer checked against its recording."""
    import asyncio

    from bench.loadgen import run_load

    rows = []
    for mode in ("cloud_only", "speculative"):
        c0 = cpu_seconds(cloud.pid)
        res = asyncio.run(run_load(mode, traces, sessions, n_new, sampling, f"127.0.0.1:{cloud.grpc_port}", cloud.url))
        used = cpu_seconds(cloud.pid) - c0
        tokens = sum(t.tokens for t in res.texts)
        lat = sorted(ms for t in res.texts for ms in t.round_ms)
        rows.append({**cpu_row(mode, sessions, used, tokens), "replayed": True,
                     "p50_ms": statistics.median(lat) if lat else 0.0,
                     "mismatches": sum(t.mismatches for t in res.texts),
                     "errors": sum(t.error is not None for t in res.texts),
                     "error_messages": res.error_messages})
        print(f"coder-pair: {sessions} replayed sessions, {mode}: {rows[-1]['cpu_s_per_token']:.3f} cloud "
              f"CPU-s/token, {rows[-1]['mismatches']} mismatches, {rows[-1]['errors']} errors", flush=True)
    return rows


def cpu_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One table row per session count: both modes' CPU-s per token and their ratio, with its aim at 1 and 16."""
    out = []
    for n in sorted({r["sessions"] for r in rows}):
        cell = {r["mode"]: r for r in rows if r["sessions"] == n}
        base, spec = cell["cloud_only"]["cpu_s_per_token"], cell["speculative"]["cpu_s_per_token"]
        ratio = base / max(spec, 1e-9)
        shown = aim(ratio, AIM_CPU_RATIO[n], unit="x") if n in AIM_CPU_RATIO else f"**{ratio:.2f}x**"
        line = f"| {n} | {base:.3f} | {spec:.3f} | {shown} |"
        if "p50_ms" in cell["speculative"]:
            line += (f" {cell['speculative']['p50_ms']:.0f} | "
                     f"{cell['speculative']['mismatches'] + cell['cloud_only']['mismatches']} | "
                     f"{cell['speculative']['errors'] + cell['cloud_only']['errors']} |")
        out.append(line)
    return out


# -- the section ----------------------------------------------------------------------------------------------

# aims shown next to the figures: HumanEval, greedy unless said
AIM_TOKENS_PER_VERIFY = 6.0
AIM_FIRST_POSITION = 0.88
AIM_SPEEDUP = {0: 2.0, 50: 1.6, 100: 1.0}
AIM_SAMPLED_TOKENS_PER_VERIFY = 3.5
AIM_CPU_RATIO = {1: 3.0, 16: 2.0}


def aim(value: float, target: float, fmt: str = ".2f", unit: str = "") -> str:
    return f"**{value:{fmt}}{unit}** (aim >= {target:g}{unit}: {'met' if value >= target else 'missed'})"


def render(res: dict[str, Any]) -> str:
    """The markdown section (markers included) of one run's result dict (see `run`)."""
    m = res["machine"]
    flags = ", ".join(f"{f} {'present' if m[f] else 'absent'}" for f in ("amx_bf16", "avx512_bf16"))
    dtype = res.get("dtype") or "unknown"
    reason = f" ({res['dtype_reason']})" if res.get("dtype_reason") else ""
    lines = [START, "## The coder pair: Qwen2.5-Coder-1.5B-Instruct verifying Qwen2.5-Coder-0.5B-Instruct drafts", "",
             f"Command: `{res['command']}` ({res['total_s'] / 60:.0f} minutes). CPU: {m['cpu']} ({flags}); load average "
             f"{m['load_start']:.2f} at the start, {m['load_end']:.2f} at the end. Edge and cloud each have one core "
             f"(one torch thread each{', each process pinned to its own core' if m.get('pinned') else ''}) on one "
             f"2-core machine; the cloud's dtype {dtype}{reason}, the draft's {res.get('draft_dtype', 'float32')}. GPU figures are unmeasured.", "",
             f"Prompts: the first {res['prompts']} HumanEval problems (`bench/humaneval/`, MIT licence), each as the chat "
             "message \"Complete this Python function:\" and the prompt in a python code block, through the target's "
             f"chat template; {res['new_tokens']} new tokens at most, stopping at the end of the answer. The edge: draft "
             "`models/qwen2.5-coder-0.5b-instruct`, no head, the rest its defaults unless a table says otherwise.", ""]
    if res.get("dtype_note"):
        lines += [f"Note: {res['dtype_note']}.", ""]
    lines += ["### Fixed shapes, greedy (no drafting ahead, no streaming)", "",
              "Acceptance by position: the share of rounds that reached a draft position (a tree depth) and accepted "
              "it.", "", "| shape | tokens per verify call | acceptance by position (depth) | nodes per round |",
              "|---|---|---|---|"]
    for r in res["fixed"]:
        pos = " / ".join(f"{a:.2f}" for a in r["by_position"])
        auto = r["shape"] == "trees (auto)"
        tpv = aim(r["tokens_per_verify"] or 0.0, AIM_TOKENS_PER_VERIFY) if auto else per_verify(r)
        first = f"; first {aim(r['by_position'][0], AIM_FIRST_POSITION, '.3f')}" if auto and r["by_position"] else ""
        lines.append(f"| {r['shape']} | {tpv} | {pos}{first} | {r['nodes_per_round']:.1f} |")
    s = res["sampled"]
    lines += ["", f"### T = {T_SAMPLED}, seed {SEED}, the edge's automatic trees (no drafting ahead, no streaming)", "",
              "| tokens per verify call | texts equal to the cloud's own seeded /v1/generate text (cloud_only) |",
              "|---|---|", f"| {aim(s['tokens_per_verify'] or 0.0, AIM_SAMPLED_TOKENS_PER_VERIFY)} | **{s['equal']} of "
              f"{s['prompts']}** (aim: all) |"]
    if res["specbench"]:
        lines += ["", "### Spec-Bench subset by category, greedy, the edge's automatic trees without streaming or drafting ahead "
                  "(`bench/specbench/`)", "",
                  "| category | questions | tokens per verify call (streamed tokens left out) | tokens streamed |",
                  "|---|---|---|---|"]
    for r in res["specbench"]:
        lines.append(f"| {r['category']} | {r['questions']} | **{per_verify(r)}** | {r['streamed']} |")
    lines += ["", "### One session end to end, greedy: the edge's defaults against cloud_only", "",
              "Decode tokens/s: the tokens after the first over the time after the first, summed over the prompts (as "
              "`real_pair.end_to_end`); one client per mode and RTT (a delay proxy), its draft loaded first.", "",
              "| RTT | cloud_only decode tok/s | defaults decode tok/s | speedup | defaults: tokens per verify call "
              "(streamed left out) | tokens streamed / switches |", "|---|---|---|---|---|---|"]
    for rtt in RTTS_MS:
        cell = {r["mode"]: r for r in res["e2e"] if r["rtt_ms"] == rtt}
        base, spec = cell["cloud_only"]["tokens_per_s"], cell["speculative"]
        lines.append(f"| {rtt} ms | {base:.2f} | {spec['tokens_per_s']:.2f} | "
                     f"{aim(spec['tokens_per_s'] / max(base, 1e-9), AIM_SPEEDUP[rtt], unit='x')} | "
                     f"{per_verify(spec)} | {spec['streamed']} / {spec['switches']} |")
    live = [r for r in res["cpu"] if not r.get("replayed")]
    replayed = [r for r in res["cpu"] if r.get("replayed")]
    lines += ["", "### The cloud's CPU-seconds per generated token (utime + stime of its process, greedy, RTT 0)", ""]
    if live:
        lines += ["One live session (the RTT 0 runs above: the edge drafting, speculate-or-stream on). The prompts' "
                  "prefill is included; the cloud may hold their prefixes from earlier runs in both modes.", "",
                  "| sessions | cloud_only CPU-s per token | defaults CPU-s per token | cloud_only / defaults |",
                  "|---|---|---|---|"]
        lines += cpu_lines(live)
    if replayed:
        lines += ["", "Concurrent sessions, replayed (`record_traces`, `replayed_cpu`): each prompt's generation with the "
                  "edge's defaults (trees, no streaming) is recorded once, then n edges that draft nothing replay its "
                  "rounds over gRPC at once, as n devices each with its own draft would send them, and n cloud_only "
                  "clients stream the same texts from /v1/generate (bench/loadgen.py: every session replays at least "
                  "2 texts, every prompt is covered). Every answer is checked against its recording.", "",
                  "| sessions | cloud_only CPU-s per token | defaults CPU-s per token | cloud_only / defaults | "
                  "p50 round ms (defaults) | answers differing from the recording | errors |", "|---|---|---|---|---|---|---|"]
        lines += cpu_lines(replayed)
    rss = res["rss_mb"]
    lines += ["", "### The draft's cost and memory", "",
              f"The draft, as the edge loads it ({res.get('draft_dtype', 'float32')}), drafts at **{res['draft_ms']:.1f} ms "
              "per token** (`real_pair.draft_ms_per_token`: its propose of 8 tokens, greedy, one thread). Resident memory after the end-to-end runs: the edge (this "
              f"benchmark's process: tokenizer, draft, clients) {rss['edge']:.0f} MB (peak {rss['edge_peak']:.0f} MB), "
              f"the cloud {rss['cloud']:.0f} MB (peak {rss['cloud_peak']:.0f} MB).", ""]
    if res.get("draft_costs"):
        lines += [f"The draft in each dtype (`draft_costs`: the median of 3 after one, the first prompt's context; a tree "
                  f"of the edge's first shape, {TREE_FOR_COST.nodes} nodes grown {TREE_FOR_COST.depth} levels deep, "
                  f"{TREE_FOR_COST.width} children a node):", "",
                  "| draft dtype | ms per drafted token (a chain of 8) | ms per tree |", "|---|---|---|"]
        lines += [f"| {d} | {c['token_ms']:.1f} | {c['tree_ms']:.0f} |" for d, c in res["draft_costs"].items()]
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


# the tree the draft's cost is measured on: TreeControl's first shape
TREE_FOR_COST = TreeShape()


def draft_costs(ctx: list[int]) -> dict[str, dict[str, float]]:
    """The 0.5B draft in float32 and in bfloat16 on this machine: ms per drafted token (`draft_ms_per_token`) and
    ms per tree of TREE_FOR_COST (greedy), one thread."""
    import torch

    from edge.drafters import ModelDrafter
    from shared.config import SamplingConfig

    cfg, out = SamplingConfig(temperature=0), {}
    for name in ("float32", "bfloat16"):
        d = ModelDrafter(DRAFT, dtype=getattr(torch, name))
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            d.propose_tree(ctx, TREE_FOR_COST, cfg, 0)
            times.append((time.perf_counter() - t0) * 1000)
        out[name] = {"token_ms": draft_ms_per_token(d, ctx), "tree_ms": statistics.median(times[1:])}
        print(f"coder-pair: the draft in {name}: {out[name]}", flush=True)
        del d
    return out


def run(out: Path, command: str, prompts: int = 6, n_new: int = 96, dtype: str = "auto",
        sessions: tuple[int, ...] = (1,), specbench_per_category: int = 1) -> int:
    for d in (TARGET, DRAFT):
        if not (d / "config.json").is_file():
            print(f"{d} is missing: run `specsplit-models prepare qwen-coder`")
            return 2
    import torch
    from transformers import AutoTokenizer

    from edge.client import EdgeClient

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    machine = {**cpu_info(), "load_start": os.getloadavg()[0], "pinned": (os.cpu_count() or 1) >= 2 and pin("self", 0)}
    extra, note = dtype_args(dtype)
    if note:
        print(f"coder-pair: {note}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    ids = [chat_ids(tokenizer, humaneval_message(p["prompt"])) for p in humaneval_prompts(prompts)]
    drafter: Any = EdgeClient(settings("http://127.0.0.1:1", n_new)).drafter  # as the edge builds it (draft_dtype)
    res: dict[str, Any] = {"command": command, "prompts": len(ids), "new_tokens": n_new, "dtype_note": note,
                           "draft_dtype": str(getattr(getattr(drafter, "model", None), "dtype", "?")).removeprefix("torch."),
                           "draft_ms": draft_ms_per_token(drafter.fork(), ids[0])}
    print(f"coder-pair: the draft: {res['draft_ms']:.1f} ms per drafted token", flush=True)
    res["draft_costs"] = draft_costs(ids[0])
    with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", "torch", *extra], startup_timeout_s=600.0) as cloud:
        machine["pinned"] = machine["pinned"] and pin(cloud.pid, 1)
        info = client_for(settings(cloud.url, n_new, mode="cloud_only"), tokenizer, drafter)
        res["dtype"], res["dtype_reason"] = info.model_info().dtype, getattr(info.model_info(), "dtype_reason", "")
        info.close()
        res["fixed"] = fixed_shapes(cloud.url, tokenizer, drafter, ids, n_new)
        res["sampled"] = sampled(cloud.url, tokenizer, drafter, ids, n_new)
        res["specbench"] = (specbench(cloud.url, tokenizer, drafter, specbench_per_category, n_new)
                            if specbench_per_category > 0 else [])
        res["e2e"], res["cpu"] = end_to_end(cloud, tokenizer, drafter, ids, n_new)
        res["rss_mb"] = {"edge": rss_mb(), "edge_peak": rss_mb(key="VmHWM"), "cloud": rss_mb(cloud.pid),
                         "cloud_peak": rss_mb(cloud.pid, "VmHWM")}
        if sessions:
            traces = record_traces(cloud, tokenizer, drafter, ids, n_new)
            sampling = settings(cloud.url, n_new, temperature=0.0).sampling().to_dict()
            for n in sessions:
                res["cpu"] += replayed_cpu(cloud, traces, sampling, n_new, n)
    res["machine"] = {**machine, "load_end": os.getloadavg()[0]}
    res["total_s"] = time.perf_counter() - t0
    section = render(res)
    print("\n" + section, flush=True)
    print(f"wrote the coder-pair section into {splice_section(section, out)} ({res['total_s']:.0f} s)")
    return 0


def splice_section(section: str, out: Path) -> Path:
    """`section` in place of OUT's coder-pair section (real_pair.splice with this section's markers)."""
    return splice(section, out, START, END)

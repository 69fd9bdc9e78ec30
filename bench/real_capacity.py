"""Cloud capacity on the real pair: cloud CPU-seconds per committed token, token trees against chains against
cloud_only, at several session counts.

    python -m bench.real_capacity [--sessions 4,16,32] [--tokens 64] [--dtype auto]

Recording (once per run, greedy, the edge's own client over REST with its default head and its fallback):
each of the real-pair bench's chat prompts (bench/real_pair.py PROMPTS) generated with the edge's defaults
(token trees, sized per round) and with chains (`--tree off`, the cost-model k), every verify request kept
with its answer (bench/traces.py). Replaying (bench/loadgen.py): n concurrent cheap edges send the recorded
rounds of one kind over gRPC, asking for the same features, and check every answer against the recording
(greedy answers are fully determined); cloud_only streams the same texts from /v1/generate. Per case: the
cloud process's CPU time (/proc) over the committed tokens, p50 / p99 round latency. The cloud runs one torch
thread; the edges' CPU is out of the picture (they replay, they do not draft).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from typing import Any

from bench.cloud_proc import REPO, CloudServer
from bench.collectors import cpu_seconds
from bench.loadgen import run_load
from bench.traces import RecordingTransport, Trace

TARGET = REPO / "models" / "smollm2-135m-instruct"
GREEDY: dict[str, float | int] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.1}


def record(cloud_url: str, tree: str, n_new: int) -> list[Trace]:
    """One greedy generation per chat prompt with the edge's defaults but `tree` ("auto" | "off")."""
    from bench.real_pair import PROMPTS, chat_ids, default_head, head_choice
    from edge.client import EdgeClient
    from edge.settings import EdgeSettings
    from edge.transport import RestTransport
    from shared.config import SamplingConfig

    settings = EdgeSettings(cloud_url=cloud_url, temperature=0.0, repetition_penalty=1.1, max_new_tokens=n_new,
                            stop_at_eos=False, timeout_ms=120_000.0, tree=tree, draft_ahead=False,
                            stream_switch=False)  # every token through rounds: the replay sends rounds
    transport = RecordingTransport(RestTransport(cloud_url))
    hook = head_choice(default_head())  # the attention head (research/heads/) when present
    client = EdgeClient(settings, transport=transport, states_drafting=hook)  # type: ignore[arg-type]
    traces = []
    for i, text in enumerate(PROMPTS):
        ids = chat_ids(client.tokenizer, text)
        transport.rounds = []
        res = client.generate(ids, sampling=SamplingConfig.from_dict(GREEDY), seed=i)
        traces.append(Trace(f"chat-{i}", f"head, tree {tree}", i, ids, list(res.token_ids), transport.rounds,
                            feature_encoding=hook.encoding_for(client.model_info()) if hook is not None else ""))
    client.close()
    return traces


def case(cloud: CloudServer, mode: str, traces: list[Trace], sessions: int, n_new: int) -> dict[str, Any]:
    cpu0 = cpu_seconds(cloud.pid)
    res = asyncio.run(run_load(mode, traces, sessions, n_new, GREEDY, f"127.0.0.1:{cloud.grpc_port}", cloud.url))
    cpu = cpu_seconds(cloud.pid) - cpu0
    tokens = sum(t.tokens for t in res.texts)
    lat = sorted(ms for t in res.texts for ms in t.round_ms)
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [0.0] * 99
    return {"sessions": sessions, "tokens": tokens, "cloud_cpu_s": cpu, "cpu_ms_per_token": cpu / tokens * 1000,
            "wall_s": res.wall_s, "p50_ms": q[49], "p99_ms": q[98],
            "mismatches": sum(t.mismatches for t in res.texts), "errors": sum(t.error is not None for t in res.texts)}


def run(sessions: list[int], n_new: int, dtype: str = "auto") -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", "torch", "--max-sessions", "256", "--max-queue-depth", "512",
                                                          "--dtype", dtype]) as cloud:
        kinds = {"trees": record(cloud.url, "auto", n_new), "chains": record(cloud.url, "off", n_new)}
        for name, traces in kinds.items():
            out[name] = [case(cloud, "speculative", traces, n, n_new) for n in sessions]
            for r in out[name]:
                print(f"real-capacity: {name} at {r['sessions']}: {r['cpu_ms_per_token']:.1f} cloud CPU-ms per token, "
                      f"p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms, {r['mismatches']} mismatches", flush=True)
        out["cloud_only"] = [case(cloud, "cloud_only", kinds["trees"], n, n_new) for n in sessions]
        for r in out["cloud_only"]:
            print(f"real-capacity: cloud_only at {r['sessions']}: {r['cpu_ms_per_token']:.1f} cloud CPU-ms per token",
                  flush=True)
    return out


def render(res: dict[str, list[dict[str, Any]]], command: str, load: str) -> str:
    lines = ["### Cloud capacity on the real pair: trees, chains and cloud_only", "",
             f"Command: `{command}` ({load}; the cloud on one torch thread; replayed greedy traffic of the head on "
             "the bench's chat prompts, every answer checked against its recording). CPU-ms per token: the cloud "
             "process's CPU time over the tokens committed.", "",
             "| sessions | trees: cloud CPU-ms per token | chains | cloud_only | cloud_only / trees | "
             "trees p50 / p99 round ms | chains p50 / p99 round ms | mismatches |", "|---|---|---|---|---|---|---|---|"]
    for i, tr in enumerate(res["trees"]):
        ch, co = res["chains"][i], res["cloud_only"][i]
        lines.append(f"| {tr['sessions']} | **{tr['cpu_ms_per_token']:.1f}** | {ch['cpu_ms_per_token']:.1f} | "
                     f"{co['cpu_ms_per_token']:.1f} | {co['cpu_ms_per_token'] / tr['cpu_ms_per_token']:.2f}x | "
                     f"{tr['p50_ms']:.0f} / {tr['p99_ms']:.0f} | {ch['p50_ms']:.0f} / {ch['p99_ms']:.0f} | "
                     f"{tr['mismatches'] + ch['mismatches'] + co['mismatches']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import os
    ap = argparse.ArgumentParser(prog="python -m bench.real_capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="4,16,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="the cloud's --dtype")
    args = ap.parse_args(argv)
    load = f"load average {os.getloadavg()[0]:.2f} at the start"
    from shared.dtypes import resolve_dtype

    res = run([int(x) for x in args.sessions.split(",")], args.tokens, args.dtype)
    load += f"; the cloud in {resolve_dtype(args.dtype, 'cpu')[0]}"
    load += f", {os.getloadavg()[0]:.2f} at the end"
    print(render(res, "python -m bench.real_capacity " + " ".join(argv or sys.argv[1:]), load))
    return 0


if __name__ == "__main__":
    sys.exit(main())

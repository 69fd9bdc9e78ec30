"""Failover and scale-out of verifier replicas behind nginx (bench.cluster), on this machine.

    .venv/bin/specsplit-bench failover [--kills 10] [--sessions 16] [--tokens 48]
        [--transport rest|grpc] [--drafter ngram|model] [--json out.json]

1. Failover: a generation runs through nginx on a 3-replica cluster; once it has committed 8 tokens,
   the replica holding its session is SIGKILLed while rounds are in flight (no pause). The time from
   the kill to the next committed token is recorded; the killed replica is restarted before the next
   kill. Reported: p50 / min / max over `--kills` kills, and the greedy text checked against the
   target's (cloud_only through the balancer).
2. Scale-out: `--sessions` concurrent generations (each its own random routing key) through nginx to
   1 replica, then to 3 replicas; tokens/s = tokens committed by all sessions / wall time.
Each replica has one torch thread. On a CPU-only machine the replicas share its cores, so the
speed-up from 1 to 3 replicas is bounded by the core count, not by the replica count.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.cloud_proc import REPO
from bench.cluster import Cluster, ClusterConfig

if TYPE_CHECKING:  # the edge (and torch under it) loads once a measurement runs, so `--help` answers at once
    from edge.client import EdgeClient
    from edge.drafters import ModelDrafter
    from edge.drafters.base import Drafter

PROMPT = "def fibonacci(n):"
KILL_AFTER = 8
FAIL_TIMEOUT_S = 1.0
log = logging.getLogger("bench.measures.failover")


def make_client(cluster: Cluster, transport: str, drafter: Drafter, tokenizer: Any, max_new_tokens: int,
                **kw: Any) -> EdgeClient:
    from edge.client import EdgeClient
    from edge.settings import EdgeSettings

    s = EdgeSettings(cloud_url=cluster.nginx.http_url,
                     grpc_target=cluster.nginx.grpc_target if transport == "grpc" else None,
                     temperature=0, max_new_tokens=max_new_tokens, timeout_ms=30_000, timeout_fallback=False,
                     **kw)
    return EdgeClient(s, drafter=drafter, tokenizer=tokenizer)


def new_drafter(kind: str, model: ModelDrafter | None) -> Drafter:
    from edge.drafters import NGramDrafter

    return model.fork() if kind == "model" and model is not None else NGramDrafter()


def one_kill(cluster: Cluster, client: EdgeClient, expected: list[int]) -> dict[str, Any]:
    """Run one generation, SIGKILL its replica after KILL_AFTER tokens; seconds from kill to next token."""
    key = f"measure-{uuid.uuid4().hex[:10]}"
    since = cluster.nginx.access_log_size()
    stamps: list[float] = []
    killed_at: list[float] = []
    ready = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        gen = client.stream(PROMPT, route_key=key)
        for _ in gen:
            stamps.append(time.perf_counter())
            if len(stamps) == KILL_AFTER:
                ready.set()
        result["r"] = gen.result()

    t = threading.Thread(target=run)
    t.start()
    ready.wait(120)
    holder = cluster.holder_of(key, since)
    killed_at.append(time.perf_counter())
    holder.kill()
    t.join(300)
    r = result["r"]
    after = [s for s in stamps if s > killed_at[0]]
    return {"replica": holder.index, "kill_to_next_token_ms": (after[0] - killed_at[0]) * 1000 if after else None,
            "reopens": r.metrics.reopens, "retries": r.metrics.retries, "exact": r.token_ids == expected,
            "tokens_after_kill": len(after)}


def failover(args: argparse.Namespace, tokenizer: Any, model: ModelDrafter | None) -> dict[str, Any]:
    from edge.drafters import NGramDrafter

    cfg = ClusterConfig(replicas=3, fail_timeout=f"{FAIL_TIMEOUT_S:g}s")
    with Cluster(cfg) as cluster:
        expected = make_client(cluster, "rest", NGramDrafter(), tokenizer, args.tokens,
                               mode="cloud_only").generate(PROMPT).token_ids
        kills = []
        for i in range(args.kills):
            client = make_client(cluster, args.transport, new_drafter(args.drafter, model), tokenizer, args.tokens)
            k = one_kill(cluster, client, expected)
            kills.append(k)
            log.info("kill %d: %s", i + 1, k)
            for r in cluster.replicas:  # back to three before the next kill
                if not r.alive():
                    r.start()
            time.sleep(FAIL_TIMEOUT_S)
    ms = [k["kill_to_next_token_ms"] for k in kills if k["kill_to_next_token_ms"] is not None]
    return {"kills": kills, "p50_ms": statistics.median(ms) if ms else None, "min_ms": min(ms, default=None),
            "max_ms": max(ms, default=None), "all_exact": all(k["exact"] for k in kills),
            "reopens_min": min(k["reopens"] for k in kills)}


def throughput(replicas: int, args: argparse.Namespace, tokenizer: Any, model: ModelDrafter | None) -> dict[str, Any]:
    from edge.drafters import NGramDrafter

    with Cluster(ClusterConfig(replicas=replicas)) as cluster:
        # warm-up: one short generation per replica path
        make_client(cluster, args.transport, NGramDrafter(), tokenizer, 8).generate(PROMPT)
        tokens: list[int] = []
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                c = make_client(cluster, args.transport, new_drafter(args.drafter, model), tokenizer, args.tokens)
                tokens.append(len(c.generate(PROMPT, seed=i).token_ids))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.sessions)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        opened = {r.index: sum(1 for e in r.log_events() if e.get("event") == "open") for r in cluster.replicas}
    if errors:
        raise RuntimeError(f"{len(errors)} generations failed: {errors[0]!r}")
    return {"replicas": replicas, "sessions": args.sessions, "tokens": sum(tokens), "wall_s": wall,
            "tokens_per_s": sum(tokens) / wall, "sessions_opened_per_replica": opened}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specsplit-bench failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48, help="new tokens per generation")
    p.add_argument("--transport", choices=["rest", "grpc"], default="rest")
    p.add_argument("--drafter", choices=["ngram", "model"], default="ngram")
    p.add_argument("--skip-failover", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import torch
    from transformers import AutoTokenizer

    from edge.drafters import ModelDrafter

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "demo-target")
    model = ModelDrafter(REPO / "models" / "demo-draft") if args.drafter == "model" else None
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]},
                           "transport": args.transport, "drafter": args.drafter, "tokens": args.tokens}
    if not args.skip_failover:
        out["failover"] = failover(args, tokenizer, model)
    if not args.skip_throughput:
        out["throughput"] = [throughput(n, args, tokenizer, model) for n in (1, 3)]
    f = out.get("failover")
    if f:
        print(f"failover over {len(f['kills'])} SIGKILLs ({args.transport}, {args.drafter} drafter): kill -> next "
              f"committed token p50 {f['p50_ms']:.0f} ms (min {f['min_ms']:.0f}, max {f['max_ms']:.0f}); "
              f"every text exact: {f['all_exact']}; reopens >= {f['reopens_min']} per kill")
    for t in out.get("throughput", []):
        print(f"{t['sessions']} sessions over {t['replicas']} replica(s): {t['tokens_per_s']:.1f} tokens/s "
              f"({t['tokens']} tokens in {t['wall_s']:.1f} s; sessions per replica {t['sessions_opened_per_replica']})")
    print(f"(CPU-bound: {os.cpu_count()} cores shared by every replica, nginx and the edge; 1 torch thread per "
          f"replica; 1-min load average at start {out['machine']['load_1min']:.1f})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

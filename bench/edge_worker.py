"""The edge side of the benchmark, in its own process so its memory is measured apart from the rest.

    python -m bench.edge_worker --torch-threads 1

Reads one JSON job per stdin line, answers one JSON line on stdout. A job runs `sessions` edge
clients at once (one thread each, each with its own drafter and HTTP connection), every client
generating its list of prompts in order through the edge's Python API (`edge.client.EdgeClient`).
At the start of a job the process resets its peak-RSS counter, so the answer's `peak_rss_bytes`
is the high-water mark of that job alone.

Job: {"cloud_url", "mode", "draft" (dir | "ngram" | null), "tokenizer" (dir), "sampling" {...},
      "fixed_k" (int | null), "k_policy" ("dynamic" | "cost"), "draft_ahead" (bool), "max_new_tokens", "sessions": [[{"prompt", "prompt_ids", "seed"}, ...], ...]}
Answer: {"ok": true, "wall_ms", "peak_rss_bytes", "cpu_s", "generations": [...]} or
        {"ok": false, "error"}.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from bench.collectors import PeakRss, cpu_seconds

log = logging.getLogger("bench.edge_worker")


class Pools:
    """Drafters and transports kept across jobs, one per (what, session slot): warm caches and
    keep-alive connections, and no reloads inside a measurement."""

    def __init__(self) -> None:
        self._drafters: dict[tuple[str, int], Any] = {}
        self._transports: dict[tuple[str, int], Any] = {}
        self._tokenizers: dict[str, Any] = {}

    def drafter(self, draft: str | None, slot: int) -> Any:
        """Slot 0 loads the drafter; other slots are shallow copies after `reset()` (their own text
        state, the same read-only weights), so 16 sessions do not load 16 models."""
        if draft is None:
            return None
        key = (draft, slot)
        if key not in self._drafters:
            if slot == 0:
                from edge.drafters import ModelDrafter, NGramDrafter

                self._drafters[key] = NGramDrafter() if draft == "ngram" else ModelDrafter(draft)
            else:
                twin = copy.copy(self.drafter(draft, 0))
                twin.reset()
                self._drafters[key] = twin
        return self._drafters[key]

    def transport(self, url: str, slot: int) -> Any:
        key = (url, slot)
        if key not in self._transports:
            from edge.transport import RestTransport

            self._transports[key] = RestTransport(url)
        return self._transports[key]

    def tokenizer(self, path: str) -> Any:
        if path not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[path] = AutoTokenizer.from_pretrained(path)
        return self._tokenizers[path]


def round_rows(result: Any) -> list[list[Any]]:
    """[k, accepted_len, next_kind, decided_by, edge_time_ms, cloud_prefill_ms, rtt_ms, ahead, ahead_used,
    ahead_saved_ms] per round."""
    return [[r.k, r.accepted_len, r.next_kind, r.decided_by, round(r.edge_time_ms, 4),
             round(r.cloud_prefill_ms, 4), round(r.rtt_ms, 4), r.ahead, r.ahead_used, round(r.ahead_saved_ms, 4)]
            for r in result.rounds]


def run_session(job: dict[str, Any], slot: int, work: list[dict[str, Any]], pools: Pools,
                start: threading.Barrier, out: list[dict[str, Any]]) -> None:
    from edge.client import EdgeClient
    from edge.settings import EdgeSettings
    from shared.config import SamplingConfig

    s = job["sampling"]
    settings = EdgeSettings(
        cloud_url=job["cloud_url"], draft=job["draft"] or "ngram", tokenizer=job["tokenizer"], mode=job["mode"],
        max_new_tokens=job["max_new_tokens"], temperature=s["temperature"], top_p=s["top_p"],
        top_k=s["top_k"], repetition_penalty=s["repetition_penalty"], fixed_k=job["fixed_k"],
        k_policy=job.get("k_policy", "dynamic"), draft_ahead=job.get("draft_ahead", False),
        # every token verified: an answer is never dropped for being late
        timeout_ms=job.get("timeout_ms", 120_000.0), stop_at_eos=job.get("stop_at_eos", True),
        stream_switch=False)  # the speculative cases measure speculation: no switch to the cloud's streaming
    client = EdgeClient(settings, transport=pools.transport(job["cloud_url"], slot),
                        drafter=pools.drafter(job["draft"], slot), tokenizer=pools.tokenizer(job["tokenizer"]))
    if job["mode"] != "edge_only":
        client.model_info()  # fetched once, outside the timed generations
    sampling = SamplingConfig.from_dict(s)
    start.wait()
    for index, item in enumerate(work):
        t0 = time.perf_counter()
        res = client.generate(item["prompt_ids"], max_new_tokens=job["max_new_tokens"], seed=item["seed"],
                              sampling=sampling, mode=job["mode"])
        t1 = time.perf_counter()
        out.append({"session": slot, "index": index, "prompt": item.get("prompt"),
                    "prompt_len": len(item["prompt_ids"]), "token_ids": res.token_ids, "metrics": res.metrics.to_dict(), "rounds": round_rows(res),
                    "start_ms": t0 * 1000.0, "end_ms": t1 * 1000.0})


def run_job(job: dict[str, Any], pools: Pools, rss: PeakRss) -> dict[str, Any]:
    sessions: list[list[dict[str, Any]]] = job["sessions"]
    start = threading.Barrier(len(sessions) + 1)
    results: list[list[dict[str, Any]]] = [[] for _ in sessions]
    errors: list[str] = []

    def target(slot: int) -> None:
        try:
            run_session(job, slot, sessions[slot], pools, start, results[slot])
        except BaseException:
            errors.append(traceback.format_exc())
            start.abort()

    for slot in range(len(sessions)):  # before the threads: loading a model is not thread-safe
        pools.drafter(job["draft"], slot)
        pools.transport(job["cloud_url"], slot)
    pools.tokenizer(job["tokenizer"])
    threads = [threading.Thread(target=target, args=(i,), name=f"edge-{i}") for i in range(len(sessions))]
    rss.reset()
    cpu0 = cpu_seconds(rss.pid)
    for t in threads:
        t.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall_ms = (time.perf_counter() - t0) * 1000.0
    if errors:
        return {"ok": False, "error": errors[0]}
    gens = [g for r in results for g in r]
    for g in gens:  # times relative to the job's start
        g["start_ms"] -= t0 * 1000.0
        g["end_ms"] -= t0 * 1000.0
    return {"ok": True, "wall_ms": wall_ms, "peak_rss_bytes": rss.peak_bytes(),
            "cpu_s": cpu_seconds(rss.pid) - cpu0, "generations": gens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.edge_worker")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--preload", action="append", default=[], metavar="DIR|ngram",
                   help="drafter to load into session slot 0 at start (repeatable)")
    p.add_argument("--tokenizer", help="tokenizer directory to load at start")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    # import what every job needs now, while the cloud starts, not inside the first case
    import edge.client  # noqa: F401
    import edge.transport  # noqa: F401

    pools = Pools()
    for draft in args.preload:
        pools.drafter(draft, 0)
    if args.tokenizer:
        pools.tokenizer(args.tokenizer)
    import os

    rss = PeakRss(os.getpid())
    print(json.dumps({"ok": True, "ready": True, "pid": os.getpid(), "torch_threads": torch.get_num_threads()}),
          flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = run_job(json.loads(line), pools, rss)
        except Exception:
            answer = {"ok": False, "error": traceback.format_exc()}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

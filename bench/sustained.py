"""The verifier under sustained load, measured as an operator would: real edges against a real cloud.

    python -m bench.sustained [--tokens 96]

Each case starts its own `specsplit-cloud` (the demo target, default flags, one torch thread) and reads only
what a user sees: an edge's round times (`RoundRecord.rtt_ms`: the verify exchange, retries included), the
answers' status codes, and the cloud process's CPU time (/proc).

- sustained opens: one real edge (`specsplit-edge`'s client, the demo draft, a chain of k = 4, greedy)
  generates while 40 clients keep opening and closing 511-token sessions for the whole generation; its p50
  and max round against the same generation on the idle cloud (aims <= 2x and <= 5x), and the opens served.
- two keys: key A keeps 64 opens of 511 tokens in flight while key B's edge generates: B's 429 answers (its
  retries; aim: none) and its p50 round against idle (aim <= 2x).
- abandoned opens: 20 opens of 511 tokens whose clients leave 50 ms after sending; the cloud's CPU time for
  them against 20 opens that are waited for (aim <= 10 %).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from typing import Any

import httpx

from bench.cloud_proc import REPO, CloudServer
from bench.collectors import cpu_seconds
from bench.serving import ids

TARGET = REPO / "models" / "demo-target"
DRAFT = REPO / "models" / "demo-draft"
PROMPT = "def parse_config(path):\n    \"\"\"Read a configuration file and return its sections.\"\"\"\n"


def edge_generation(url: str, tokens: int, key: str | None = None) -> dict[str, Any]:
    """One greedy generation of the demo draft with a chain of k = 4; its round times and retries."""
    from pydantic import SecretStr

    from edge.client import EdgeClient
    from edge.settings import EdgeSettings

    s = EdgeSettings(cloud_url=url, draft=str(DRAFT), tokenizer=str(TARGET), temperature=0.0,
                     max_new_tokens=tokens, fixed_k=4, tree="off", draft_ahead=False, stop_at_eos=False,
                     timeout_ms=120_000, api_key=None if key is None else SecretStr(key),
                     stream_switch=False)  # every token a round: the rounds are what is timed
    client = EdgeClient(s)
    r = client.generate(PROMPT)
    client.close()
    recs = [rec for rec in r.rounds if rec.decided_by == "cloud"]
    rounds = [rec.rtt_ms for rec in recs]
    return {"p50_ms": statistics.median(rounds), "max_ms": max(rounds), "rounds": len(rounds),
            "retries": r.metrics.retries, "tokens": len(r.token_ids),
            "trace": trace(recs), "slowest": [trace([rec]) for rec in sorted(recs, key=lambda x: -x.rtt_ms)[:3]]}


def trace(recs: list[Any]) -> dict[str, float]:
    """Where rounds' time went, as medians (ms): waiting for the model (the cloud's queue time), the forward,
    and the rest of the exchange (the cloud's event loop and HTTP on both sides, the edge's own thread)."""
    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    return {"round": med([float(x.index) for x in recs]), "rtt": med([x.rtt_ms for x in recs]),
            "queue": med([x.cloud_queue_ms for x in recs]),
            "forward": med([x.cloud_prefill_ms for x in recs]),
            "rest": med([x.rtt_ms - x.cloud_queue_ms - x.cloud_prefill_ms for x in recs])}


async def _open_close_loop(url: str, stop: threading.Event, seed: int, key: str | None, counts: dict[str, int],
                           close: bool = True) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=url, timeout=600.0, headers=headers) as http:
        i = 0
        while not stop.is_set():
            r = await http.post("/v1/sessions", json={"prompt_ids": ids(511, seed * 1000 + i)})
            i += 1
            counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1
            if r.status_code == 200 and close:
                await http.delete(f"/v1/sessions/{r.json()['ctx_id']}")
            elif r.status_code == 429:
                await asyncio.sleep(float(r.headers.get("retry-after", "0.2")))


def _load(url: str, clients: int, load_key: str | None, stop: Any, out: Any) -> None:
    """The load process: `clients` loops until `stop`; their status counts go to `out`."""
    counts: dict[str, int] = {}
    flag = threading.Event()

    async def main() -> None:
        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            flag.set()
        await asyncio.gather(watch(), *(_open_close_loop(url, flag, s, load_key, counts) for s in range(clients)))
    asyncio.run(main())
    out.put(counts)


def under_load(url: str, tokens: int, clients: int, key: str | None = None, load_key: str | None = None
               ) -> tuple[dict[str, Any], dict[str, int]]:
    """The edge's generation while `clients` loops open and close long sessions (as `load_key`). The load runs
    in its own process, as other users' clients would: it does not share the edge's interpreter lock."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_load, args=(url, clients, load_key, stop, out), daemon=True)
    proc.start()
    time.sleep(3.0)  # the process is up and its opens are under way before the generation starts
    try:
        res = edge_generation(url, tokens, key)
    finally:
        stop.set()
        counts = out.get(timeout=600)
        proc.join()
    return res, counts


def sustained_case(tokens: int) -> dict[str, Any]:
    with CloudServer(TARGET, torch_threads=1) as cloud:
        edge_generation(cloud.url, 16)  # warm-up: the draft loaded, the prefix cached alike for both runs
        idle = edge_generation(cloud.url, tokens)
        busy, counts = under_load(cloud.url, tokens, 40)
    return {"idle": idle, "busy": busy, "opens": counts,
            "p50_ratio": busy["p50_ms"] / idle["p50_ms"], "max_ratio": busy["max_ms"] / idle["p50_ms"]}


def two_keys_case(tokens: int) -> dict[str, Any]:
    with CloudServer(TARGET, torch_threads=1, extra_args=["--api-key", "key-a", "--api-key", "key-b"]) as cloud:
        edge_generation(cloud.url, 16, key="key-b")
        idle = edge_generation(cloud.url, tokens, key="key-b")
        busy, counts = under_load(cloud.url, tokens, 64, key="key-b", load_key="key-a")
    return {"idle": idle, "busy": busy, "key_a_opens": counts, "p50_ratio": busy["p50_ms"] / idle["p50_ms"],
            "max_ratio": busy["max_ms"] / idle["p50_ms"]}


def abandoned_case(n: int = 20) -> dict[str, Any]:
    async def opens(url: str, leave_s: float | None, seed: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=leave_s or 600.0) as http:
            async def one(i: int) -> None:
                try:
                    r = await http.post("/v1/sessions", json={"prompt_ids": ids(511, seed + i)})
                    if r.status_code == 200:
                        await http.delete(f"/v1/sessions/{r.json()['ctx_id']}")
                except httpx.TimeoutException:
                    pass
            await asyncio.gather(*(one(i) for i in range(n)))

    with CloudServer(TARGET, torch_threads=1) as cloud:
        asyncio.run(opens(cloud.url, None, 0))  # warm-up
        cpu0 = cpu_seconds(cloud.pid)
        asyncio.run(opens(cloud.url, None, 1000))
        waited = cpu_seconds(cloud.pid) - cpu0
        cpu0 = cpu_seconds(cloud.pid)
        asyncio.run(opens(cloud.url, 0.05, 2000))
        time.sleep(3.0)  # whatever the cloud still does for them
        left = cpu_seconds(cloud.pid) - cpu0
    return {"opens": n, "waited_cpu_s": waited, "abandoned_cpu_s": left, "share": left / waited}


def render(s: dict[str, Any], k: dict[str, Any], a: dict[str, Any], command: str, load: str) -> str:
    lines = ["### The verifier under sustained load (real edges, demo target, default flags)", "",
             f"Command: `{command}` ({load}). Round: one verify exchange as the edge timed it (chain of k = 4, "
             "greedy, the demo draft).", "",
             "| case | idle round p50 ms | under load p50 ms | max ms | p50 / idle (aim <= 2x) | max / idle p50 "
             "(aim <= 5x) | what the load got |", "|---|---|---|---|---|---|---|",
             f"| 40 clients opening and closing 511-token sessions | {s['idle']['p50_ms']:.1f} | "
             f"{s['busy']['p50_ms']:.1f} | {s['busy']['max_ms']:.0f} | **{s['p50_ratio']:.1f}x** | "
             f"**{s['max_ratio']:.1f}x** | opens by status {s['opens']} |",
             f"| key A keeps 64 opens in flight, key B's edge | {k['idle']['p50_ms']:.1f} | {k['busy']['p50_ms']:.1f} "
             f"| {k['busy']['max_ms']:.0f} | **{k['p50_ratio']:.1f}x** | **{k['max_ratio']:.1f}x** | key A's opens "
             f"by status {k['key_a_opens']}; key B's retries (429 and the like): **{k['busy']['retries']}** |", "",
             "Where the rounds' time went (ms: the exchange as the edge timed it = the cloud's queue wait + the "
             "forward + the rest: the cloud's event loop and HTTP on both sides):", "",
             "| case | rounds | exchange | queue | forward | rest |", "|---|---|---|---|---|---|"]
    for name, run in (("idle (40 clients' case)", s["idle"]), ("40 clients, median", s["busy"]),
                      ("two keys: idle", k["idle"]), ("two keys: key B, median", k["busy"])):
        t = run["trace"]
        lines.append(f"| {name} | {run['rounds']} | {t['rtt']:.1f} | {t['queue']:.1f} | {t['forward']:.1f} | "
                     f"{t['rest']:.1f} |")
    for name, run in (("40 clients", s["busy"]), ("two keys", k["busy"])):
        for i, t in enumerate(run["slowest"]):
            lines.append(f"| {name}: slowest #{i + 1} | 1 | {t['rtt']:.1f} | {t['queue']:.1f} | {t['forward']:.1f} "
                         f"| {t['rest']:.1f} |")
    lines += ["",
             f"Abandoned opens: {a['opens']} opens of 511 tokens whose clients leave after 50 ms cost the cloud "
             f"{a['abandoned_cpu_s']:.2f} CPU-s against {a['waited_cpu_s']:.2f} CPU-s for the same number waited "
             f"for: **{a['share'] * 100:.0f} %** (aim <= 10 %)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import os
    ap = argparse.ArgumentParser(prog="python -m bench.sustained", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args(argv)
    from bench.coder_pair import cpu_info

    m = cpu_info()
    load = (f"{m['cpu']} (avx512_bf16 {'yes' if m['avx512_bf16'] else 'no'}, amx_bf16 "
            f"{'yes' if m['amx_bf16'] else 'no'}), load average {os.getloadavg()[0]:.2f} at the start")
    s = sustained_case(args.tokens)
    print(f"sustained: {s}", flush=True)
    k = two_keys_case(args.tokens)
    print(f"two keys: {k}", flush=True)
    a = abandoned_case()
    print(f"abandoned: {a}", flush=True)
    load += f", {os.getloadavg()[0]:.2f} at the end"
    print(render(s, k, a, "python -m bench.sustained " + " ".join(argv or sys.argv[1:]), load))
    return 0


if __name__ == "__main__":
    sys.exit(main())

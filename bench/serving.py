"""The serving-core cases of the capacity section: memory under a KV budget, prefix sharing, and
head-of-line blocking of rounds behind a burst of opens. Each case runs its own `specsplit-cloud`
process (REST, one torch thread) and reads only what a user could: its /metrics, its CPU time
(/proc) and the latency of its answers.

- memory: a tiny long-context Llama (1 KiB of KV per position) under `--kv-budget-bytes 16 MiB`:
  one 3,000-token session, then 100 of 60 tokens, then more 60-token sessions until the first
  eviction. Reports the largest `specsplit_cloud_kv_pool_bytes` read (must stay within the budget)
  and the most positions held by open sessions at once, as a share of budget / bytes per position.
- prefix: cloud CPU seconds to open 16 sessions whose 440-token prompts share their first 420 tokens,
  against 16 sessions with distinct prompts (two fresh clouds, same flags).
- head-of-line: the latency of a session's k = 4 verify rounds (sent one after another) while 40
  concurrent 511-token opens arrive, against the same rounds on the idle cloud; per token budget.
- tight-budget (`python -m bench.serving tight-budget`): five real edges generating at once on a KV
  budget of 24 blocks: texts against the target's own, 5xx and 429 answers, evictions, reopens.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.cloud_proc import REPO, CloudServer
from bench.collectors import cpu_seconds, parse_prometheus
from shared.hashing import ctx_hash

MIB = 1024 * 1024
TOKENIZER_DIR = REPO / "models" / "demo-target"


@dataclass
class ServingResults:
    memory: dict[str, Any] = field(default_factory=dict)
    prefix: dict[str, Any] = field(default_factory=dict)
    head_of_line: list[dict[str, Any]] = field(default_factory=list)
    overhead: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def long_context_llama(out: Path) -> Path:
    """A tiny random Llama with 4,096 positions and 1 KiB of KV per position (float32: 2 layers x
    K and V x 2 heads x 32 dims x 4 bytes)."""
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         eos_token_id=0)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in TOKENIZER_DIR.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


def metrics(http: httpx.Client) -> dict[str, float]:
    return parse_prometheus(http.get("/metrics").text)


def ids(n: int, seed: int, vocab: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def open_session(http: httpx.Client, prompt: list[int]) -> str | None:
    """The new session's id, or None when the cloud is full (429: nothing it may evict)."""
    r = http.post("/v1/sessions", json={"prompt_ids": prompt, "sampling_cfg": {"temperature": 0.0}})
    if r.status_code == 429:
        return None
    r.raise_for_status()
    return str(r.json()["ctx_id"])


def memory_case(progress: Any, budget: int = 16 * MIB) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="specsplit-longctx-"))
    model = long_context_llama(tmp / "llama")
    bpp = 1024
    out: dict[str, Any] = {"budget_bytes": budget, "bytes_per_position": bpp}
    with CloudServer(model, startup_timeout_s=600.0, extra_args=["--kv-budget-bytes", str(budget), "--max-sessions", "1024",
                                        "--max-queue-depth", "1024"]) as cloud, \
            httpx.Client(base_url=cloud.url, timeout=120.0) as http:
        pool_peak = held_peak = 0.0
        open_session(http, ids(3000, 0))
        n = 1
        evicted = 0.0
        refused = False
        while True:  # until the first eviction, or the first 429 (sessions just opened are not evicted)
            refused = open_session(http, ids(60, n)) is None
            n += 1
            m = metrics(http)
            pool_peak = max(pool_peak, m.get("specsplit_cloud_kv_pool_bytes", 0.0))
            evicted = m.get('specsplit_cloud_evictions_total{reason="kv_budget"}', 0.0)
            if n == 101:
                out["after_101_sessions"] = {"kv_pool_bytes": m["specsplit_cloud_kv_pool_bytes"],
                                             "sessions_kv_bytes": m["specsplit_cloud_kv_bytes"],
                                             "blocks_used": m.get('specsplit_cloud_kv_blocks{state="used"}')}
            if evicted or refused or n > 2000:
                break
            held_peak = max(held_peak, m["specsplit_cloud_kv_bytes"])
        out.update(sessions_opened=n, first_eviction_at=n if evicted else None,
                   first_refusal_at=n if refused and not evicted else None, kv_pool_peak_bytes=pool_peak,
                   most_positions_held=int(held_peak // bpp), usable_share=held_peak / budget)
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"serving memory: pool peak {pool_peak / MIB:.2f} MiB of {budget / MIB:.0f} MiB, "
             f"{out['usable_share']:.1%} of the budget held by sessions")
    return out


def prefix_case(target: Path, progress: Any, sessions: int = 16, length: int = 440, shared: int = 420) -> dict[str, Any]:
    common = ids(shared, 7)
    arms = {"shared": [common + ids(length - shared, 100 + i) for i in range(sessions)],
            "distinct": [ids(length, 200 + i) for i in range(sessions)]}
    out: dict[str, Any] = {"sessions": sessions, "prompt_tokens": length, "shared_tokens": shared}
    for name, prompts in arms.items():
        with CloudServer(target, startup_timeout_s=600.0, extra_args=["--max-sessions", "64"]) as cloud, \
                httpx.Client(base_url=cloud.url, timeout=120.0) as http:
            open_session(http, ids(8, 999))  # warm-up
            cpu0, t0 = cpu_seconds(cloud.pid), time.perf_counter()

            async def burst(prompts: list[list[int]] = prompts, url: str = cloud.url) -> None:
                async with httpx.AsyncClient(base_url=url, timeout=300.0) as ah:
                    rs = await asyncio.gather(*[ah.post("/v1/sessions", json={"prompt_ids": p}) for p in prompts])
                    for r in rs:
                        r.raise_for_status()
            asyncio.run(burst())
            out[name] = {"cloud_cpu_s": cpu_seconds(cloud.pid) - cpu0, "wall_s": time.perf_counter() - t0,
                         "prefix_hit_tokens": metrics(http).get("specsplit_cloud_prefix_cache_hit_tokens_total", 0.0)}
    out["cpu_ratio"] = out["distinct"]["cloud_cpu_s"] / max(out["shared"]["cloud_cpu_s"], 1e-9)
    progress(f"serving prefix: {out['distinct']['cloud_cpu_s']:.2f} vs {out['shared']['cloud_cpu_s']:.2f} cloud "
             f"CPU-s to open ({out['cpu_ratio']:.1f}x less with the shared prefix)")
    return out


async def _rounds(http: httpx.AsyncClient, ctx_id: str, context: list[int], n: int, k: int = 4) -> list[float]:
    """n verify rounds of k drafts (greedy, q = 1), one after another; their latencies in ms."""
    out = []
    for i in range(n):
        drafts = ids(k, 5000 + i + len(context))
        body = {"ctx_id": ctx_id, "ctx_len": len(context), "ctx_hash": ctx_hash(context), "append_ids": [],
                "draft_tokens": drafts, "q_token_probs": [1.0] * k, "k": k}
        t = time.perf_counter()
        r = await http.post("/v1/verify", json=body)
        out.append((time.perf_counter() - t) * 1000.0)
        r.raise_for_status()
        a = r.json()
        context += drafts[: a["accepted_len"]] + [a["correction"]]
    return out


def head_of_line_case(target: Path, progress: Any, budgets: tuple[int, ...] = (1024,),
                      shares: tuple[int | None, ...] = (None, 1024), opens: int = 40,
                      prompt: int = 511) -> list[dict[str, Any]]:
    """Per (--max-batch-tokens, --max-prefill-tokens-with-rounds; None = the default) pair: round latency
    idle and during the burst, and how long the burst of opens took (prefill throughput)."""
    results = []
    for budget, share in ((b, sh) for b in budgets for sh in shares):
        flags = ["--max-sessions", "128", "--max-queue-depth", "256", "--max-batch-tokens", str(budget)]
        if share is not None:
            flags += ["--max-prefill-tokens-with-rounds", str(share)]
        with CloudServer(target, startup_timeout_s=600.0, extra_args=flags) as cloud:
            async def main(url: str = cloud.url, budget: int = budget, share: int | None = share) -> dict[str, Any]:
                async with httpx.AsyncClient(base_url=url, timeout=600.0) as http:
                    context = ids(40, 1)
                    r = await http.post("/v1/sessions", json={"prompt_ids": context, "sampling_cfg": {"temperature": 0.0}})
                    ctx_id = r.json()["ctx_id"]
                    await _rounds(http, ctx_id, context, 3)  # warm-up
                    idle = await _rounds(http, ctx_id, context, 15)
                    t_burst = time.perf_counter()
                    burst = [asyncio.ensure_future(http.post("/v1/sessions", json={"prompt_ids": ids(prompt, 300 + i)}))
                             for i in range(opens)]
                    await asyncio.sleep(0.05)
                    busy: list[float] = []
                    while not all(b.done() for b in burst) and len(busy) < 200:
                        busy += await _rounds(http, ctx_id, context, 1)
                    for b in burst:
                        (await b).raise_for_status()
                    burst_s = time.perf_counter() - t_burst
                    opens_done = sum(1 for b in burst if b.done())
                return {"max_batch_tokens": budget, "prefill_share": share, "burst_s": burst_s,
                        "idle_p50_ms": statistics.median(idle),
                        "busy_p50_ms": statistics.median(busy), "busy_max_ms": max(busy), "busy_rounds": len(busy),
                        "opens": opens_done, "ratio_p50": statistics.median(busy) / statistics.median(idle)}
            res = asyncio.run(main())
        results.append(res)
        progress(f"serving head-of-line (--max-batch-tokens {budget}, --max-prefill-tokens-with-rounds "
                 f"{share or 'default'}): round p50 {res['idle_p50_ms']:.1f} ms idle, {res['busy_p50_ms']:.1f} ms "
                 f"during {opens} opens ({res['ratio_p50']:.1f}x); the opens took {res['burst_s']:.1f} s")
    return results


def tight_budget_case(target: Path, progress: Any, blocks: int = 24, edges: int = 5, new_tokens: int = 48,
                      draft: Path = REPO / "models" / "demo-draft", extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """`edges` real edge clients (greedy, the demo draft, REST, two API keys) generating at once against a
    cloud whose KV budget holds `blocks` blocks, with prompts of 61-147 tokens: how many finish with the
    target's own text (cloud_only on a cloud without a budget), and what the cloud answered meanwhile
    (5xx and 429 answers, evictions) and the edges did (reopens)."""
    import threading

    from pydantic import SecretStr
    from transformers import AutoTokenizer

    from edge.client import EdgeClient
    from edge.drafters import ModelDrafter
    from edge.settings import EdgeSettings
    from shared.kvpool import BLOCK_SIZE

    tok = AutoTokenizer.from_pretrained(target)
    texts = [json.loads(line)["text"] for line in (REPO / "bench" / "prompts" / "code.jsonl").read_text().splitlines()]
    sizes = [61 + (147 - 61) * i // max(edges - 1, 1) for i in range(edges)]
    prompts = [list(tok.encode(texts[i % len(texts)]))[:n] for i, n in enumerate(sizes)]
    keys = ["tenant-a", "tenant-b"]
    cfg = json.loads((target / "config.json").read_text())
    per_token = 2 * cfg["n_layer"] * cfg["n_embd"] * 4  # K and V, every layer, float32 (the demo GPT-2)
    base: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": new_tokens, "stop_at_eos": False,
                            "timeout_ms": 120_000}
    key_flags = [f for k in keys for f in ("--api-key", k)]
    with CloudServer(target, extra_args=key_flags) as free:
        want = [EdgeClient(EdgeSettings(cloud_url=free.url, mode="cloud_only", api_key=SecretStr(keys[i % 2]),
                                        **base),
                           tokenizer=tok).generate(p).token_ids for i, p in enumerate(prompts)]
    flags = ["--kv-budget-bytes", str(blocks * BLOCK_SIZE * per_token), *key_flags, *extra]
    results: list[Any] = [None] * edges
    drafter = ModelDrafter(draft)
    with CloudServer(target, extra_args=flags) as cloud:
        def run(i: int) -> None:
            c = EdgeClient(EdgeSettings(cloud_url=cloud.url, api_key=SecretStr(keys[i % 2]), fixed_k=4, **base), tokenizer=tok,
                           drafter=drafter.fork())
            try:
                results[i] = c.generate(prompts[i])
            except Exception as e:  # noqa: BLE001 - the failure is the figure
                results[i] = e
        threads = [threading.Thread(target=run, args=(i,)) for i in range(edges)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        m = metrics(httpx.Client(base_url=cloud.url))
    statuses = {k: v for k, v in m.items() if k.startswith("specsplit_cloud_responses_total")}
    res = {"blocks": blocks, "edges": edges, "prompt_tokens": sizes, "new_tokens": new_tokens, "flags": list(extra),
           "finished_exact": sum(not isinstance(r, Exception) and r.token_ids == w
                                 for r, w in zip(results, want, strict=True)),
           "failed": [f"{type(r).__name__}: {r}" for r in results if isinstance(r, Exception)],
           "reopens": sum(r.metrics.reopens for r in results if not isinstance(r, Exception)),
           "evictions": sum(v for k, v in m.items() if k.startswith("specsplit_cloud_evictions_total")),
           "answers_5xx": sum(v for k, v in statuses.items() if 'status="5' in k),
           "answers_429": sum(v for k, v in statuses.items() if 'status="429"' in k)}
    progress(f"serving tight budget ({blocks} blocks, {edges} edges{', ' + ' '.join(extra) if extra else ''}): {res['finished_exact']}/{edges} finished with "
             f"the target's text; {res['answers_5xx']:.0f} 5xx, {res['answers_429']:.0f} 429, "
             f"{res['evictions']:.0f} evictions, {res['reopens']} reopens")
    return res


def run_serving(target: Path, progress: Any = lambda s: None) -> ServingResults:
    return ServingResults(memory=memory_case(progress), prefix=prefix_case(target, progress),
                          head_of_line=head_of_line_case(target, progress))


def main() -> None:  # python -m bench.serving [head-of-line SHARE...]: the cases alone, JSON on stdout
    import sys

    target = REPO / "models" / "demo-target"
    if sys.argv[1:2] == ["tight-budget"]:  # then any specsplit-cloud flags, e.g. --eviction-active-s 0
        print(json.dumps(tight_budget_case(target, print, extra=tuple(sys.argv[2:])), indent=1))
        return
    if sys.argv[1:2] == ["head-of-line"]:
        shares = tuple(int(x) for x in sys.argv[2:]) or (1024, 512, 256, 128, 64, 32)
        print(json.dumps(head_of_line_case(target, print, shares=shares), indent=1))
        return
    res = run_serving(target, progress=print)
    print(json.dumps(res.to_json(), indent=1))


if __name__ == "__main__":
    main()

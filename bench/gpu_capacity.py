"""`specsplit-bench --only gpu-capacity`: what a GPU serves with edge drafts against the same GPU serving alone.

    specsplit-bench --only gpu-capacity [--gpu-shapes coder-1.5b] [--gpu-capacity-sessions 1,8,32,64,128,256]
        [--gpu-capacity-tokens 64] [--gpu-capacity-k 8] [--out BENCHMARKS.md]

One target of a named shape (bench/gpu.py SHAPES) with random weights, in bfloat16 on CUDA (float32 on a CPU: a dry
run), served in this process by the cloud's own service (the scheduler, the runner, the verify rule; no HTTP). At each
load of S sessions, each with its own 128-token prompt:

- **cloud_only**: every session streams `--gpu-capacity-tokens` of the target's own greedy tokens (a session stream,
  one token a forward per session, all sessions batched);
- **speculation**: every session sends chains of k drafts whose acceptance is the real coder pair's, replayed:
  session i follows row i of bench/traces/coder_acceptance.json (`python -m bench.acceptance_trace`: at each
  position of the coder target's greedy answer, whether the 0.5B draft predicted it), and its draft at position t is
  the target's own greedy token where the trace has a hit, another token where it has a miss. So the cloud does the
  real verify work at the real acceptance, and the text must be cloud_only's. The edges' drafting is not on the
  GPU's clock: devices draft, and here the drafts are known in advance.

Printed per load: tokens per second of the GPU (the run's wall time, the GPU serving nothing else), target forwards,
p50 / p99 time between a session's tokens (a round's tokens share its time evenly), whether every text equals
cloud_only's. Before the loads, the forward's cost by bucket (rows x tokens a row, context 512) is measured and
saved (bench/results/forward_costs_<device>.json); from it and the trace a **modeled** curve (each level's forward
cost x rounds, no queueing) is printed beside the measured one, so a session without a GPU can see what a change of
policy would do, from the last GPU run's costs.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.gpu import model_dir, random_lm, random_weights

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "bench" / "traces" / "coder_acceptance.json"
RESULTS = REPO / "bench" / "results"
PROMPT = 128
# the context the forward's costs are measured at (a CPU's dry run: PROMPT)
CONTEXT = 512
START, END = "<!-- gpu-capacity:start -->", "<!-- gpu-capacity:end -->"


def load_trace(path: Path = TRACE) -> list[list[int]]:
    """Each recorded answer's hits (1: the draft predicted that position)."""
    rows = [r["hits"] for r in json.loads(path.read_text())["rows"] if r["hits"]]
    if not rows:
        raise SystemExit(f"{path} holds no positions: python -m bench.acceptance_trace")
    return rows


def chain_tokens(hits: list[int], k: int) -> float:
    """Tokens a greedy chain round of k commits on average over the trace's start positions (accepted + 1)."""
    total = 0
    for t in range(len(hits)):
        run = 0
        while run < k and hits[(t + run) % len(hits)]:
            run += 1
        total += run + 1
    return total / len(hits)


@dataclass
class Load:
    """One policy at one load: what the sessions got."""
    policy: str
    sessions: int
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    rounds: int = 0
    gaps_ms: list[float] = field(default_factory=list)
    texts: list[list[int]] = field(default_factory=list)

    def row(self, reference: list[list[int]] | None) -> dict[str, Any]:
        gaps = sorted(self.gaps_ms) or [0.0]
        return {"policy": self.policy, "sessions": self.sessions, "tokens": self.tokens,
                "seconds": round(self.seconds, 3), "tokens_per_s": round(self.tokens / self.seconds, 1),
                "forwards": self.forwards, "rounds": self.rounds,
                "p50_ms": round(statistics.median(gaps), 2), "p99_ms": round(gaps[int(0.99 * (len(gaps) - 1))], 2),
                "texts_equal": None if reference is None else self.texts == reference}


def _forwards(svc: Any) -> int:
    """Batched forwards the service ran so far (its batch_size histogram's count)."""
    return int(svc.metrics.registry.get_sample_value("specsplit_cloud_batch_size_count") or 0)


async def _open(svc: Any, prompt: list[int]) -> Any:
    from shared.config import SamplingConfig
    from shared.protocol import OpenSessionRequest

    return await svc.open_session(OpenSessionRequest(prompt, SamplingConfig(temperature=0.0), max_new_tokens=4096), "")


async def cloud_only(svc: Any, prompts: list[list[int]], n: int) -> Load:
    from shared.hashing import ctx_hash
    from shared.protocol import StreamedToken, StreamSessionRequest

    infos = [await _open(svc, p) for p in prompts]
    load = Load("cloud_only", len(prompts), texts=[[] for _ in prompts])
    before = _forwards(svc)

    async def one(i: int) -> None:
        info, last = infos[i], time.perf_counter()
        req = StreamSessionRequest(info.ctx_id, len(prompts[i]), ctx_hash(prompts[i]), max_new_tokens=n,
                                   stop_at_eos=False)
        async for ev in svc.stream_session(req, ""):
            if isinstance(ev, StreamedToken):
                now = time.perf_counter()
                load.gaps_ms.append((now - last) * 1000)
                last = now
                load.texts[i].append(ev.token_id)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    load.seconds = time.perf_counter() - t0
    load.forwards = _forwards(svc) - before
    load.tokens = sum(len(t) for t in load.texts)
    load.rounds = load.tokens
    for info in infos:
        svc.close_session(info.ctx_id, "")
    return load


async def speculation(svc: Any, prompts: list[list[int]], texts: list[list[int]], trace: list[list[int]],
                      k: int, vocab: int) -> Load:
    from shared.hashing import ctx_hash
    from shared.protocol import DraftProposal, VerifyRequest

    infos = [await _open(svc, p) for p in prompts]
    load = Load(f"chain-{k}", len(prompts), texts=[[] for _ in prompts])
    before = _forwards(svc)

    async def one(i: int) -> None:
        ctx, text, hits = list(prompts[i]), texts[i], trace[i % len(trace)]
        held, out = len(ctx), load.texts[i]
        while len(out) < len(text):
            c = len(out)
            n = min(k, len(text) - c - 1)  # the last token is the round's own
            drafts = [text[c + j] if hits[(c + j) % len(hits)] else (text[c + j] + 1) % vocab for j in range(n)]
            t0 = time.perf_counter()
            ans = await svc.verify(VerifyRequest(infos[i].ctx_id, len(ctx), ctx_hash(ctx), ctx[held:],
                                                 DraftProposal(drafts, [1.0] * n, "deterministic")), "", n)
            got = drafts[: ans.accepted_len] + [ans.correction]
            ms = (time.perf_counter() - t0) * 1000
            load.gaps_ms += [ms / len(got)] * len(got)
            load.rounds += 1
            held = len(ctx)
            ctx += got
            out += got

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    load.seconds = time.perf_counter() - t0
    load.forwards = _forwards(svc) - before
    load.tokens = sum(len(t) for t in load.texts)
    for i, info in enumerate(infos):
        svc.close_session(info.ctx_id, "")
        del load.texts[i][len(texts[i]):]
    return load


def forward_costs(target: Any, buckets: list[tuple[int, int]], context: int, dev: str,
                  repeats: int = 5) -> dict[str, float]:
    """Median ms of one forward of R rows x N new tokens each, every row after `context` cached tokens."""
    from shared.rows import Row

    pool, out = target.pool, {}
    g = torch.Generator().manual_seed(0)
    for R, N in buckets:
        slots = [pool.allocate() for _ in range(R)]
        try:
            for s in slots:
                target.forward([Row(s, 0, torch.randint(1, 1000, (context,), generator=g).tolist(), 0)])
                pool.set_length(s, context)
            times = []
            for _ in range(repeats + 2):
                rows = [Row(s, context, torch.randint(1, 1000, (N,), generator=g).tolist(), N) for s in slots]
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                target.forward(rows)
                times.append((time.perf_counter() - t0) * 1000)
                for s in slots:
                    pool.crop(s, context)
            out[f"{R}x{N}"] = round(statistics.median(times[2:]), 3)
        finally:
            for s in slots:
                pool.release(s)
    return out


def modeled(costs: dict[str, float], sessions: list[int], trace: list[list[int]], k: int) -> list[dict[str, Any]]:
    """Tokens per second each level would get if every step were one forward of all sessions (a model)."""
    per_round = statistics.mean(chain_tokens(h, k) for h in trace)
    rows = []
    for S in sessions:
        one, spec = costs.get(f"{S}x1"), costs.get(f"{S}x{k + 1}")
        if one and spec:
            rows.append({"sessions": S, "cloud_only": round(S / one * 1000, 1),
                         f"chain-{k}": round(S * per_round / spec * 1000, 1),
                         "ratio": round(per_round * one / spec, 2)})
    return rows


def run(out: Path | None, command: str, shape: str = "coder-1.5b", sessions: tuple[int, ...] = (1, 8, 32, 64, 128, 256),
        n_tokens: int = 64, k: int = 8, trace_path: Path = TRACE) -> dict[str, Any]:
    import tempfile

    from cloud.runners.torch_runner import TargetModel
    from cloud.service import VerifierService
    from cloud.settings import CloudSettings

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    trace = load_trace(trace_path)
    most = max(sessions)
    machine = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
               if dev == "cuda" else "CPU (no CUDA device: a dry run)")
    with tempfile.TemporaryDirectory(prefix="specsplit-capacity-") as tmp:
        d = model_dir(shape, Path(tmp) / shape)
        lm = random_lm(d, dev, dtype, head_scale=8.0)  # a scaled head: greedy choices are not near-ties
        settings = CloudSettings(model=d, device=dev, dtype="bfloat16" if dev == "cuda" else "float32",
                                 max_sessions=2 * most + 8, max_batch_size=most, max_batch_tokens=max(256, most * (k + 1)),
                                 max_queue_depth=4 * most, kv_budget_bytes=8 * 1024**3 if dev == "cuda" else 1024**3,
                                 max_generate_tokens=max(n_tokens, 64), batch_wait_ms=1.0, node_budget=False)
        with random_weights(lm):
            target = TargetModel(d, dev, settings.dtype, invariant=settings.batch_invariant, executor=settings.executor)
        vocab = target.support
        buckets = sorted({(S, 1) for S in sessions} | {(S, k + 1) for S in sessions})
        costs = forward_costs(target, buckets, CONTEXT if dev == "cuda" else PROMPT, dev)
        svc = VerifierService(settings, target)
        g = torch.Generator().manual_seed(1)
        rows: list[dict[str, Any]] = []
        try:
            for S in sessions:
                prompts = [torch.randint(1, vocab, (PROMPT,), generator=g).tolist() for _ in range(S)]
                alone = asyncio.run(cloud_only(svc, prompts, n_tokens))
                spec = asyncio.run(speculation(svc, prompts, alone.texts, trace, k, vocab))
                rows += [alone.row(None), spec.row(alone.texts)]
                print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
        finally:
            svc.close()
    res = {"shape": shape, "device": dev, "machine": machine, "date": time.strftime("%Y-%m-%d"), "k": k,
           "tokens": n_tokens, "forward_path": target.forward_path, "batch_invariant": target.info.batch_invariant,
           "trace_tokens_per_round": round(statistics.mean(chain_tokens(h, k) for h in trace), 3),
           "forward_ms": costs, "measured": rows, "modeled": modeled(costs, list(sessions), trace, k),
           "command": command}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"forward_costs_{dev}.json").write_text(json.dumps(
        {k_: res[k_] for k_ in ("shape", "device", "machine", "date", "forward_path", "forward_ms", "command")},
        indent=1) + "\n")
    res["plot"] = str(plot(res, REPO / "bench" / "plots" / f"gpu_capacity_{dev}.png").relative_to(REPO))
    text = report(res)
    print(text)
    if out is not None and out.exists() and START in out.read_text():
        doc = out.read_text()
        out.write_text(doc[: doc.index(START) + len(START)] + "\n" + text + doc[doc.index(END):])
    return res


def plot(res: dict[str, Any], path: Path) -> Path:
    """Tokens per second against sessions: measured (both policies) and modeled (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k, m = res["k"], res["measured"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for pol, mark in (("cloud_only", "o"), (f"chain-{k}", "s")):
        pts = [(r["sessions"], r["tokens_per_s"]) for r in m if r["policy"] == pol]
        ax.plot(*zip(*pts, strict=True), marker=mark, label=f"{pol}, measured")
        model = [(r["sessions"], r[pol]) for r in res["modeled"]]
        if model:
            ax.plot(*zip(*model, strict=True), linestyle="--", marker=mark, alpha=0.5, label=f"{pol}, modeled")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sessions")
    ax.set_ylabel("tokens per second of the device")
    ax.set_title(f"{res['shape']} on {res['machine'].split(',')[0]}")
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(res: dict[str, Any]) -> str:
    k = res["k"]
    lines = [f"`{res['command']}` ({res['date']}; {res['machine']}; shape {res['shape']}, random weights, "
             f"forward path {res['forward_path']}, batch-invariant {res['batch_invariant']}; {res['tokens']} tokens a "
             f"session; drafts replay the coder pair's trace: {res['trace_tokens_per_round']} tokens a chain-{k} "
             "round)", "",
             "| sessions | cloud_only tokens/s | chain tokens/s | ratio | forwards (alone / chain) | p50 / p99 ms "
             "between tokens (alone) | (chain) | texts equal |", "|---|---|---|---|---|---|---|---|"]
    m = res["measured"]
    for a, s in zip(m[::2], m[1::2], strict=True):
        lines.append(f"| {a['sessions']} | {a['tokens_per_s']} | {s['tokens_per_s']} | "
                     f"{s['tokens_per_s'] / a['tokens_per_s']:.2f}x | {a['forwards']} / {s['forwards']} | "
                     f"{a['p50_ms']} / {a['p99_ms']} | {s['p50_ms']} / {s['p99_ms']} | {s['texts_equal']} |")
    if res["modeled"]:
        lines += ["", "Modeled from this run's forward costs (a model: one forward of every session a step, no "
                      "queueing, no host work):", "",
                  f"| sessions | cloud_only tokens/s | chain-{k} tokens/s | ratio |", "|---|---|---|---|"]
        lines += [f"| {r['sessions']} | {r['cloud_only']} | {r[f'chain-{k}']} | {r['ratio']}x |" for r in res["modeled"]]
    if res.get("plot"):
        lines += ["", f"![tokens per second by sessions]({res['plot']})"]
    return "\n".join(lines) + "\n"

"""From capacity runs to numbers, ratios and the BENCHMARKS.md section.

Definitions (one case = one arm, one mode, n concurrent sessions):
- tokens per cloud CPU-second = committed tokens / CPU time of the cloud process over the case:
  the tokens one fully busy cloud core turns out, whatever else ran on the machine;
- aggregate tokens/s = tokens / wall time of the case;
- per-session tokens/s = median over sessions of (its tokens / time from its first request to its
  last answer);
- round latency = one Verify call as the client timed it (speculative), or the gap between two
  streamed tokens, i.e. one decode step (cloud_only); p50 / p95 over every round of the case;
- mean batch size / tokens = sum / count of the cloud's `specsplit_cloud_batch_size` /
  `specsplit_cloud_batch_tokens` histograms over the case ("n/a" when the cloud has none).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.capacity import KV_POLL_S, CapacityResults, CapacityRun

MB = 1024**2


@dataclass
class CapacitySummary:
    arm: str
    mode: str
    sessions: int
    tokens: int
    wall_s: float
    cloud_cpu_s: float
    client_cpu_s: float
    tokens_per_cloud_cpu_s: float
    throughput: float
    per_session_tps: float
    round_p50_ms: float
    round_p95_ms: float
    rounds: int
    # None when the cloud exports no batch histograms
    mean_batch_size: float | None
    mean_batch_tokens: float | None
    # tokens a right-padded batch of the same rows would have run / the real tokens run (None: not exported)
    padded_over_real: float | None
    cloud_peak_rss: int
    cloud_start_rss: int
    # the KV gauge's largest read (0: the gauge does not see this load), and the load's computed demand
    kv_gauge_bytes: float
    kv_demand_bytes: int
    # answers compared with the recording, those that differed, texts that ended in an error
    checked: int
    mismatches: int
    errors: int


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else float("nan")


def per_session_tps(run: CapacityRun) -> float:
    """Median over sessions of tokens / (last answer - first request)."""
    spans: dict[int, list[float]] = defaultdict(lambda: [math.inf, -math.inf, 0.0])
    for t in run.text_runs():
        s = spans[t.session]
        s[0], s[1], s[2] = min(s[0], t.start_s), max(s[1], t.end_s), s[2] + t.tokens
    rates = [tok / (end - start) for start, end, tok in spans.values() if end > start]
    return float(np.median(rates)) if rates else float("nan")


def histogram_mean(counters: dict[str, float], name: str) -> float | None:
    """sum / count of a histogram's delta; None when the series is absent or saw nothing."""
    count = counters.get(f"{name}_count")
    if not count:
        return None
    return counters.get(f"{name}_sum", 0.0) / count


def summarise(run: CapacityRun) -> CapacitySummary:
    texts = run.text_runs()
    rounds = [ms for t in texts for ms in t.round_ms]
    return CapacitySummary(
        arm=run.arm, mode=run.mode, sessions=run.sessions, tokens=run.tokens, wall_s=run.wall_s,
        cloud_cpu_s=run.cloud_cpu_s, client_cpu_s=run.client_cpu_s,
        tokens_per_cloud_cpu_s=run.tokens / run.cloud_cpu_s if run.cloud_cpu_s > 0 else float("nan"),
        throughput=run.tokens / run.wall_s if run.wall_s > 0 else float("nan"),
        per_session_tps=per_session_tps(run), round_p50_ms=percentile(rounds, 50),
        round_p95_ms=percentile(rounds, 95), rounds=len(rounds),
        mean_batch_size=histogram_mean(run.counters, "specsplit_cloud_batch_size"),
        mean_batch_tokens=histogram_mean(run.counters, "specsplit_cloud_batch_tokens"),
        padded_over_real=_div(run.counters.get("specsplit_cloud_padded_equivalent_tokens_total"),
                              run.counters.get("specsplit_cloud_batch_tokens_sum")),
        cloud_peak_rss=run.cloud_peak_rss, cloud_start_rss=run.cloud_start_rss, kv_gauge_bytes=run.kv_peak_bytes, kv_demand_bytes=run.kv_demand_bytes,
        checked=sum(t.checked for t in texts), mismatches=sum(t.mismatches for t in texts),
        errors=sum(t.error is not None for t in texts))


@dataclass
class Ratio:
    # what is divided by what, in words
    what: str
    # the measured ratio (None when a case is missing or a denominator is zero)
    value: float | None
    # the aim, e.g. ">= 3x"
    aim: str


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def ratios(res: CapacityResults) -> list[Ratio]:
    """The ratios the issue sets aims for, read at the plan's reference session count."""
    by = {(s.arm, s.mode, s.sessions): s for s in map(summarise, res.runs)}
    batched, single = res.plan.arms[0][0], res.plan.arms[1][0]
    ref, low = res.plan.ref_level, min(res.plan.levels)

    def get(arm: str, mode: str, n: int, metric: str) -> float | None:
        s = by.get((arm, mode, n))
        v = None if s is None else getattr(s, metric)
        return None if v is None else float(v)

    tpc = "tokens_per_cloud_cpu_s"
    return [
        Ratio(f"speculative, {batched} / {single}: tokens per cloud CPU-s at {ref} sessions",
              _div(get(batched, "speculative", ref, tpc), get(single, "speculative", ref, tpc)), ">= 2.5x"),
        Ratio(f"{batched}: speculative / cloud_only tokens per cloud CPU-s at {ref} sessions",
              _div(get(batched, "speculative", ref, tpc), get(batched, "cloud_only", ref, tpc)), ">= 1.5x"),
        Ratio(f"speculative, {batched}: p50 round latency at {ref} sessions / at {low}",
              _div(get(batched, "speculative", ref, "round_p50_ms"), get(batched, "speculative", low, "round_p50_ms")),
              "<= 2x"),
        Ratio(f"for comparison, speculative, {single}: p50 round latency at {ref} sessions / at {low}",
              _div(get(single, "speculative", ref, "round_p50_ms"), get(single, "speculative", low, "round_p50_ms")),
              "–"),
        Ratio(f"cloud_only, {batched} / {single}: tokens per cloud CPU-s at {ref} sessions",
              _div(get(batched, "cloud_only", ref, tpc), get(single, "cloud_only", ref, tpc)), "–"),
        Ratio(f"speculative, {batched}: tokens a right-padded batch would have run / real tokens at {ref} sessions",
              get(batched, "speculative", ref, "padded_over_real"), "– (the padding avoided)"),
    ]


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return f"{x:,.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def ratio_rows(res: CapacityResults) -> list[list[str]]:
    return [[r.what, "n/a" if r.value is None else f"{r.value:.2f}x", r.aim] for r in ratios(res)]


def case_rows(res: CapacityResults) -> list[list[str]]:
    rows = []
    for s in map(summarise, res.runs):
        rows.append([s.arm, s.mode, str(s.sessions), str(s.tokens), fmt(s.tokens_per_cloud_cpu_s),
                     fmt(s.throughput), fmt(s.per_session_tps), fmt(s.round_p50_ms), fmt(s.round_p95_ms),
                     fmt(s.mean_batch_size, 2), fmt(s.mean_batch_tokens, 1), fmt(s.padded_over_real, 2), f"{fmt(s.cloud_peak_rss / MB, 0)} ({fmt(s.cloud_start_rss / MB, 0)})",
                     fmt(s.kv_gauge_bytes / 1024, 0) if s.kv_gauge_bytes else "–", fmt(s.kv_demand_bytes / 1024, 0),
                     f"{s.mismatches} / {s.checked}", str(s.errors), fmt(s.client_cpu_s, 2), fmt(s.cloud_cpu_s, 2)])
    return rows


CASE_HEADER = ["arm", "mode", "sessions", "tokens", "tokens / cloud CPU-s", "aggregate tokens/s",
               "per-session tokens/s", "round p50 ms", "round p95 ms", "mean batch size", "mean batch tokens",
               "padded / real tokens", "cloud peak RSS MiB (at start)", "KV gauge peak KiB", "KV demand KiB", "answers ≠ recording", "errors", "load generator CPU-s",
               "cloud CPU-s"]


def heading(res: CapacityResults) -> str:
    p = res.plan
    if p.section_id == "cpu":
        return "## Cloud capacity: CPU"
    return f"## Cloud capacity: GPU ({p.device}, {p.dtype})"


def section(res: CapacityResults) -> list[str]:
    p, n = res.plan, res.notes
    m = n["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    arms = "; ".join(f"**{name}**: `{flags or '(no flags)'}`" for name, flags in p.arms)
    where = f"{m['cpu_model']}, {m['cpus']} logical CPUs" + (f"; GPU {n['gpu']}" if n.get("gpu") else "")
    return [
        heading(res), "",
        f"Generated by `{n['command']}` on {n['started']} in {res.total_s:.0f} s; {where}; load average "
        f"{m['load_avg_1m']:.2f} at start; {versions}. Cloud: `specsplit-cloud --model {n['target']} --device "
        f"{p.device} --torch-threads 1 {n['cloud_args']}` plus the arm's flags ({arms}); one cloud process per "
        "arm (both start together; the one not measured waits idle), the cases of an arm one after another "
        "against it.", "",
        *(["**The batching arm ran without `--max-batch-size`**: the two arms ran the same code, so their "
           "ratios show only the noise of this machine.", ""] if "--max-batch-size" not in p.arms[0][1] else []),
        "The edges are taken out: one asyncio process (bench/loadgen.py) replays recorded greedy speculative "
        f"traffic of the real edge ({len(n['trace_names'])} traces: the draft model and the n-gram drafter, dynamic "
        f"k, on the bench prompts; {n['traces']}): each speculative session opens a session over gRPC, sends the "
        "trace's Verify requests in order, the next one as soon as the answer is in, and closes; each cloud_only "
        "session streams the same text from `POST /v1/generate` (server-sent events; gRPC has no generate call). "
        "In a case with n sessions every session replays the same number of texts (at least 2), one from each "
        f"drafter's traces in turn, each cut after the round reaching {p.max_tokens} tokens, so all n sessions stay "
        "busy to the end and the case covers every trace. Every answer is "
        "compared with the recording (greedy answers do not depend on who shares a forward): *answers ≠ "
        "recording* counts rounds (speculative) or texts (cloud_only) that differ.", "",
        "Tokens per cloud CPU-s = tokens / CPU time of the cloud process (what one fully busy core turns out); "
        "aggregate tokens/s = tokens / wall time; per-session tokens/s = median over sessions; round latency = "
        "one Verify call (speculative) or the gap between two streamed tokens, one decode step (cloud_only); "
        "mean batch size / tokens from the cloud's `specsplit_cloud_batch_size` / `specsplit_cloud_batch_tokens` "
        "histograms (n/a: the cloud exports none); RSS = VmHWM of the cloud, reset per case (in brackets its RSS when the case began: memory the allocator kept from earlier cases counts in the peak); KV gauge peak = "
        f"largest `specsplit_cloud_kv_bytes` polled every {1000 * KV_POLL_S:g} ms (– : the gauge does not see "
        "/v1/generate's cache); KV demand = bytes per position "
        f"({n['kv_per_position']} B) x the largest number of positions the running texts held at once "
        "(computed by the load generator).", "",
        *table(["ratio (this run)", "measured", "aim"], ratio_rows(res)), "",
        *table(CASE_HEADER, case_rows(res)), "",
        *serving_lines(res),
    ]



def stop_at(mem: dict[str, Any]) -> str:
    """Where the memory case stopped: the first eviction, or the first 429 (sessions just opened are never
    evicted, so a full pool refuses instead)."""
    if mem.get("first_refusal_at"):
        return f"first 429 (at session {mem['first_refusal_at']}: full, nothing it may evict)"
    return f"first eviction (at session {mem['first_eviction_at']})"

def serving_lines(res: CapacityResults) -> list[str]:
    """The serving-core cases (bench/serving.py), when this run has them."""
    sv = res.serving
    if not sv:
        return []
    mem, pre, hol = sv["memory"], sv["prefix"], sv["head_of_line"]
    lines = [
        "### Serving core: memory, prefix sharing, head-of-line", "",
        "Each case runs its own `specsplit-cloud` (REST, one torch thread) and reads only what a user could: "
        "/metrics, the process's CPU time, answer latencies (bench/serving.py).", "",
        *table(["case", "measured", "aim"], [
            [f"memory: tiny long-context Llama ({mem['bytes_per_position']} B of KV per position), "
             f"`--kv-budget-bytes {mem['budget_bytes']}`: one 3,000-token session, then 60-token sessions until the "
             f"{stop_at(mem)}; largest `specsplit_cloud_kv_pool_bytes`",
             f"{mem['kv_pool_peak_bytes'] / MB:.2f} MiB ({mem['kv_pool_peak_bytes'] / mem['budget_bytes']:.2f}x the "
             "budget)", "<= 1x"],
            ["memory: most positions held by open sessions at once x bytes per position / budget",
             f"{mem['usable_share']:.1%} ({mem['most_positions_held']:,} positions)", ">= 90 %"],
            ["memory: with the 3,000-token session and 100 of 60 tokens open: pool / sessions' KV",
             f"{mem['after_101_sessions']['kv_pool_bytes'] / MB:.2f} MiB / "
             f"{mem['after_101_sessions']['sessions_kv_bytes'] / MB:.2f} MiB", "–"],
            [f"prefix sharing: cloud CPU-s to open {pre['sessions']} sessions of {pre['prompt_tokens']}-token prompts, "
             f"distinct / sharing their first {pre['shared_tokens']} tokens",
             f"{pre['distinct']['cloud_cpu_s']:.2f} / {pre['shared']['cloud_cpu_s']:.2f} s = {pre['cpu_ratio']:.1f}x "
             f"({pre['shared']['prefix_hit_tokens']:,.0f} positions from the cache)", ">= 4x"],
            *[[f"head-of-line, `--max-batch-tokens {h['max_batch_tokens']}`, `--max-prefill-tokens-with-rounds "
               f"{h.get('prefill_share') or 'default'}`: p50 latency of a session's k = 4 rounds while {h['opens']} "
               f"511-token opens arrive / idle (the opens took {h.get('burst_s', float('nan')):.1f} s)",
               f"{h['busy_p50_ms']:.1f} / {h['idle_p50_ms']:.1f} ms = {h['ratio_p50']:.1f}x (max {h['busy_max_ms']:.0f} "
               f"ms over {h['busy_rounds']} rounds)", "<= 3x"] for h in hol],
        ]), "",
    ]
    return lines


def splice(text: str, lines: list[str], head: str) -> str:
    """`text` with the section starting at the line `head` replaced by `lines` (up to the next `## `
    heading or the closing 'Raw measurements' line), or inserted before `## Noise` / at the end."""
    old = text.splitlines()
    new = [*lines]
    if head in old:
        i = old.index(head)
        j = i + 1
        while j < len(old) and not old[j].startswith("## ") and not old[j].startswith("Raw measurements"):
            j += 1
        return "\n".join(old[:i] + new + old[j:]) + "\n"
    for marker in ("## Noise", "Raw measurements"):
        at = next((i for i, line in enumerate(old) if line.startswith(marker)), None)
        if at is not None:
            return "\n".join(old[:at] + new + old[at:]) + "\n"
    return "\n".join([*old, *([""] if old and old[-1] else []), *new]) + "\n"


def write_into(res: CapacityResults, out: Path) -> Path:
    """Put this run's section into `out` (a new file holds just a title and the section)."""
    text = out.read_text() if out.exists() else "# Benchmarks\n\n"
    out.write_text(splice(text, section(res), heading(res)))
    return out


def console_lines(res: CapacityResults) -> list[str]:
    return [*table(["ratio (this run)", "measured", "aim"], ratio_rows(res)), "",
            *table(CASE_HEADER[:11] + ["answers ≠ recording", "errors"],
                   [r[:11] + r[15:17] for r in case_rows(res)]), "", *serving_lines(res)]


def store_raw(res: CapacityResults, path: Path) -> Path:
    """Put this run under `capacity.<section id>` of the results JSON at `path` (made if missing)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("capacity", {})[res.plan.section_id] = res.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return path


def load_raw(data: dict[str, Any]) -> list[CapacityResults]:
    """Every capacity run stored in a results JSON (none when it has none)."""
    return [CapacityResults.from_json(d) for d in data.get("capacity", {}).values()]

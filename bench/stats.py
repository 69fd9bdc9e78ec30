"""From raw case runs to the numbers of the report.

Timing numbers (TTFT, totals, tokens/s, draft time, speedups, RSS, CPU) are computed per repeat
and reported as the median with the min-max over repeats: they are the noisy ones. Counting
numbers (acceptance, forwards, calls, bytes) come from fixed seeds and a fixed prompt set, so they
are the same in every repeat; `deterministic` says whether that held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import numpy as np

from bench.plan import Case
from bench.runner import CaseRun, RunResults
from bench.theory import (
    estimate_acceptance,
    predicted_speedup,
    predicted_speedup_end_to_end,
    predicted_tokens_per_round,
)

# the timing metrics whose spread over repeats the report gives
TIMING = ("ttft_p50", "ttft_p95", "total_p50", "total_p95", "otps", "throughput", "speedup",
          "tokens_per_cloud_cpu_s", "t_draft_ms", "verify_ms", "exchange_ms")
# round row columns (bench.edge_worker.round_rows)
K, LA, KIND, BY, EDGE_MS, PREFILL_MS, RTT_MS = range(7)


@dataclass
class Stat:
    # median over repeats, and the smallest / largest repeat
    mid: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        vals = [float(v) for v in values]
        if not vals:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(median(vals), min(vals), max(vals), len(vals))

    @property
    def spread(self) -> float:
        """(max - min) / median: the relative noise over repeats."""
        return (self.hi - self.lo) / abs(self.mid) if self.n > 1 and self.mid else 0.0


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


@dataclass
class Acceptance:
    # verified rounds and their (k, La)
    rounds: int
    # a: per-position acceptance (accepted / checked), theory.estimate_acceptance
    a: float
    # accepted / drafted over verified rounds (what the edge reports as acceptance rate)
    rate: float
    # mean La per verified round
    mean_accepted: float
    # measured tokens per verified round (mean La + 1) and what (1 - a^(k+1)) / (1 - a) predicts
    tokens_per_round: float
    predicted_tokens_per_round: float
    # mean k of verified rounds
    mean_k: float
    # histogram of La per k: {k: {La: rounds}}
    histogram: dict[int, dict[int, int]] = field(default_factory=dict)


def acceptance(gens: list[dict[str, Any]]) -> Acceptance | None:
    pairs = [(int(r[K]), int(r[LA])) for g in gens for r in g["rounds"] if r[BY] == "cloud"]
    if not pairs:
        return None
    ks = [k for k, _ in pairs]
    a = estimate_acceptance(pairs)
    drafted = sum(ks)
    return Acceptance(rounds=len(pairs), a=a, rate=sum(la for _, la in pairs) / drafted if drafted else 0.0,
                      mean_accepted=sum(la for _, la in pairs) / len(pairs),
                      tokens_per_round=sum(la + 1 for _, la in pairs) / len(pairs),
                      predicted_tokens_per_round=predicted_tokens_per_round(a, ks), mean_k=drafted / len(pairs),
                      histogram={k: dict(sorted(Counter(la for kk, la in pairs if kk == k).items()))
                                 for k in sorted(set(ks))})


@dataclass
class CaseSummary:
    case: Case
    repeats: int
    generations: int
    # output tokens of one repeat (all sessions)
    tokens: int
    ttft_p50: Stat
    ttft_p95: Stat
    total_p50: Stat
    total_p95: Stat
    # tokens / summed generation time (one client's speed)
    otps: Stat
    # tokens / wall time of the whole job (all sessions together)
    throughput: Stat
    # tokens per CPU-second of the cloud process = tokens/s per fully busy cloud core
    tokens_per_cloud_cpu_s: Stat
    # cloud CPU-seconds per wall second (cores kept busy)
    cloud_cores_busy: Stat
    # target forwards (verify rounds + generate steps + session prefills) per output token
    forwards_per_token: float
    # cloud requests per output token (every attempt) and its inverse
    calls_per_token: float
    tokens_per_call: float
    # payload bytes (JSON bodies) per output token, and on the wire through the proxy (headers too)
    bytes_up_per_token: float
    bytes_down_per_token: float
    wire_up_per_token: float | None
    wire_down_per_token: float | None
    edge_peak_rss: Stat
    cloud_peak_rss: Stat
    # KV cache peak bytes: polled from the cloud (sessions), or computed for target-only generation
    kv_peak_bytes: float
    kv_computed: bool
    # draft time per drafted token (ms)
    t_draft_ms: Stat
    acc: Acceptance | None
    # mean over verified rounds: the cloud's verify forward as it reports it (k + 1 positions and
    # more) and the whole verify exchange as the edge timed it (forward + HTTP + queue + network), ms
    verify_ms: Stat
    exchange_ms: Stat
    # same token ids in every repeat
    deterministic: bool
    # generations whose ids equal the target-only greedy output of the same prompt (greedy only)
    greedy_matches: tuple[int, int] | None = None
    # filled by `compare`: speedup over the cloud_only case, the ideal bound, their ratio
    speedup: Stat | None = None
    bound: float | None = None
    bound_ratio: Stat | None = None
    # the same for whole generations: prefill and the session's open / close round trips included
    bound_e2e: float | None = None
    bound_e2e_ratio: Stat | None = None
    # the RTT used in the bounds (ms, GET /healthz p50 of the path) and c = t_draft / t_target
    rtt_used_ms: float | None = None
    c: float | None = None


def _per_repeat(runs: list[CaseRun], fn: Callable[[CaseRun], float]) -> Stat:
    return Stat.of([fn(r) for r in runs])


def round_mean(gens: list[dict[str, Any]], column: int) -> float | None:
    """Mean of one round-row column over verified rounds; None when there are none."""
    vals = [float(r[column]) for g in gens for r in g["rounds"] if r[BY] == "cloud"]
    return sum(vals) / len(vals) if vals else None


def draft_ms_per_token(gens: list[dict[str, Any]]) -> float:
    """Edge drafting time per drafted token: verified drafts, or local tokens in edge_only."""
    ms = sum(g["metrics"]["edge_time_ms"] for g in gens)
    n = sum(g["metrics"]["drafted"] or g["metrics"]["local_commits"] for g in gens)
    return ms / n if n else float("nan")


def summarise(case: Case, runs: list[CaseRun], kv_per_token: int) -> CaseSummary:
    first = runs[0]
    gens = first.generations
    tokens = sum(g["metrics"]["emitted"] for g in gens)
    m = [g["metrics"] for g in gens]

    def tot(name: str) -> float:
        return float(sum(x[name] for x in m))

    cc = first.cloud_counters
    opens = (len(gens) + tot("reopens")) if case.mode == "speculative" else 0.0
    forwards = cc["specsplit_cloud_rounds_total"] + cc["specsplit_cloud_generated_tokens_total"] + opens
    per_tok = 1.0 / tokens if tokens else 0.0
    kv_computed = case.mode == "cloud_only"
    if kv_computed:  # /v1/generate keeps its cache outside the sessions the gauge counts
        kv_peak = float(kv_per_token * max((g["prompt_len"] + g["metrics"]["emitted"]) for g in gens) * case.sessions)
    else:
        kv_peak = max(r.kv_peak_bytes for r in runs)
    ids = [[tuple(g["token_ids"]) for g in r.generations] for r in runs]
    draft_ms = Stat.of([draft_ms_per_token(r.generations) for r in runs])
    return CaseSummary(
        case=case, repeats=len(runs), generations=len(gens), tokens=tokens,
        ttft_p50=_per_repeat(runs, lambda r: pct([g["metrics"]["ttft_ms"] for g in r.generations], 50)),
        ttft_p95=_per_repeat(runs, lambda r: pct([g["metrics"]["ttft_ms"] for g in r.generations], 95)),
        total_p50=_per_repeat(runs, lambda r: pct([g["metrics"]["wall_ms"] for g in r.generations], 50)),
        total_p95=_per_repeat(runs, lambda r: pct([g["metrics"]["wall_ms"] for g in r.generations], 95)),
        otps=_per_repeat(runs, lambda r: tokens / (sum(g["metrics"]["wall_ms"] for g in r.generations) / 1000)),
        throughput=_per_repeat(runs, lambda r: tokens / (r.wall_ms / 1000)),
        tokens_per_cloud_cpu_s=(Stat.of([]) if case.mode == "edge_only" else  # the cloud only idles
                                _per_repeat(runs, lambda r: tokens / r.cloud_cpu_s if r.cloud_cpu_s else 0.0)),
        cloud_cores_busy=_per_repeat(runs, lambda r: r.cloud_cpu_s / (r.wall_ms / 1000)),
        forwards_per_token=forwards * per_tok, calls_per_token=tot("cloud_calls") * per_tok,
        tokens_per_call=tokens / tot("cloud_calls") if tot("cloud_calls") else 0.0,
        bytes_up_per_token=tot("bytes_up") * per_tok, bytes_down_per_token=tot("bytes_down") * per_tok,
        wire_up_per_token=first.wire_up * per_tok if case.rtt_ms > 0 else None,
        wire_down_per_token=first.wire_down * per_tok if case.rtt_ms > 0 else None,
        edge_peak_rss=_per_repeat(runs, lambda r: r.edge_peak_rss),
        cloud_peak_rss=_per_repeat(runs, lambda r: r.cloud_peak_rss),
        kv_peak_bytes=kv_peak, kv_computed=kv_computed,
        t_draft_ms=draft_ms if case.mode != "cloud_only" else Stat.of([]),
        acc=acceptance(gens) if case.mode == "speculative" else None,
        verify_ms=Stat.of([v for v in (round_mean(r.generations, PREFILL_MS) for r in runs) if v is not None]),
        exchange_ms=Stat.of([v for v in (round_mean(r.generations, RTT_MS) for r in runs) if v is not None]),
        deterministic=all(x == ids[0] for x in ids))


def compare(s: CaseSummary, base: CaseSummary | None, base_runs: list[CaseRun], runs: list[CaseRun],
            t_target_ms: float, rtt_ms: float, prefill_ms: list[float]) -> None:
    """Speedup over the cloud_only case (pairing repeats), the ideal bound, and their ratio."""
    if base is None or s.case.mode == "cloud_only":
        return
    base_otps = {r.repeat: base.tokens / (sum(g["metrics"]["wall_ms"] for g in r.generations) / 1000)
                 for r in base_runs}
    use = "throughput" if s.case.sessions > 1 else "otps"
    if use == "throughput":
        base_otps = {r.repeat: base.tokens / (r.wall_ms / 1000) for r in base_runs}
    fallback = median(base_otps.values())
    # pair repeat r with the baseline's repeat r (run in the same pass, under the same load) when both
    # have every repeat; a case with fewer repeats (the k sweep) is compared with the baseline's median
    paired = len(runs) == len(base_runs)
    speedups = []
    for r in runs:
        mine = (s.tokens / (r.wall_ms / 1000) if use == "throughput"
                else s.tokens / (sum(g["metrics"]["wall_ms"] for g in r.generations) / 1000))
        speedups.append(mine / (base_otps.get(r.repeat, fallback) if paired else fallback))
    s.speedup = Stat.of(speedups)
    if s.acc is None:
        return
    ks = [int(x[K]) for g in runs[0].generations for x in g["rounds"] if x[BY] == "cloud"]
    s.c = s.t_draft_ms.mid / t_target_ms
    s.rtt_used_ms = rtt_ms
    s.bound = predicted_speedup(s.acc.a, ks, s.t_draft_ms.mid, t_target_ms, rtt_ms)
    s.bound_ratio = Stat.of([v / s.bound for v in speedups]) if s.bound else None
    gens = runs[0].generations
    if s.case.sessions == 1 and gens and all(g.get("prompt") is not None for g in gens):
        p_ms = sum(prefill_ms[g["prompt"]] for g in gens) / len(gens)
        s.bound_e2e = predicted_speedup_end_to_end(s.acc.a, ks, s.t_draft_ms.mid, t_target_ms, rtt_ms, p_ms,
                                                   s.tokens / len(gens))
        s.bound_e2e_ratio = Stat.of([v / s.bound_e2e for v in speedups]) if s.bound_e2e else None


def greedy_check(s: CaseSummary, runs: list[CaseRun], base_runs: list[CaseRun]) -> None:
    """Greedy speculative output must equal target-only greedy output, prompt by prompt."""
    if s.case.sampling != "greedy" or s.case.mode != "speculative" or not base_runs:
        return
    ref = {(g["session"], g["index"]): g["token_ids"] for g in base_runs[0].generations}
    mine = runs[0].generations
    s.greedy_matches = (sum(ref.get((g["session"], g["index"])) == g["token_ids"] for g in mine), len(mine))


@dataclass
class Analysis:
    results: RunResults
    summaries: dict[str, CaseSummary]

    def get(self, case: Case) -> CaseSummary | None:
        return self.summaries.get(case.key)

    def spreads(self) -> dict[str, list[tuple[float, str]]]:
        """Per timing metric: (relative min-max spread, case) of every case with two or more repeats."""
        out: dict[str, list[tuple[float, str]]] = {}
        for s in self.summaries.values():
            for name in TIMING:
                st = getattr(s, name)
                if isinstance(st, Stat) and st.n > 1:
                    out.setdefault(name, []).append((st.spread, f"{s.case.part}: {s.case.label} {s.case.sampling} "
                                                                 f"rtt {s.case.rtt_ms:g} x{s.case.sessions}"))
        return out

    def noisy(self, threshold: float = 0.10) -> list[tuple[str, str, Stat]]:
        """(case label, metric, stat) whose min-max spread over repeats exceeds `threshold` of the median."""
        out = []
        for s in self.summaries.values():
            for name in TIMING:
                st = getattr(s, name)
                if isinstance(st, Stat) and st.n > 1 and st.spread > threshold:
                    out.append((f"{s.case.part}: {s.case.label} {s.case.sampling} rtt {s.case.rtt_ms:g} "
                                f"x{s.case.sessions}", name, st))
        return out


def rtt_of(results: RunResults, rtt: float) -> float:
    pings = results.calibration.ping_ms["direct" if rtt <= 0 else f"rtt{rtt:g}"]
    return float(median(pings))


def analyse(results: RunResults) -> Analysis:
    cases = {c.key: c for c in results.plan.cases}
    by_key: dict[str, list[CaseRun]] = {}
    for r in results.runs:
        by_key.setdefault(r.key, []).append(r)
    kvpt = results.calibration.kv_bytes_per_token
    summaries = {k: summarise(cases[k], runs, kvpt) for k, runs in by_key.items()}
    for k, s in summaries.items():
        base_key = s.case.baseline_key()
        base_runs = by_key.get(base_key, [])
        t_target = median(results.calibration.t_target_ms[s.case.sampling])
        compare(s, summaries.get(base_key), base_runs, by_key[k], t_target, rtt_of(results, s.case.rtt_ms),
                results.calibration.prefill_ms)
        greedy_check(s, by_key[k], base_runs)
    return Analysis(results, summaries)

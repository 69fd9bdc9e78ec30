"""The network section of BENCHMARKS.md (`specsplit-bench --only network`): speculation over a round
trip of 0 / 10 / 50 / 100 ms with the dynamic k, the best fixed k of a sweep, and the cost-model k
with and without drafting while the cloud verifies. Spliced into the report like the capacity section.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.capacity_report import splice
from bench.plan import Case
from bench.report import fmt, table
from bench.stats import Analysis, CaseSummary

HEADING = "## Speculation over real links"
# round-row columns (bench.edge_worker.round_rows)
EDGE_MS, BY, AHEAD, SAVED = 4, 3, 7, 9


def _rounds(an: Analysis, case: Case) -> list[list[Any]]:
    return [r for run in an.results.runs if run.key == case.key for g in run.generations for r in g["rounds"]
            if r[BY] == "cloud"]


def _speed(s: CaseSummary | None) -> float | None:
    return None if s is None or s.speedup is None else s.speedup.mid


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def ahead_stats(an: Analysis, case: Case) -> dict[str, float | None]:
    """Hit rate of the guess and mean critical-path drafting ms per round: rounds whose block was ready
    from drafting ahead ("hit") and the others."""
    rows = _rounds(an, case)
    tried = [r for r in rows if len(r) > AHEAD and r[AHEAD] in ("hit", "miss")]
    hit = [float(r[EDGE_MS]) for r in tried if r[AHEAD] == "hit"]
    saved = [float(r[SAVED]) for r in tried if r[AHEAD] == "hit"]
    other = [float(r[EDGE_MS]) for r in rows if len(r) <= AHEAD or r[AHEAD] != "hit"]
    # a held guess's round: drafting left on the critical path vs that plus what drafting ahead took off it
    cut = sum(saved) / (sum(hit) + sum(saved)) if hit and sum(hit) + sum(saved) > 0 else None
    return {"hit_rate": len(hit) / len(tried) if tried else None, "hits": float(len(hit)),
            "edge_ms_hit": sum(hit) / len(hit) if hit else None,
            "edge_ms_other": sum(other) / len(other) if other else None, "cut": cut}


def mean_edge_ms(an: Analysis, case: Case) -> float | None:
    rows = _rounds(an, case)
    return sum(float(r[EDGE_MS]) for r in rows) / len(rows) if rows else None


def rows(an: Analysis) -> list[dict[str, Any]]:
    """One row per (sampling, drafter, RTT) with the speedups over cloud_only of each controller."""
    cases = [c for c in an.results.plan.cases if c.part == "net" and c.mode == "speculative"]
    out = []
    seen: set[tuple[str, str, float]] = set()
    for c in cases:
        key = (c.sampling, str(c.drafter), c.rtt_ms)
        if key in seen:
            continue
        seen.add(key)
        same = [x for x in cases if (x.sampling, str(x.drafter), x.rtt_ms) == key]
        fixed: list[tuple[int, float]] = []
        for x in same:
            v = _speed(an.get(x))
            if x.fixed_k is not None and v is not None:
                fixed.append((x.fixed_k, v))
        best_k, best = max(fixed, key=lambda kv: kv[1]) if fixed else (None, None)
        dyn = next((x for x in same if x.fixed_k is None and x.k_policy == "dynamic"), None)
        cost = next((x for x in same if x.fixed_k is None and x.k_policy == "cost" and not x.draft_ahead), None)
        ahead = next((x for x in same if x.fixed_k is None and x.k_policy == "cost" and x.draft_ahead), None)
        cost_s = an.get(cost) if cost else None
        row = {"sampling": c.sampling, "drafter": c.drafter, "rtt": c.rtt_ms,
               "dynamic": _speed(an.get(dyn)) if dyn else None, "best_fixed": best, "best_k": best_k,
               "cost": _speed(cost_s), "cost_k": cost_s.acc.mean_k if cost_s and cost_s.acc else None,
               "ahead": _speed(an.get(ahead)) if ahead else None}
        if ahead is not None:
            row.update(ahead_stats(an, ahead))
            row["edge_ms_no_ahead"] = mean_edge_ms(an, cost) if cost else None
        out.append(row)
    return out


def section(an: Analysis, command: str, total_s: float) -> list[str]:
    r = an.results
    m = r.machine
    body = []
    for x in rows(an):
        best_ctl = max((v for v in (x["cost"], x["ahead"]) if v is not None), default=None)
        vs_best = (f"{100 * best_ctl / x['best_fixed']:.0f} %" if best_ctl and x["best_fixed"] else "–")
        saved = "–" if x.get("cut") is None else f"{100 * x['cut']:.0f} % ({x['hits']:.0f} rounds)"
        body.append([x["sampling"], str(x["drafter"]), f"{x['rtt']:g}", _x(x["dynamic"]),
                     f"{_x(x['best_fixed'])} (k={x['best_k']})" if x["best_k"] is not None else "–",
                     _x(x["cost"]), fmt(x["cost_k"], 1) if x["cost_k"] is not None else "–", _x(x["ahead"]),
                     vs_best,
                     "–" if x.get("hit_rate") is None else f"{100 * x['hit_rate']:.0f} %",
                     "–" if x.get("edge_ms_hit") is None else
                     f"{x['edge_ms_hit']:.1f} / {fmt(x.get('edge_ms_no_ahead'), 1)}", saved])
    base = {c.key: an.get(c) for c in r.plan.cases if c.part == "net" and c.mode == "cloud_only"}
    cloud = [[c.sampling, f"{c.rtt_ms:g}", fmt(s.otps.mid, 1)] for c in r.plan.cases
             if c.part == "net" and c.mode == "cloud_only" and (s := base.get(c.key)) is not None]
    speeds = [float(row[2].replace(",", "")) for row in cloud if row[2] != "–"]
    spread = (f" Over this run cloud_only's own speed ranged from {min(speeds):.1f} to {max(speeds):.1f} tokens/s "
              f"(table at the end); one round trip per text of {r.plan.max_new_tokens} tokens explains little of that, "
              "the machine's load the rest, so ratios taken at different moments carry that noise."
              if speeds else "")
    return [
        HEADING, "",
        f"Generated by `{command}` on {r.started} in {total_s:.0f} s; {m.cpu_model}, {m.cpus} logical CPUs, "
        f"load average {m.load_avg_1m:.2f} at start. The machine is shared with other jobs and loaded: the "
        "ratios come from one run each and move by several per cent between runs. Target and draft: "
        f"`{r.notes.get('target', '?')}` / `{r.notes.get('draft', '?')}`; {r.plan.max_new_tokens} new tokens "
        f"per text, {len(r.prompts)} prompts, one repeat. The round trip is injected by the delay proxy "
        "(bench/delay_proxy.py) between the edge and the cloud, which run on the same two cores (the worker "
        "drafting ahead competes with the cloud's forward for them, which a real device would not)." + spread, "",
        "Speedup = output tokens per second over cloud_only's at the same round trip and sampling "
        "(cloud_only streams all tokens of a text from one request). *best fixed* is the fastest of the "
        "fixed-k sweep; *cost k* is the cost-model controller (mean k it chose), *+ ahead* the same with the "
        "model drafter drafting while the cloud verifies; *vs best* = the better controller over the best "
        "fixed k. *hit* = rounds whose guess (all drafts accepted, the draft's own next token) held, among "
        "rounds that drafted ahead; *draft ms* = critical-path drafting per round (the wait for the worker "
        "included), rounds that took a ready block / all rounds of the cost-model k without drafting ahead; "
        "*cut* = in rounds whose guess held, the share of their drafting that was done while the cloud "
        "verified: saved / (saved + drafting left on the critical path).", "",
        *table(["sampling", "drafter", "RTT ms", "dynamic k", "best fixed", "cost k", "mean k", "cost k + ahead",
                "vs best", "hit", "draft ms hit / without", "cut"], body), "",
        "cloud_only tokens per second at each round trip:", "",
        *table(["sampling", "RTT ms", "tokens/s"], cloud), "",
    ]


def write_into(an: Analysis, out: Path, command: str, total_s: float) -> Path:
    text = out.read_text() if out.exists() else "# Benchmarks\n\n"
    out.write_text(splice(text, section(an, command, total_s), HEADING))
    return out


def store_raw(an: Analysis, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(an.results.to_json(), separators=(",", ":")) + "\n")
    return path

"""Statistics over repeats: medians with min-max, acceptance from round rows, speedups paired by repeat."""

from __future__ import annotations

from typing import Any

import pytest

from bench.plan import Case
from bench.runner import CaseRun
from bench.stats import Stat, acceptance, compare, greedy_check, summarise


def gen(tokens: list[int], wall_ms: float, rounds: list[tuple[int, int]], index: int = 0) -> dict[str, Any]:
    drafted = sum(k for k, _ in rounds)
    metrics = {"emitted": len(tokens), "ttft_ms": wall_ms / 4, "wall_ms": wall_ms, "cloud_calls": len(rounds) + 2,
               "verify_calls": len(rounds), "reopens": 0, "bytes_up": 100, "bytes_down": 50,
               "edge_time_ms": drafted * 2.0, "drafted": drafted, "local_commits": 0}
    return {"session": 0, "index": index, "prompt": index, "prompt_len": 10, "token_ids": tokens,
            "metrics": metrics, "rounds": [[k, la, "correction", "cloud", 2.0 * k, 5.0, 8.0] for k, la in rounds],
            "start_ms": 0.0, "end_ms": wall_ms}


def run(key: str, repeat: int, gens: list[dict[str, Any]], rounds: int = 0, generated: int = 0) -> CaseRun:
    return CaseRun(key=key, repeat=repeat, wall_ms=sum(g["metrics"]["wall_ms"] for g in gens), edge_peak_rss=1,
                   edge_cpu_s=0.1, cloud_peak_rss=1000, cloud_cpu_s=0.5, kv_peak_bytes=10.0, kv_polls=3,
                   cloud_counters={"specsplit_cloud_rounds_total": rounds,
                                   "specsplit_cloud_generated_tokens_total": generated},
                   wire_up=0, wire_down=0, generations=gens)


def test_stat_reports_median_and_range() -> None:
    s = Stat.of([3.0, 1.0, 2.0])
    assert (s.mid, s.lo, s.hi, s.n) == (2.0, 1.0, 3.0, 3)
    assert s.spread == pytest.approx(1.0)
    assert Stat.of([5.0]).spread == 0.0


def test_acceptance_from_rounds() -> None:
    acc = acceptance([gen([1] * 7, 10, [(4, 4), (4, 0), (4, 1)])])
    assert acc is not None
    # accepted 5 of checked 4 + 1 + 2 = 7
    assert acc.a == pytest.approx(5 / 7)
    assert acc.rate == pytest.approx(5 / 12)
    assert acc.tokens_per_round == pytest.approx((5 + 1 + 2) / 3)
    assert acc.histogram == {4: {0: 1, 1: 1, 4: 1}}


def test_speedup_pairs_repeats_and_counts_forwards() -> None:
    spec_case = Case("main", "speculative", "model", "greedy", 4)
    base_case = Case("main", "cloud_only", None, "greedy")
    ids = [7] * 8
    spec_runs = [run(spec_case.key, r, [gen(ids, wall, [(4, 3), (4, 3)])], rounds=2)
                 for r, wall in enumerate((100.0, 200.0))]
    base_runs = [run(base_case.key, r, [gen(ids, wall, [])], generated=8) for r, wall in enumerate((400.0, 400.0))]
    spec = summarise(spec_case, spec_runs, kv_per_token=16)
    base = summarise(base_case, base_runs, kv_per_token=16)
    compare(spec, base, base_runs, spec_runs, t_target_ms=5.0, rtt_ms=8.0, prefill_ms=[0.0])
    assert spec.speedup is not None
    assert (spec.speedup.lo, spec.speedup.hi) == (pytest.approx(2.0), pytest.approx(4.0))
    # 2 verify rounds + 1 session prefill for 8 tokens; cloud_only: one step per token
    assert spec.forwards_per_token == pytest.approx(3 / 8)
    assert base.forwards_per_token == 1.0
    assert base.kv_computed and base.kv_peak_bytes == 16 * (10 + 8)
    assert spec.bound is not None and spec.bound > 0
    greedy_check(spec, spec_runs, base_runs)
    assert spec.greedy_matches == (1, 1)


def test_greedy_check_counts_a_mismatch() -> None:
    spec_case = Case("main", "speculative", "ngram", "greedy", None)
    spec_runs = [run(spec_case.key, 0, [gen([1, 2, 3], 10, [(2, 1)])])]
    base_runs = [run("base", 0, [gen([1, 2, 4], 10, [])])]
    spec = summarise(spec_case, spec_runs, kv_per_token=16)
    greedy_check(spec, spec_runs, base_runs)
    assert spec.greedy_matches == (0, 1)

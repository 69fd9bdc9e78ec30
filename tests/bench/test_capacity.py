"""The capacity load generator and its statistics, without a cloud: work assignment, trace cuts,
replay checks against a fake stub, per-session rates, batch means, ratios, the report splice."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from bench.capacity import CapacityPlan, CapacityResults, CapacityRun
from bench.capacity_report import histogram_mean, ratios, section, splice, summarise
from bench.loadgen import Occupancy, TextRun, assign_texts, replay_speculative
from bench.traces import (
    DRAFTERS,
    TRACES_DIR,
    Trace,
    TraceRound,
    TraceSet,
    load,
    load_dir,
    save,
    target_fingerprint,
)
from shared.hashing import ctx_hash
from shared.pb import verify_pb2 as pb

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.1}


def make_trace(tokens_per_round: list[int], prompt: list[int] | None = None) -> Trace:
    """A consistent trace: each round accepts tokens - 1 drafts and commits a correction."""
    prompt = prompt or [5, 6, 7]
    s = list(prompt)
    rounds = []
    for i, n in enumerate(tokens_per_round):
        draft = [10 + i] * max(n - 1, 1)
        before = (len(s), ctx_hash(s))
        s += draft[: n - 1] + [90 + i]
        rounds.append(TraceRound(ctx_len=before[0], ctx_hash=before[1], append_ids=[], draft_tokens=draft,
                                 q_token_probs=[1.0] * len(draft), draft_kind="deterministic", return_top_k=0,
                                 accepted_len=n - 1, correction=90 + i, next_kind="correction",
                                 answer_ctx_len=len(s), answer_ctx_hash=ctx_hash(s)))
    return Trace("code/x", "model", 1000, prompt, s[len(prompt):], rounds)


def test_every_session_gets_equal_work_from_both_drafters_and_the_case_covers_every_trace() -> None:
    assert assign_texts(1, 8) == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert assign_texts(4, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    sixteen = assign_texts(16, 8)
    assert all(len(p) == 2 and (p[0] < 4) != (p[1] < 4) for p in sixteen)  # one trace of each half
    assert sorted({j for p in assign_texts(64, 8) for j in p}) == list(range(8))
    assert assign_texts(4, 8, texts=4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError):
        assign_texts(0, 4)


def test_a_text_is_cut_after_the_round_that_reaches_the_cap() -> None:
    t = make_trace([3, 1, 4, 2])
    assert len(t.rounds_for(4)) == 2 and t.tokens_for(4) == 4
    assert len(t.rounds_for(5)) == 3 and t.tokens_for(5) == 8
    assert len(t.rounds_for(100)) == 4 and t.tokens_for(100) == len(t.token_ids) == 10


class FakeStub:
    """Answers from the trace's recording, except the rounds listed in `wrong` (La off by one)."""

    def __init__(self, trace: Trace, wrong: set[int] = frozenset(), fail_at: int | None = None) -> None:  # type: ignore[assignment]
        self.trace, self.wrong, self.fail_at = trace, wrong, fail_at
        self.verified: list[Any] = []
        self.closed: list[str] = []

    async def OpenSession(self, req: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return pb.SessionInfo(ctx_id="c1", ctx_len=len(req.prompt_ids), ctx_hash=ctx_hash(list(req.prompt_ids)))

    async def Verify(self, req: Any, timeout: float | None = None) -> Any:  # noqa: N802
        i = len(self.verified)
        self.verified.append(req)
        if i == self.fail_at:
            raise RuntimeError("boom")
        r = self.trace.rounds[i]
        return pb.VerifyResponse(accepted_len=r.accepted_len + (1 if i in self.wrong else 0),
                                 correction=r.correction, next_kind=r.next_kind, ctx_len=r.answer_ctx_len,
                                 ctx_hash=r.answer_ctx_hash)

    async def CloseSession(self, req: Any, timeout: float | None = None) -> Any:  # noqa: N802
        self.closed.append(req.ctx_id)
        return pb.CloseSessionResponse(closed=True)


def replay(stub: FakeStub, trace: Trace, max_tokens: int = 100) -> tuple[TextRun, Occupancy]:
    occ = Occupancy()
    run = asyncio.run(replay_speculative(stub, trace, 3, 0, max_tokens, GREEDY, 0.0, occ))
    return run, occ


def test_replay_sends_the_recorded_requests_and_checks_every_answer() -> None:
    trace = make_trace([2, 3, 1])
    stub = FakeStub(trace)
    run, occ = replay(stub, trace)
    assert (run.checked, run.mismatches, run.error, run.tokens) == (3, 0, None, 6)
    assert [(v.ctx_len, v.ctx_hash, list(v.draft_tokens)) for v in stub.verified] == \
        [(r.ctx_len, r.ctx_hash, r.draft_tokens) for r in trace.rounds]
    assert all(v.ctx_id == "c1" and v.k == len(v.draft_tokens) for v in stub.verified)
    assert stub.closed == ["c1"] and len(run.round_ms) == 3
    # KV demand: the prompt plus every committed token, released at close
    assert (occ.peak, occ.now) == (3 + 6, 0)


def test_replay_counts_an_answer_that_differs_and_stops_there() -> None:
    trace = make_trace([2, 3, 1, 2])
    stub = FakeStub(trace, wrong={1})
    run, _ = replay(stub, trace)
    assert (run.checked, run.mismatches) == (2, 1)
    assert len(stub.verified) == 2 and stub.closed == ["c1"]


def test_replay_stops_at_the_token_cap() -> None:
    trace = make_trace([2, 3, 1, 2])
    stub = FakeStub(trace)
    run, _ = replay(stub, trace, max_tokens=5)
    assert len(stub.verified) == 2 and run.tokens == 5 and run.mismatches == 0


def test_replay_records_a_failed_call_and_still_closes() -> None:
    trace = make_trace([2, 3])
    stub = FakeStub(trace, fail_at=1)
    run, occ = replay(stub, trace)
    assert run.error is not None and "boom" in run.error
    assert run.checked == 1 and stub.closed == ["c1"] and occ.now == 0


def text(session: int, tokens: int, start: float, end: float, rounds: list[float] | None = None) -> dict[str, Any]:
    return {"session": session, "trace": 0, "tokens": tokens, "start_s": start, "end_s": end,
            "round_ms": rounds or [], "open_ms": 0.0, "checked": 1, "mismatches": 0, "error": None}


def run_of(arm: str, mode: str, n: int, tokens: int, cpu: float, rounds: list[float],
           counters: dict[str, float] | None = None) -> CapacityRun:
    return CapacityRun(arm=arm, mode=mode, sessions=n, wall_s=2.0, tokens=tokens, cloud_cpu_s=cpu, client_cpu_s=0.1,
                       cloud_peak_rss=500 << 20, kv_peak_bytes=0.0, kv_polls=3, kv_demand_bytes=4096,
                       counters=counters or {}, texts=[text(0, tokens, 0.0, 1.0, rounds)])


def test_per_session_rate_is_the_median_over_sessions() -> None:
    run = run_of("batched", "speculative", 3, 80, 1.0, [])
    run.texts = [text(0, 10, 0.0, 1.0), text(0, 10, 1.0, 2.0),  # 20 tokens over 2 s: 10 / s
                 text(1, 30, 0.5, 1.5),                          # 30 / s
                 text(2, 20, 0.0, 1.0)]                          # 20 / s
    s = summarise(run)
    assert s.per_session_tps == pytest.approx(20.0)
    assert s.throughput == pytest.approx(80 / 2.0) and s.tokens_per_cloud_cpu_s == pytest.approx(80.0)


def test_batch_means_come_from_the_histograms_or_are_absent() -> None:
    assert histogram_mean({}, "specsplit_cloud_batch_size") is None
    assert histogram_mean({"specsplit_cloud_batch_size_count": 0.0}, "specsplit_cloud_batch_size") is None
    c = {"specsplit_cloud_batch_size_sum": 48.0, "specsplit_cloud_batch_size_count": 12.0}
    assert histogram_mean(c, "specsplit_cloud_batch_size") == pytest.approx(4.0)
    s = summarise(run_of("batched", "speculative", 4, 100, 1.0, [1.0], c))
    assert s.mean_batch_size == pytest.approx(4.0) and s.mean_batch_tokens is None


def results(runs: list[CapacityRun]) -> CapacityResults:
    plan = CapacityPlan(levels=(1, 16), ref_level=16, arms=(("batched", "--a"), ("single", "--b")))
    notes = {"command": "specsplit-bench --only capacity", "started": "now", "traces": "bench/traces",
             "trace_names": ["model:a", "ngram:a"], "gpu": "", "target": "models/demo-target",
             "cloud_args": "--dtype float32", "kv_per_position": 16384,
             "machine": {"cpu_model": "cpu", "cpus": 2, "load_avg_1m": 0.5, "versions": {"torch": "x"}}}
    return CapacityResults(plan, notes, runs, total_s=10.0)


def test_ratios_are_read_at_the_reference_level() -> None:
    res = results([
        run_of("batched", "speculative", 1, 100, 1.0, [10.0, 10.0, 10.0]),
        run_of("batched", "speculative", 16, 600, 2.0, [15.0, 15.0, 30.0]),   # 300 / CPU-s, p50 15
        run_of("single", "speculative", 16, 400, 4.0, [150.0]),                # 100 / CPU-s
        run_of("batched", "cloud_only", 16, 400, 2.0, [5.0]),                  # 200 / CPU-s
    ])
    got = [r.value for r in ratios(res)]
    assert got[0] == pytest.approx(3.0)
    assert got[1] == pytest.approx(1.5)
    assert got[2] == pytest.approx(1.5)
    assert got[3] is None and got[4] is None  # cases not run: no number, not a guess
    lines = section(res)
    assert lines[0] == "## Cloud capacity: CPU"
    assert any("| 3.00x | >= 2.5x |" in line for line in lines) and any("| n/a | –" in line for line in lines)


def test_the_section_replaces_itself_or_goes_before_noise() -> None:
    body = ["## Cloud capacity: CPU", "", "new table", ""]
    doc = "# Benchmarks\n\n## Main\n\nx\n\n## Noise\n\nn\n"
    once = splice(doc, body, body[0])
    assert once.index("## Cloud capacity: CPU") < once.index("## Noise")
    old = once.replace("new table", "old table")
    twice = splice(old, body, body[0])
    assert twice == once and "old table" not in twice
    gpu = splice(once, ["## Cloud capacity: GPU (cuda, bfloat16)", "", "g", ""], "## Cloud capacity: GPU (cuda, bfloat16)")
    assert "new table" in gpu and "\ng\n" in gpu  # one section per device kind
    assert splice("", body, body[0]).startswith("## Cloud capacity: CPU")


def test_results_survive_json() -> None:
    res = results([run_of("batched", "speculative", 1, 100, 1.0, [10.0])])
    again = CapacityResults.from_json(json.loads(json.dumps(res.to_json())))
    assert again == res


def test_trace_files_round_trip_and_belong_to_one_target(tmp_path: Path, demo_target_dir: Path) -> None:
    ts = TraceSet(target_fingerprint(demo_target_dir), {"device": "cpu", "dtype": "float32"}, [make_trace([2, 1])])
    for d in DRAFTERS:
        save(ts, tmp_path / f"{d}.json")
    assert load(tmp_path / "model.json") == ts
    assert load_dir(tmp_path, demo_target_dir) == [ts.traces[0], ts.traces[0]]
    # recorded in another dtype: a greedy answer may differ, so these do not replay
    assert load_dir(tmp_path, demo_target_dir, "cuda", "bfloat16") is None
    other = TraceSet("0" * 16, ts.recorded_with, ts.traces)
    save(other, tmp_path / "ngram.json")
    assert load_dir(tmp_path, demo_target_dir) is None


def test_committed_traces_are_consistent_with_the_demo_target(demo_target_dir: Path) -> None:
    """Each committed trace is one unbroken greedy session of the bundled target: every request
    starts where the previous answer left the context, and the rounds commit the recorded text."""
    traces = load_dir(TRACES_DIR, demo_target_dir)
    assert traces is not None, "bench/traces was not recorded against models/demo-target"
    assert {t.drafter for t in traces} == set(DRAFTERS)
    for t in traces:
        s = list(t.prompt_ids)
        for r in t.rounds:
            assert (r.ctx_len, r.ctx_hash) == (len(s) + len(r.append_ids), ctx_hash(s + r.append_ids))
            s += r.append_ids + r.draft_tokens[: r.accepted_len] + [r.correction]
            assert (r.answer_ctx_len, r.answer_ctx_hash) == (len(s), ctx_hash(s))
            assert r.next_kind in ("correction", "bonus")
        assert s[len(t.prompt_ids):] == t.token_ids


def test_a_rerun_keeps_the_other_device_kinds_section(tmp_path: Path) -> None:
    from dataclasses import replace

    from bench.capacity_report import load_raw, store_raw
    from bench.run import other_capacity_runs

    cpu = results([run_of("batched", "speculative", 1, 100, 1.0, [10.0])])
    gpu = replace(cpu, plan=replace(cpu.plan, device="cuda", dtype="bfloat16"))
    raw = tmp_path / "results.json"
    raw.write_text(json.dumps({"machine": {}}))
    store_raw(cpu, raw)
    store_raw(gpu, raw)
    assert json.loads(raw.read_text())["machine"] == {}  # the main results stay as they were
    assert load_raw(json.loads(raw.read_text())) == [cpu, gpu]
    assert other_capacity_runs(raw, "cpu") == [gpu]
    assert other_capacity_runs(raw, "") == [cpu, gpu]
    assert other_capacity_runs(tmp_path / "missing.json", "cpu") == []

"""`specsplit-bench --only capacity --quick` end to end on the tiny random pair: traces recorded
against it, two real cloud processes (one per arm), the load generator, the section and its JSON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.capacity import BATCHED_FLAGS, UNBATCHED_FLAGS, CapacityResults
from bench.capacity_report import summarise
from bench.cloud_proc import cloud_command
from bench.run import main


def cloud_batches() -> bool:
    """Whether this checkout's specsplit-cloud has the batching flags the arms pass."""
    out = subprocess.run([*cloud_command(), "--help"], capture_output=True, text=True, timeout=60)
    return "--max-batch-size" in out.stdout


@pytest.fixture(scope="module")
def capacity_run(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bool]:
    root = tmp_path_factory.mktemp("capacity")
    out = root / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## Main table\n\nkept\n\n## Noise\n\nkept too\n")
    target, draft = tiny_pair
    batches = cloud_batches()
    flags = [] if batches else ["--capacity-batched-flags", "", "--capacity-unbatched-flags", ""]
    assert main(["--only", "capacity", "--quick", "--out", str(out), "--target", str(target), "--draft", str(draft),
                 "--traces", str(root / "no-traces"), *flags]) == 0
    return out, batches


def test_the_section_lands_between_the_others(capacity_run: tuple[Path, bool]) -> None:
    out, batches = capacity_run
    text = out.read_text()
    assert text.index("## Main table") < text.index("## Cloud capacity: CPU") < text.index("## Noise")
    assert "kept too" in text and "| ratio (this run) | measured | aim |" in text
    assert "specsplit-bench --only capacity --quick" in text
    if batches:
        assert BATCHED_FLAGS in text and UNBATCHED_FLAGS in text


def test_every_case_ran_exactly_as_recorded(capacity_run: tuple[Path, bool]) -> None:
    out, batches = capacity_run
    raw = json.loads((out.parent / "plots" / "results.json").read_text())
    res = CapacityResults.from_json(raw["capacity"]["cpu"])
    got = sorted((r.arm, r.mode, r.sessions) for r in res.runs)
    assert got == sorted((arm, mode, n) for arm, _ in res.plan.arms for mode in ("speculative", "cloud_only")
                         for n in (1, 2))
    for run in res.runs:
        s = summarise(run)
        assert s.errors == 0 and s.tokens > 0 and s.checked > 0
        # greedy: the cloud answers every replayed round, and streams every text, as recorded
        assert s.mismatches == 0, (run.arm, run.mode, run.sessions)
        assert s.cloud_cpu_s > 0 and s.cloud_peak_rss > 0 and s.round_p50_ms > 0
        texts = run.text_runs()
        assert len(texts) == max(run.sessions, len(res.notes["trace_names"]))
        if run.mode == "speculative":
            # the cloud's own count of rounds in the window equals the rounds the load sent
            assert run.counters["specsplit_cloud_rounds_total"] == sum(t.checked for t in texts)
            assert run.counters["specsplit_cloud_emitted_tokens_total"] == s.tokens
            assert run.kv_peak_bytes <= run.kv_demand_bytes + 4 * res.notes["kv_per_position"] * run.sessions
        else:
            assert run.counters["specsplit_cloud_generated_tokens_total"] == s.tokens
        assert (s.mean_batch_size is not None) == batches


def test_the_section_rerenders_from_the_json(capacity_run: tuple[Path, bool], tmp_path: Path) -> None:
    out, _ = capacity_run
    again = tmp_path / "again.md"
    assert main(["--from-json", str(out.parent / "plots" / "results.json"), "--out", str(again),
                 "--plots", str(tmp_path / "p")]) == 0
    table = [line for line in out.read_text().splitlines() if line.startswith("|")]
    assert table and table == [line for line in again.read_text().splitlines() if line.startswith("|")]

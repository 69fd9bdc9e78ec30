"""`--only gpu-capacity` on a tiny shape on the CPU (the dry run CI can make): every speculation text equals the
cloud's own, replayed drafts cost fewer forwards than cloud_only, the trace's arithmetic, the modeled curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_capacity


def test_chain_tokens_follow_the_trace() -> None:
    assert gpu_capacity.chain_tokens([1, 1, 1, 1], 3) == 4.0  # every round keeps k and adds one
    assert gpu_capacity.chain_tokens([0, 0], 8) == 1.0  # every round keeps none: its own token alone
    assert gpu_capacity.chain_tokens([1, 0], 4) == 1.5  # from a hit: 1 + 1; from a miss: 0 + 1


def test_dry_run_replays_the_trace_and_keeps_the_cloud_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"rows": [{"hits": [1, 1, 1, 0, 1, 1, 0, 1, 1, 1]}, {"hits": [1, 0, 1, 1]}]}))
    monkeypatch.setattr(gpu_capacity, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(gpu_capacity, "REPO", tmp_path)
    res = gpu_capacity.run(None, "test", "tiny", (1, 2), n_tokens=8, k=4, trace_path=trace)
    rows = res["measured"]
    assert [r["policy"] for r in rows] == ["cloud_only", "chain-4"] * 2
    for alone, spec in zip(rows[::2], rows[1::2], strict=True):
        assert spec["texts_equal"] is True
        assert spec["tokens"] == alone["tokens"] == 8 * alone["sessions"]
        assert spec["rounds"] < alone["rounds"]  # a replayed hit saves a forward
    assert (tmp_path / "results" / "forward_costs_cpu.json").exists()
    assert (tmp_path / res["plot"]).exists()
    assert [m["sessions"] for m in res["modeled"]] == [1, 2]

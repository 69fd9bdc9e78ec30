"""The real-pair bench's byte columns: a round's downlink counts the verify answers only, an open's apart."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import bench.real_pair as rp
from edge.metrics import EdgeMetrics


def test_downlink_per_round_leaves_the_opens_out_and_states_them_per_open(monkeypatch: pytest.MonkeyPatch) -> None:
    sessions = iter([EdgeMetrics(emitted=20, verify_calls=10, bytes_up=3000, bytes_down=50_000,
                                 open_bytes_down=30_000, feature_bytes=9_000),
                     EdgeMetrics(emitted=12, verify_calls=6, bytes_up=1800, bytes_down=35_000,
                                 open_bytes_down=27_000, reopens=1, feature_bytes=4_000)])

    def run_session(s: Any, tok: Any, text: str, states_drafting: Any = None) -> Any:
        return SimpleNamespace(metrics=next(sessions))

    monkeypatch.setattr(rp, "run_session", run_session)
    r = rp.measure(None, None, ["a", "b"], {"draft": "d", "temperature": 0.0, "shape": "chain", "k": 6})
    assert r["down_bytes_per_round"] == (20_000 + 8_000) / 16  # opens left out
    assert r["feature_bytes_per_round"] == 13_000 / 16
    assert r["open_down_bytes"] == 57_000 / 3  # two sessions, one reopen
    assert r["up_bytes_per_round"] == 4800 / 16 and r["tokens_per_call"] == 2.0

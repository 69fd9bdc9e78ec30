"""How long one op may run before its rank counts as hung is a setting (--tp-op-timeout-s) with a floor,
so a long forward of a large target (a prefill chunk on CPU over gloo) does not restart the group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cloud import settings
from cloud.cli import settings_from_args
from cloud.runners import tensor_parallel as tp
from cloud.runners.tensor_parallel import Op, serve_worker
from tests.cloud.test_tensor_parallel_watch import Clock, worker


def test_a_worker_keeps_beating_through_a_forward_shorter_than_its_op_timeout(monkeypatch: Any) -> None:
    """--tp-op-timeout-s 300: a 100 s forward beats throughout; past 300 s the rank counts as hung."""
    monkeypatch.setattr(tp.signal, "signal", lambda *a: None)
    clock = Clock()
    g = worker(clock)
    g.op_stale_s = 300.0
    beats: list[int] = []

    class Model:
        def run_step(self, op: Any) -> None:
            for step in (0.0, 50.0, 50.0, 250.0):  # 0, 50, 100 s into the forward, then 350 s
                clock.now += step
                g._store.add("specsplit/beat/0", 1)  # rank 0 is alive
                g._beat_once(clock())
                beats.append(g._store.counts["specsplit/beat/1"])

    ops = iter([Op("forward", step=object()), Op("stop")])  # type: ignore[arg-type]
    monkeypatch.setattr(g, "receive", lambda: next(ops), raising=False)
    assert serve_worker(Model(), g) == 0
    assert beats == [1, 2, 3, 3] and g.lost() is None


def test_the_op_timeout_is_a_flag_with_a_floor(tiny_pair: tuple[Path, Path]) -> None:
    model = ["--model", str(tiny_pair[0])]
    assert settings_from_args(model).tp_op_timeout_s == settings.OP_STALE_S
    assert settings_from_args([*model, "--tp-op-timeout-s", "900"]).tp_op_timeout_s == 900.0
    with pytest.raises(ValidationError, match="tp_op_timeout_s"):
        settings_from_args([*model, "--tp-op-timeout-s", str(settings.OP_STALE_FLOOR_S / 2)])
    assert settings.OP_STALE_FLOOR_S > tp.STALE_S

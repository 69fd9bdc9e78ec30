"""The one training loop: its budget, its schedule, its log and checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from research.drafting.loop import Budget, fit, warmup_cosine


def test_budget_is_whichever_share_runs_out_first() -> None:
    assert Budget(steps=10).progress(5, 1e9) == 0.5
    assert Budget(minutes=1.0).progress(10**6, 30.0) == 0.5
    assert Budget(steps=10, minutes=1.0).progress(2, 30.0) == 0.5
    assert Budget().progress(0, 0.0) == 1.0  # no budget: nothing to run


def test_warmup_then_cosine_to_the_floor() -> None:
    lr = warmup_cosine(1.0, warmup=10, floor=0.1)
    assert lr(0, 0.0) == pytest.approx(0.1)
    assert lr(9, 0.0) == pytest.approx(1.0)
    assert lr(100, 0.5) == pytest.approx(0.55)
    assert lr(100, 1.0) == pytest.approx(0.1)


def test_fit_lowers_a_loss_logs_and_saves_at_the_end() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(4))
    x = torch.randn(64, 4)  # [N, 4]
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])  # [N]
    saves: list[int] = []
    state: dict[str, Any] = {}

    def loss_of() -> tuple[torch.Tensor, dict[str, Any]]:
        return ((x @ w - y) ** 2).mean(), {"note": 1}

    fit([w], torch.optim.AdamW([w]), loss_of, warmup_cosine(0.1, 5), Budget(steps=200), state, log_every=50,
        save=lambda: saves.append(state["step"]))
    assert state["step"] == 200 and saves == [200]
    assert [e["step"] for e in state["log"]] == [1, 50, 100, 150, 200] and state["log"][0]["note"] == 1
    assert state["log"][-1]["loss"] < 0.01 * state["log"][0]["loss"]

"""The one training loop every draft here trains with: nanoGPT's, with the loss left to the caller.

A step draws a batch and its loss (`loss_of()`, which returns the loss and what to log beside it), sets
the learning rate from the step and the share of the budget spent (`lr_of(step, progress)`), clips the
gradient norm and steps the optimizer. The budget is steps, or minutes of steps (a step stopped with
SIGSTOP counts at most `pause_cap` seconds), or both (whichever runs out first). `save()` is called every
`checkpoint_s` seconds and at the end; SIGTERM or SIGINT finish the step, save and stop, so rerunning the
same command resumes from the checkpoint.

The run's state is a plain dict the caller keeps in its checkpoint: `step`, `seconds` (of steps),
`loss_ema` (0.98 per step) and `log` (one entry every `log_every` steps and at step 1: step, loss, seconds,
lr and the loss's own entries).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

LossFn = Callable[[], tuple[torch.Tensor, dict[str, Any]]]
Schedule = Callable[[int, float], float]


@dataclass
class Budget:
    # steps to run (0: no step budget)
    steps: int = 0
    # minutes of steps to run (0: no time budget)
    minutes: float = 0.0
    # most seconds one step counts toward `minutes` (a SIGSTOP inside a step)
    pause_cap: float = 30.0

    def progress(self, step: int, seconds: float) -> float:
        """The share of the budget spent: the larger of the step share and the time share given."""
        parts = ([step / self.steps] if self.steps else []) + ([seconds / (60 * self.minutes)] if self.minutes else [])
        return max(parts, default=1.0)


def warmup_cosine(peak: float, warmup: int, floor: float = 0.1) -> Schedule:
    """Linear warm-up over `warmup` steps, then cosine from `peak` to `floor * peak` over the budget."""
    def lr(step: int, progress: float) -> float:
        cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return peak * min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * cos)
    return lr


def new_state() -> dict[str, Any]:
    return {"step": 0, "seconds": 0.0, "loss_ema": None, "log": []}


def save_checkpoint(path: Path, obj: Any) -> None:
    """`torch.save(obj)` atomically (temporary name, then rename)."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def fit(params: Sequence[torch.Tensor], opt: torch.optim.Optimizer, loss_of: LossFn, lr_of: Schedule,
        budget: Budget, state: dict[str, Any], *, grad_clip: float = 1.0, log_every: int = 10, tag: str = "train",
        save: Callable[[], None] | None = None, checkpoint_s: float = 300.0) -> dict[str, Any]:
    """Step until `budget` is spent (or a SIGTERM / SIGINT), advancing `state` in place; returns it."""
    for key, value in new_state().items():
        state.setdefault(key, value)
    stop: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, lambda sig, _frame: stop.append(sig)) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    t_saved = time.time()
    try:
        while budget.progress(state["step"], state["seconds"]) < 1.0 and not stop:
            t0 = time.time()
            lr = lr_of(state["step"], budget.progress(state["step"], state["seconds"]))
            for g in opt.param_groups:
                g["lr"] = lr
            loss, info = loss_of()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            value = float(loss.detach())
            state["step"] += 1
            state["seconds"] += min(time.time() - t0, budget.pause_cap)
            state["loss_ema"] = value if state["loss_ema"] is None else 0.98 * state["loss_ema"] + 0.02 * value
            if state["step"] % log_every == 0 or state["step"] == 1:
                state["log"].append({"step": state["step"], "loss": round(value, 4), **info,
                                     "seconds": round(state["seconds"], 1), "lr": lr})
                log.info("%s step %s", tag, state["log"][-1])
            if save is not None and time.time() - t_saved > checkpoint_s:
                save()
                t_saved = time.time()
        if save is not None:
            save()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return state

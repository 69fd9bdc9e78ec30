"""What speculation buys on the machine at hand: the sentence `generate --against-cloud-only` (and so the demo)
prints beside its two decode rates, chosen by figures measured in that run, never assumed.

- the cloud's CPU-seconds per token of each run: the change of the cloud's `process_cpu_seconds_total`
  (GET /metrics) over the run, over the tokens it produced;
- what a verify of k tokens costs against one step on this cloud: the cloud's own forward-cost fit
  (GET /v1/model `forward_cost`: base + row x rows), with k the run's mean nodes per round.

Speculation pays for one user's speed where its decode rate reaches the cloud alone's; it pays for cloud
capacity where the cloud spends fewer CPU-seconds a token on it. On one CPU core a verify of k tokens costs
nearly k steps, so only the second can hold there; on a GPU a verify of 8 costs about one step (docs/GPU.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from .policy.stream import ForwardFit

# measured on one NVIDIA H200, coder-1.5B shape (BENCHMARKS.md, "The cloud on a GPU", 2026-11-28)
GPU_VERIFY_8 = "1.02-1.09"


@dataclass
class Run:
    """One generation as the verdict reads it."""
    # decode tokens per second after the first token
    rate: float
    # tokens the run produced
    tokens: int
    # the cloud's CPU-seconds over the run (None: its /metrics could not be read)
    cloud_cpu_s: float | None

    @property
    def cpu_per_token(self) -> float | None:
        return self.cloud_cpu_s / self.tokens if self.cloud_cpu_s is not None and self.tokens else None


def cloud_cpu_seconds(url: str, headers: dict[str, str] | None = None, verify: Any = True) -> float | None:
    """The cloud process's CPU-seconds so far (its /metrics), or None."""
    try:
        r = httpx.get(url.rstrip("/") + "/metrics", headers=headers or {}, timeout=10, verify=verify)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    for line in r.text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    return None


def verify_steps(forward_cost: dict[str, Any] | None, k: int) -> float | None:
    """What a forward of k + 1 rows costs against one of 1 row, by the cloud's fit (None: not fitted yet); the
    reading the edge's first speculate-or-stream decision makes of it (edge/policy/stream.py)."""
    fit = ForwardFit.of(forward_cost)
    return fit.steps(k) if fit is not None else None


def verdict(spec: Run, alone: Run, k: int, steps: float | None, device: str) -> str:
    """One sentence chosen by the figures (see the module docstring)."""
    ratio = spec.rate / alone.rate if alone.rate else 0.0
    cost = f"a verify of {k} costs {steps:.1f} steps on this cloud ({device})" if steps is not None else \
        f"this cloud's cost of a verify of {k} is not measured yet"
    cpu = (f"{spec.cpu_per_token:.3f} against {alone.cpu_per_token:.3f} cloud CPU-s a token"
           if spec.cpu_per_token is not None and alone.cpu_per_token is not None else "cloud CPU unknown")
    capacity = (spec.cpu_per_token is not None and alone.cpu_per_token is not None
                and spec.cpu_per_token < alone.cpu_per_token)
    gpu = f"; on a GPU a verify of 8 costs {GPU_VERIFY_8} steps (docs/GPU.md)" if device == "cpu" else ""
    if ratio >= 0.98:
        also = f", and for cloud capacity ({cpu})" if capacity else f" ({cpu})"
        return f"speculation pays here for this user's speed ({ratio:.2f}x){also}; {cost}"
    if capacity:
        return (f"{cost}: speculation pays here for cloud capacity ({cpu}), not one user's speed "
                f"({ratio:.2f}x){gpu}")
    return f"{cost}: speculation pays for neither one user's speed ({ratio:.2f}x) nor cloud capacity ({cpu}) here{gpu}"

"""A bfloat16 target end to end: no crash, and sampling keeps the distribution of its verify forward.

Under low precision "exact" means: every emitted token has the distribution of the processed p
that the cloud's verify forward computes in bfloat16. That p can differ by rounding from a one-token
decode step of the same model (a k + 1-token forward sums in another order), so greedy output
can differ from a one-token-at-a-time bf16 decode where two logits tie in bf16 (README,
"Precision"). Sampled output is tested here against the bf16 model's own distribution.

Test: Pearson chi-square goodness of fit of the first two generated tokens (t1, t2) over N = 400
seeded generations (seeds 0..399, split-residual correction, k = 2) against p(t1 | P) p(t2 | P, t1)
computed from the bf16 target with the shared processing; cells expected below 5 pooled; fails
below p = 1e-3. Power: the biased shortcut correction over the same N generations must fail it, and the power at
N estimated from that sample (tests/e2e/test_edge_sampling.py's `power_at`: non-centrality N (X^2 - dof) / N) must
be at least 0.99; the float32 target's chain shortcut measured w^2 = 0.26, power 0.999995 at N = 400. The two
samples are drawn concurrently against the one cloud.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from edge.drafters import ModelDrafter
from shared.sampling import processed_probs
from tests.e2e.test_edge_sampling import (
    CFG,
    MIN_POWER,
    P_THRESHOLD,
    PROMPT,
    chi_square_pvalue,
    first_pairs,
    power_at,
)
from tests.server import CloudProcess

N = 400
N_BIASED = N


@pytest.fixture(scope="module")
def bf16_cloud(tiny_pair: tuple[Path, Path]) -> Iterator[CloudProcess]:
    with CloudProcess(tiny_pair[0], extra_args=("--dtype", "bfloat16")) as c:
        yield c


@pytest.fixture(scope="module")
def expected_bf16(tiny_pair: tuple[Path, Path], tokenizer: Any) -> dict[tuple[int, int], float]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.bfloat16).eval()
    ids = tokenizer.encode(PROMPT)
    out = {}
    with torch.no_grad():
        p1 = processed_probs(target(input_ids=torch.tensor([ids])).logits[0, -1:].float(), CFG, ids)[0]
        for t1 in p1.nonzero().squeeze(-1).tolist():
            ctx = ids + [t1]
            p2 = processed_probs(target(input_ids=torch.tensor([ctx])).logits[0, -1:].float(), CFG, ctx)[0]
            for t2 in p2.nonzero().squeeze(-1).tolist():
                out[(t1, t2)] = float(p1[t1]) * float(p2[t2])
    return out


@pytest.mark.slow
def test_bf16_sampling_matches_the_bf16_target(bf16_cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter,
                                               expected_bf16: dict[tuple[int, int], float]) -> None:
    with ThreadPoolExecutor(2) as pool:
        exact = pool.submit(first_pairs, bf16_cloud, tokenizer, drafter.fork(), N)
        shortcut = pool.submit(first_pairs, bf16_cloud, tokenizer, drafter.fork(), N_BIASED, correction="shortcut")
        (pairs, origins), (biased, _) = exact.result(), shortcut.result()
    p, dof = chi_square_pvalue(pairs, expected_bf16)
    print(f"bf16 split residual: chi-square p = {p:.3f} with {dof} dof over {N} generations")
    assert origins["residual"] > 0.1 * N and origins["accepted"] > 0.05 * N
    assert p >= P_THRESHOLD, f"chi-square p = {p:.2e} ({dof} dof): not the bf16 target's distribution"
    pb, dofb = chi_square_pvalue(biased, expected_bf16)
    power = power_at(biased, expected_bf16, N)
    print(f"bf16 shortcut (biased): chi-square p = {pb:.2e} with {dofb} dof over {N_BIASED}; power at N: {power:.6f}")
    assert pb < P_THRESHOLD, f"the biased variant passed (p = {pb:.2e}, {dofb} dof): the test has no power"
    assert power >= MIN_POWER, f"N = {N} detects the shortcut with probability {power:.3f} only"

"""Sampling through the real cloud with the attention head keeps the target's exact distribution.

The attention head (research/heads/attention_drafter.py, a random head of window 8 fed the tiny target's
states at every committed position, plugged in by research.heads.HeadChoice): the test of
tests/e2e/test_edge_sampling.py (Pearson chi-square of the first two tokens over N = 400 seeded generations
against the target's exact p(t1) p(t2 | t1), fail below p = 1e-3; its docstring gives the power) over N
generations drafting chains of k = 2 and over N drafting the 6-node trees, and its tree shortcut must fail it with
N_BIASED_TREE. Its first draft after an open comes from the target's own state; the second from the head's
prediction, which the rule must correct.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from edge.drafters import ModelDrafter
from research.heads import HeadChoice
from tests.e2e.test_edge_sampling import (
    CFG,
    N_BIASED_TREE,
    P_THRESHOLD,
    PROMPT,
    TREE,
    N,
    Sample,
    chi_square_pvalue,
    exact_pair_probs,
    first_pairs,
)
from tests.server import CloudProcess


@pytest.fixture(scope="module")
def expected(tiny_pair: tuple[Path, Path], tokenizer: Any) -> dict[tuple[int, int], float]:
    """The target's exact probability of every (t1, t2) pair after the prompt."""
    return exact_pair_probs(tiny_pair[0], tokenizer.encode(PROMPT), CFG)


@pytest.fixture(scope="module")
def samples(cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter, attention_head_dir: Path) -> dict[str, Sample]:
    """Every variant, generated concurrently against one cloud: each wraps a drafter fork in the attention head
    (the draft model is its fallback), one HeadChoice each."""
    variants: dict[str, tuple[int, dict[str, Any]]] = {
        "head": (N, {}), "head_tree": (N, TREE),
        "head_tree_shortcut": (N_BIASED_TREE, {**TREE, "correction": "shortcut"})}
    with ThreadPoolExecutor(len(variants)) as pool:
        futures = {name: pool.submit(first_pairs, cloud, tokenizer, drafter.fork(), n,
                                     states_drafting=HeadChoice(attention_head_dir), **kw)
                   for name, (n, kw) in variants.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["head", "head_tree"])
def test_the_attention_head_keeps_target_sampling(samples: dict[str, Sample],
                                                  expected: dict[tuple[int, int], float], variant: str) -> None:
    pairs, origins = samples[variant]
    p, dof = chi_square_pvalue(pairs, expected)
    print(f"attention head, {variant}: chi-square p = {p:.3f} with {dof} dof over {N} generations")
    assert origins["head rounds"] >= N  # the head drafted every first round
    assert origins["accepted"] > 0.05 * N and origins["residual"] + origins["correction"] > 0.05 * N
    assert p >= P_THRESHOLD, f"chi-square p = {p:.2e} ({dof} dof): not the target's distribution"


@pytest.mark.slow
def test_the_attention_heads_tree_shortcut_fails_the_same_test(samples: dict[str, Sample],
                                                               expected: dict[tuple[int, int], float]) -> None:
    pairs, origins = samples["head_tree_shortcut"]
    p, dof = chi_square_pvalue(pairs, expected)
    print(f"attention head, tree shortcut (biased): chi-square p = {p:.2e} with {dof} dof over {N_BIASED_TREE} "
          "generations")
    assert origins["head rounds"] >= N_BIASED_TREE
    assert p < P_THRESHOLD, f"the biased variant passed (p = {p:.2e}, {dof} dof): the test has no power"

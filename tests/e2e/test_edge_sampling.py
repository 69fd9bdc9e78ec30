"""Sampling through the real cloud keeps the target's exact distribution (strict correction).

Test: Pearson chi-square goodness of fit of the first two generated tokens (t1, t2) over N = 400
generations with seeds 0..399, against the target's own sampling distribution
p(t1 | P) * p(t2 | P, t1), computed exactly from the target model with the shared processing
(temperature 1, top-k 5, repetition penalty 1.3, so t2's distribution depends on t1: 25 pairs, the
least likely 0.035, so no cell is pooled at N). Cells with an expected count below 5 are pooled into
one cell. Threshold: the test fails when the p-value is below 1e-3 (24 dof: statistic above 51.2).
Each generation drafts k = 2 tokens with the tiny random draft model, so the first two tokens go
through acceptance at positions 1 and 2, rejections at both, the residual (edge-drawn from the
cloud's target_dist, or cloud-drawn from the sent q_dists) and the bonus.

Token trees (shared/tree.py, draw and match): the same test over N generations that draft a tree of 6
nodes (width 3, depth 3) every round through the real cloud, and the tree rule's lossy shortcut variant
(children tried with min(1, p/q), then a draw from p) must fail it with N_BIASED_TREE = 200.

The attention head's variants of the same test: tests/research/e2e/test_head_sampling.py.

The draft on llama.cpp (edge/drafters/llamacpp.py, the tiny draft written as a GGUF file): the same test over N
generations drafting the 6-node trees, and its shortcut must fail it with N_BIASED_TREE: q comes from llama.cpp's
own logits, and the rule reads it as sent (its chains: tests/e2e/test_llamacpp_cloud.py).

Power, and why N = 400: the bias these tests target is the shortcut correction (corrections drawn from p). Its
chain variant is the hardest to see: over its 500 seeded generations (seeds 0..499, measured 2026-11-28) the
statistic was 154.5 on 24 dof (p = 4.9e-21), an effect w^2 = (X^2 - dof) / n = 0.26, so at N = 400 the
non-centrality is 104 and the test rejects it with probability 0.999995 (0.993 at the effect's two-sigma lower
bound, w^2 = 0.165; N = 300 would give 0.93 there). The tree shortcuts' effects are 14 times larger (w^2 = 3.7:
non-centrality 738 at 200 generations, power 1 - 3e-96), hence N_BIASED_TREE. The test checks the claim on
its own sample: the chain shortcut runs at the same N as the exact variants and must fail there, and the power
estimated from that sample (`power_at`) must be at least MIN_POWER = 0.99 at N. Split residual and q_dists draw
their residual with the same position-keyed uniform from the same distribution, so with equal seeds they give
the same tokens; the two tests are run separately all the same, each through its own path on the wire.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy.stats import chi2, ncx2

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from edge.states_hook import StatesDrafting
from shared.config import SamplingConfig
from shared.sampling import processed_probs
from tests.server import CloudProcess

N = 400
N_BIASED = N  # the chain shortcut, the weakest bias, fails at the exact variants' own N
N_BIASED_TREE = 200  # the tree shortcuts: effects 14 times the chain's
P_THRESHOLD = 1e-3
MIN_POWER = 0.99  # power at N against the chain shortcut's effect, estimated from its own sample
MIN_EXPECTED = 5.0
CFG = SamplingConfig(temperature=1.0, top_p=1.0, top_k=5, repetition_penalty=1.3)
PROMPT = "The quick brown fox"
# fixed trees of 6 nodes every round
TREE: dict[str, Any] = {"fixed_k": None, "tree": "6", "tree_width": 3, "tree_depth": 3}


@pytest.fixture(scope="module")
def expected(tiny_pair: tuple[Path, Path], tokenizer: Any) -> dict[tuple[int, int], float]:
    """The target's exact probability of every (t1, t2) pair after the prompt."""
    return exact_pair_probs(tiny_pair[0], tokenizer.encode(PROMPT), CFG)


def exact_pair_probs(model_dir: Path, ids: list[int], cfg: SamplingConfig) -> dict[tuple[int, int], float]:
    """The exact probability, under `cfg`'s processing, of every pair (t1, t2) the model at `model_dir`
    can sample after `ids`."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = {}
    with torch.no_grad():
        p1 = processed_probs(target(input_ids=torch.tensor([ids])).logits[0, -1:], cfg, ids)[0]  # [vocab]
        for t1 in p1.nonzero().squeeze(-1).tolist():
            ctx = ids + [t1]
            p2 = processed_probs(target(input_ids=torch.tensor([ctx])).logits[0, -1:], cfg, ctx)[0]  # [vocab]
            for t2 in p2.nonzero().squeeze(-1).tolist():
                out[(t1, t2)] = float(p1[t1]) * float(p2[t2])
    return out


def chi_square_pvalue(counts: Counter[tuple[int, int]], probs: dict[tuple[int, int], float]) -> tuple[float, int]:
    """Pearson chi-square p-value and degrees of freedom; cells expected below MIN_EXPECTED are pooled.

    Observed pairs the target gives probability 0 make the statistic infinite (p-value 0).
    """
    stat, dof = chi_square_statistic(counts, probs)
    return (0.0, 0) if stat == float("inf") else (float(chi2.sf(stat, dof)), dof)


def chi_square_statistic(counts: Counter[tuple[int, int]],
                         probs: dict[tuple[int, int], float]) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom (cells pooled as `chi_square_pvalue` says; inf and 0 when
    an observed pair has probability 0)."""
    n = sum(counts.values())
    if any(pair not in probs for pair in counts):
        return float("inf"), 0
    big = [c for c, p in probs.items() if n * p >= MIN_EXPECTED]
    cells = [(counts[c], n * probs[c]) for c in big]
    rest_obs = n - sum(o for o, _ in cells)
    rest_exp = n - sum(e for _, e in cells)
    if rest_exp >= MIN_EXPECTED:
        cells.append((rest_obs, rest_exp))
    elif cells:  # too little left to stand alone: fold it into the smallest cell
        i = min(range(len(cells)), key=lambda j: cells[j][1])
        cells[i] = (cells[i][0] + rest_obs, cells[i][1] + rest_exp)
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return float(stat), len(cells) - 1


def power_at(biased: Counter[tuple[int, int]], probs: dict[tuple[int, int], float], n: int) -> float:
    """The probability that the test at n generations rejects the law `biased` was drawn from.

    Under that law the statistic of m draws is a non-central chi-square with E[X^2] = dof + m w^2, so
    w^2 = (X^2 - dof) / m estimates the effect without bias; at n draws the non-centrality is n w^2 and the
    power P(ncx2(dof, n w^2) > chi2.isf(P_THRESHOLD, dof)). (The dof is the biased sample's pooling; at these
    sizes no cell is pooled.)
    """
    stat, dof = chi_square_statistic(biased, probs)
    if stat == float("inf"):
        return 1.0  # a pair of probability 0 fails the test at any size that draws it
    w2 = max(0.0, (stat - dof) / sum(biased.values()))
    return float(ncx2.sf(chi2.isf(P_THRESHOLD, dof), dof, n * w2)) if w2 > 0 else P_THRESHOLD


Sample = tuple[Counter[tuple[int, int]], Counter[str]]


def first_pairs(cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter, n: int,
                states_drafting: StatesDrafting | None = None, **kw: Any) -> Sample:
    """(t1, t2) counts and first-two-token origins of n seeded generations (seeds 0..n-1); the origins also
    count, under "head rounds", the rounds drafted from the cloud's states (`states_drafting`, edge/states_hook.py)."""
    values: dict[str, Any] = {
        "grpc_target": cloud.grpc_target, "temperature": CFG.temperature, "top_p": CFG.top_p, "top_k": CFG.top_k,
        "repetition_penalty": CFG.repetition_penalty, "max_new_tokens": 3, "fixed_k": 2, "stop_at_eos": False,
        "timeout_ms": 30_000, "timeout_fallback": False,
        "stream_switch": False,  # every position decided by a verify: the rule itself is sampled
        "node_budget": False, **kw}  # every round the shape named here (the budget's rounds: test_node_budget)
    s = EdgeSettings(**values)
    client = EdgeClient(s, drafter=drafter, tokenizer=tokenizer, states_drafting=states_drafting)
    ids = tokenizer.encode(PROMPT)
    pairs: Counter[tuple[int, int]] = Counter()
    origins: Counter[str] = Counter()
    for seed in range(n):
        first_two = []
        gen = client.stream(ids, seed=seed)
        for tok in gen:
            first_two.append(tok)
            if len(first_two) == 2:
                break
        gen.close()  # closes the session: no third round
        origins["head rounds"] += gen.result().metrics.head_rounds
        pairs[(first_two[0].token_id, first_two[1].token_id)] += 1
        origins.update(t.origin for t in first_two)
        assert "local" not in origins
    client.close()
    return pairs, origins


@pytest.fixture(scope="module")
def samples(cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter, gguf_drafter: Any) -> dict[str, Sample]:
    """Every variant, generated concurrently (one drafter fork each) against one cloud; the gguf variants draft on
    llama.cpp."""
    variants: dict[str, tuple[int, dict[str, Any]]] = {
        "split_residual": (N, {}), "q_dists": (N, {"send_q_dists": True}),
        "shortcut": (N_BIASED, {"correction": "shortcut"}), "tree": (N, TREE),
        "tree_shortcut": (N_BIASED_TREE, {**TREE, "correction": "shortcut"}),
        "gguf_tree": (N, TREE), "gguf_shortcut": (N_BIASED_TREE, {**TREE, "correction": "shortcut"})}
    with ThreadPoolExecutor(len(variants)) as pool:
        futures = {name: pool.submit(first_pairs, cloud, tokenizer,
                                     (gguf_drafter if name.startswith("gguf") else drafter).fork(), n, **kw)
                   for name, (n, kw) in variants.items()}
        return {name: f.result() for name, f in futures.items()}


def test_pooling_keeps_every_sample_and_flags_impossible_pairs() -> None:
    probs = {(1, 1): 0.5, (1, 2): 0.49, (2, 2): 0.006, (2, 3): 0.004}
    counts = Counter({(1, 1): 500, (1, 2): 490, (2, 2): 6, (2, 3): 4})
    p, dof = chi_square_pvalue(counts, probs)
    assert dof == 2 and p > 0.5  # the two rare cells pooled into one
    assert chi_square_pvalue(Counter({(9, 9): 1, **counts}), probs)[0] == 0.0


@pytest.mark.slow
def test_split_residual_matches_target_sampling(samples: dict[str, Sample],
                                                expected: dict[tuple[int, int], float]) -> None:
    pairs, origins = samples["split_residual"]
    p, dof = chi_square_pvalue(pairs, expected)
    print(f"split residual: chi-square p = {p:.3f} with {dof} dof over {N} generations")
    assert origins["residual"] > 0.2 * N and origins["accepted"] > 0.05 * N  # every path was taken
    assert p >= P_THRESHOLD, f"chi-square p = {p:.2e} ({dof} dof): not the target's distribution"


@pytest.mark.slow
def test_q_dists_match_target_sampling(samples: dict[str, Sample], expected: dict[tuple[int, int], float]) -> None:
    pairs, origins = samples["q_dists"]
    p, dof = chi_square_pvalue(pairs, expected)
    print(f"q_dists: chi-square p = {p:.3f} with {dof} dof over {N} generations")
    assert origins["residual"] == 0 and origins["correction"] > 0.2 * N  # the cloud drew the residual
    assert p >= P_THRESHOLD, f"chi-square p = {p:.2e} ({dof} dof): not the target's distribution"


@pytest.mark.slow
def test_biased_shortcut_fails_the_same_test(samples: dict[str, Sample],
                                             expected: dict[tuple[int, int], float]) -> None:
    pairs, _ = samples["shortcut"]
    p, dof = chi_square_pvalue(pairs, expected)
    power = power_at(pairs, expected, N)
    print(f"shortcut (biased): chi-square p = {p:.2e} with {dof} dof over {N_BIASED} generations; power at N = {N}: "
          f"{power:.6f}")
    assert p < P_THRESHOLD, f"the biased variant passed (p = {p:.2e}, {dof} dof): the test has no power"
    assert power >= MIN_POWER, f"N = {N} detects the shortcut with probability {power:.3f} only"


@pytest.mark.slow
def test_token_trees_match_target_sampling(samples: dict[str, Sample],
                                           expected: dict[tuple[int, int], float]) -> None:
    pairs, origins = samples["tree"]
    p, dof = chi_square_pvalue(pairs, expected)
    print(f"trees: chi-square p = {p:.3f} with {dof} dof over {N} generations")
    assert origins["accepted"] > 0.05 * N and origins["correction"] > 0.05 * N  # nodes matched and missed
    assert p >= P_THRESHOLD, f"chi-square p = {p:.2e} ({dof} dof): not the target's distribution"


@pytest.mark.slow
def test_the_tree_shortcut_fails_the_same_test(samples: dict[str, Sample],
                                               expected: dict[tuple[int, int], float]) -> None:
    pairs, _ = samples["tree_shortcut"]
    p, dof = chi_square_pvalue(pairs, expected)
    print(f"tree shortcut (biased): chi-square p = {p:.2e} with {dof} dof over {N_BIASED_TREE} generations")
    assert p < P_THRESHOLD, f"the biased tree variant passed (p = {p:.2e}, {dof} dof): the test has no power"


def assert_target_sampling(label: str, sample: Sample, expected: dict[tuple[int, int], float], n: int) -> None:
    """The sample passes the chi-square test (p >= P_THRESHOLD) and took both ways: nodes accepted and missed."""
    pairs, origins = sample
    p, dof = chi_square_pvalue(pairs, expected)
    print(f"{label}: chi-square p = {p:.3f} with {dof} dof over {n} generations")
    assert origins["accepted"] > 0.05 * n and origins["residual"] + origins["correction"] > 0.05 * n
    assert p >= P_THRESHOLD, f"chi-square p = {p:.2e} ({dof} dof): not the target's distribution"


def assert_biased_fails(label: str, sample: Sample, expected: dict[tuple[int, int], float], n: int) -> None:
    """A biased variant's sample fails the same test (the test has power)."""
    p, dof = chi_square_pvalue(sample[0], expected)
    print(f"{label} (biased): chi-square p = {p:.2e} with {dof} dof over {n} generations")
    assert p < P_THRESHOLD, f"the biased variant passed (p = {p:.2e}, {dof} dof): the test has no power"


@pytest.mark.slow
def test_the_llamacpp_draft_keeps_target_sampling(samples: dict[str, Sample],
                                                  expected: dict[tuple[int, int], float]) -> None:
    assert_target_sampling("llama.cpp draft, trees", samples["gguf_tree"], expected, N)


@pytest.mark.slow
def test_the_llamacpp_drafts_shortcut_fails_the_same_test(samples: dict[str, Sample],
                                                          expected: dict[tuple[int, int], float]) -> None:
    assert_biased_fails("llama.cpp draft, tree shortcut", samples["gguf_shortcut"], expected, N_BIASED_TREE)

"""The cloud on its llama.cpp runner (cloud/runners/llamacpp.py): a real specsplit-cloud serving the tiny target as a
GGUF file, with the PyTorch draft and the llama.cpp draft.

Greedy: for 20 prompts, speculative text (trees and chains, each draft) equals the cloud's own target-only greedy
text (POST /v1/generate on the same runner). llama.cpp's logits move with the batch around a token (1e-4 on these
float32 weights: not batch-invariant, and /v1/model says so), so a divergence is accepted only where the target's
two candidates are within TIE_TOL of each other in the float64 transformers forward of the same weights.

Sampling: Pearson chi-square goodness of fit of the first two generated tokens (t1, t2) over N = 400 seeded
generations (seeds 0..399) against the target's exact distribution (tests/e2e/test_edge_sampling.py: temperature 1,
top-k 5, repetition penalty 1.3; cells expected below 5 pooled), chains of k = 2 and trees of 6 nodes; threshold
p >= 1e-3. The biased tree shortcut (corrections drawn from p) must fail it with N_BIASED_TREE = 200. Power, as
tests/e2e/test_edge_sampling.py measures it: at N = 400 the test rejects the chain shortcut's effect (w^2 = 0.26)
with probability 0.999995, the tree shortcut's (w^2 = 3.7) at 200 with 1 - 3e-96. The exact distribution comes
from transformers' float32 forward of the GGUF's weights: llama.cpp's logits differ by ~1e-4, far below what N =
400 samples can see.

Sessions at once: eight greedy sessions in one cloud (rows of several sessions share llama.cpp batches, trees
among them) give each its solo text.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge.client import EdgeClient
from edge.settings import EdgeSettings
from tests.e2e.test_edge_greedy import PROMPTS, assert_equal_or_tie
from tests.e2e.test_edge_sampling import (
    CFG,
    N_BIASED_TREE,
    PROMPT,
    TREE,
    N,
    assert_biased_fails,
    assert_target_sampling,
    first_pairs,
)
from tests.server import CloudProcess
from tests.tiny_gguf import write_gguf

N_NEW = 20
TIE_TOL = 5e-3


@pytest.fixture(scope="module")
def gguf_target(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf_target")
    for f in tiny_pair[0].iterdir():
        if f.name.startswith("tokenizer"):
            (out / f.name).write_bytes(f.read_bytes())
    return write_gguf(tiny_pair[0], out / "model.gguf")


@pytest.fixture(scope="module")
def llama_cloud(gguf_target: Path) -> Iterator[CloudProcess]:
    with CloudProcess(gguf_target, extra_args=["--runner", "llamacpp", "--torch-threads", "1"]) as c:
        yield c


@pytest.fixture(scope="module")
def target(tiny_pair: tuple[Path, Path]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()


def settings(cloud: CloudProcess, **kw: Any) -> EdgeSettings:
    values: dict[str, Any] = {"cloud_url": cloud.http_url, "temperature": 0, "repetition_penalty": 1.1,
                              "max_new_tokens": N_NEW, "timeout_ms": 30_000, "timeout_fallback": False, **kw}
    return EdgeSettings(**values)


def test_model_info_names_the_runner(llama_cloud: CloudProcess, tiny_pair: tuple[Path, Path]) -> None:
    info = httpx.get(f"{llama_cloud.http_url}/v1/model").json()
    assert info["runner"] == "llama.cpp" and info["batch_invariant"] is False and info["dtype"] == "gguf"
    assert info["max_tree_nodes"] > 0 and info["feature_size"] == 0
    from shared.tokenizer_id import directory_fingerprint

    assert info["tokenizer_fingerprint"] == directory_fingerprint(tiny_pair[0])


@pytest.mark.parametrize("kind", ["model", "model-chain", "gguf", "gguf-chain"])
def test_greedy_speculative_equals_the_llamacpp_clouds_own_greedy(llama_cloud: CloudProcess, tokenizer: Any,
                                                                  target: Any, drafter: Any, gguf_drafter: Any,
                                                                  kind: str) -> None:
    # verify rounds throughout (speculate-or-stream would stream where the tiny draft cannot pay)
    s = settings(llama_cloud, tree="off" if kind.endswith("-chain") else "auto", stream_switch=False)
    reference = EdgeClient(s.model_copy(update={"mode": "cloud_only"}), tokenizer=tokenizer)
    d = drafter if kind.startswith("model") else gguf_drafter
    accepted = 0
    for prompt in PROMPTS:
        spec = EdgeClient(s, drafter=d, tokenizer=tokenizer).generate(prompt)
        assert (spec.metrics.tree_rounds > 0) == (not kind.endswith("-chain"))
        ref = reference.generate(prompt)
        assert len(ref.token_ids) == N_NEW
        import tests.e2e.test_edge_greedy as greedy

        old, greedy.TIE_TOL = greedy.TIE_TOL, TIE_TOL
        try:
            assert_equal_or_tie(spec.token_ids, ref.token_ids, spec.prompt_ids, target, s.sampling())
        finally:
            greedy.TIE_TOL = old
        accepted += spec.metrics.accepted
    assert accepted > 0


def test_eight_sessions_at_once_keep_their_solo_texts(llama_cloud: CloudProcess, tokenizer: Any,
                                                      gguf_drafter: Any) -> None:
    s = settings(llama_cloud, stream_switch=False)
    solo = [EdgeClient(s, drafter=gguf_drafter.fork(), tokenizer=tokenizer).generate(p).token_ids
            for p in PROMPTS[:8]]

    def one(i: int) -> list[int]:
        return list(EdgeClient(s, drafter=gguf_drafter.fork(), tokenizer=tokenizer).generate(PROMPTS[i]).token_ids)

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, range(8)))
    same = sum(a == list(b) for a, b in zip(together, solo, strict=True))
    assert same >= 7, f"{same} of 8 sessions kept their solo text"  # a near-tie may move one (not invariant)


@pytest.fixture(scope="module")
def llama_samples(llama_cloud: CloudProcess, tokenizer: Any, gguf_drafter: Any) -> dict[str, Any]:
    variants: dict[str, tuple[int, dict[str, Any]]] = {
        "chain": (N, {}), "tree": (N, TREE), "shortcut": (N_BIASED_TREE, {**TREE, "correction": "shortcut"})}
    with ThreadPoolExecutor(len(variants)) as pool:
        futures = {name: pool.submit(first_pairs, llama_cloud, tokenizer, gguf_drafter.fork(), n,
                                     **kw)
                   for name, (n, kw) in variants.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["chain", "tree"])
def test_the_llamacpp_cloud_keeps_target_sampling(llama_samples: dict[str, Any],
                                                  expected: dict[tuple[int, int], float], variant: str) -> None:
    assert_target_sampling(f"llama.cpp cloud, {variant}", llama_samples[variant], expected, N)


@pytest.mark.slow
def test_the_shortcut_fails_the_same_test_on_the_llamacpp_cloud(llama_samples: dict[str, Any],
                                                                expected: dict[tuple[int, int], float]) -> None:
    assert_biased_fails("llama.cpp cloud, shortcut", llama_samples["shortcut"], expected, N_BIASED_TREE)


@pytest.fixture(scope="module")
def expected(tiny_pair: tuple[Path, Path], tokenizer: Any) -> dict[tuple[int, int], float]:
    from tests.e2e.test_edge_sampling import exact_pair_probs

    return exact_pair_probs(tiny_pair[0], tokenizer.encode(PROMPT), CFG)

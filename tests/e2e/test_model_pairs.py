"""Pairing by tokenizer: draft and target may have embedding tables of different sizes.

Models of one family often share a tokenizer while padding their embedding tables differently
(Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064). Here one model of the pair has 64 rows past
the tokenizer's 4,096 ids, and those rows are made to win the argmax (its final layer norm writes a
constant into one hidden unit that only the padding rows read), so any path that lets them through
emits ids outside the tokenizer. Greedy text must equal the target's greedy text over the tokenizer's
ids, in both directions (target larger, draft larger), over REST and gRPC.

Sampling with the padded target: Pearson chi-square of the first two tokens over N = 400 seeded
generations against the padded target's exact distribution over the tokenizer's ids (temperature 1,
top-k 5, repetition penalty 1.3), cells expected below 5 pooled; fails when p < 1e-3. Power: the
biased shortcut correction over the same N generations must fail the same threshold, and the power at N
estimated from that sample (tests/e2e/test_edge_sampling.py's `power_at`) must be at least 0.99 (measured
2026-11-28 from 300 shortcut generations: p = 3.5e-8, w^2 = 0.19, power 0.9989 at N = 400). The two samples are
drawn concurrently against the one cloud.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from shared.errors import InvalidArgument
from shared.sampling import processed_probs
from tests.conftest import DEMO_TARGET
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

PAD = 64
N_NEW = 12
N = 400
N_BIASED = N
PROMPTS = ["def add(a, b):\n    return a + b\n", "The river that runs through the old town"]


def build_padded(out_dir: Path, n_layer: int, n_embd: int, seed: int) -> Path:
    """A tiny GPT-2 with PAD embedding rows past the demo tokenizer's ids, and those rows on top."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    v = len(tok)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=v + PAD, n_positions=256, n_embd=n_embd, n_layer=n_layer, n_head=2,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        wte = model.transformer.wte.weight  # [v + PAD, n_embd], tied to the output
        wte[:v, 0] = 0.0
        wte[v:, 0] = 1.0
        model.transformer.ln_f.weight[0] = 0.0
        model.transformer.ln_f.bias[0] = 20.0  # hidden unit 0 is 20 at every position: padding logits + 20
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def padded_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_padded(tmp_path_factory.mktemp("padded") / "target", 2, 64, seed=1)


@pytest.fixture(scope="module")
def padded_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_padded(tmp_path_factory.mktemp("padded") / "draft", 1, 32, seed=2)


@pytest.fixture(scope="module")
def padded_cloud(padded_target: Path) -> Iterator[CloudProcess]:
    with CloudProcess(padded_target) as cloud:
        yield cloud


def target_greedy(model_dir: Path, ids: list[int], n: int, support: int | None) -> list[int]:
    """Greedy decoding of the target over its first `support` ids (all rows when None)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([out])).logits[0, -1]  # [rows]
            out.append(int(logits[:support].argmax()))
    return out[len(ids):]


def greedy(cloud: CloudProcess, transport: str, draft: Any, tokenizer: Any, prompt: str) -> list[int]:
    where = {"cloud_url": cloud.http_url} if transport == "rest" else {"grpc_target": cloud.grpc_target}
    s = EdgeSettings(**where, temperature=0, repetition_penalty=1.0, max_new_tokens=N_NEW, fixed_k=4,
                     stop_at_eos=False)
    client = EdgeClient(s, drafter=draft, tokenizer=tokenizer)
    try:
        return client.generate(prompt).token_ids
    finally:
        client.close()


def test_model_info_says_both_numbers(padded_cloud: CloudProcess, tokenizer: Any) -> None:
    info = httpx.get(padded_cloud.http_url + "/v1/model").json()
    assert (info["vocab_size"], info["tokenizer_size"]) == (len(tokenizer) + PAD, len(tokenizer))


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_target_larger_than_the_draft_gives_the_targets_greedy_text(
        padded_cloud: CloudProcess, padded_target: Path, drafter: ModelDrafter, tokenizer: Any,
        transport: str) -> None:
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        expected = target_greedy(padded_target, ids, N_NEW, len(tokenizer))
        assert max(target_greedy(padded_target, ids, 1, None)) >= len(tokenizer)  # padding would win unmasked
        out = greedy(padded_cloud, transport, drafter.fork(), tokenizer, prompt)
        assert out == expected and max(out) < len(tokenizer)


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_draft_larger_than_the_target_gives_the_targets_greedy_text(
        tiny_cloud_server: CloudProcess, tiny_pair: tuple[Path, Path], padded_draft: Path, tokenizer: Any,
        transport: str) -> None:
    draft = ModelDrafter(padded_draft)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        out = greedy(tiny_cloud_server, transport, draft, tokenizer, prompt)
        assert out == target_greedy(tiny_pair[0], ids, N_NEW, None) and max(out) < len(tokenizer)


def test_a_draft_with_another_tokenizer_is_still_refused(padded_cloud: CloudProcess, tmp_path: Path,
                                                         padded_draft: Path, tokenizer: Any) -> None:
    import shutil

    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(padded_draft, other)
    theirs = AutoTokenizer.from_pretrained(other)
    theirs.add_tokens(["<an id of its own>"])  # one more id: another tokenizer, within the draft's rows
    theirs.save_pretrained(other)
    with pytest.raises(InvalidArgument, match="tokenizer"):
        greedy(padded_cloud, "rest", ModelDrafter(other), tokenizer, PROMPTS[0])


@pytest.fixture(scope="module")
def expected_padded(padded_target: Path, tokenizer: Any) -> dict[tuple[int, int], float]:
    """The padded target's exact probability of every (t1, t2) over the tokenizer's ids."""
    from transformers import AutoModelForCausalLM

    v = len(tokenizer)
    target = AutoModelForCausalLM.from_pretrained(padded_target).eval()
    ids = tokenizer.encode(PROMPT)
    out = {}
    with torch.no_grad():
        p1 = processed_probs(target(input_ids=torch.tensor([ids])).logits[0, -1:, :v], CFG, ids)[0]  # [v]
        for t1 in p1.nonzero().squeeze(-1).tolist():
            ctx = ids + [t1]
            p2 = processed_probs(target(input_ids=torch.tensor([ctx])).logits[0, -1:, :v], CFG, ctx)[0]  # [v]
            for t2 in p2.nonzero().squeeze(-1).tolist():
                out[(t1, t2)] = float(p1[t1]) * float(p2[t2])
    return out


def test_sampling_with_a_padded_target_keeps_its_distribution(
        padded_cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter,
        expected_padded: dict[tuple[int, int], float]) -> None:
    with ThreadPoolExecutor(2) as pool:
        exact = pool.submit(first_pairs, padded_cloud, tokenizer, drafter.fork(), N)
        shortcut = pool.submit(first_pairs, padded_cloud, tokenizer, drafter.fork(), N_BIASED, correction="shortcut")
        (pairs, origins), (biased, _) = exact.result(), shortcut.result()
    p, dof = chi_square_pvalue(pairs, expected_padded)
    print(f"padded target: chi-square p = {p:.3f} with {dof} dof over {N} generations; origins {dict(origins)}")
    assert p >= P_THRESHOLD, f"chi-square p = {p:.2e} ({dof} dof): not the target's distribution"
    p_biased, dof = chi_square_pvalue(biased, expected_padded)
    power = power_at(biased, expected_padded, N)
    print(f"padded target, shortcut (biased): chi-square p = {p_biased:.2e} with {dof} dof over {N_BIASED}; "
          f"power at N: {power:.6f}")
    assert p_biased < P_THRESHOLD, "the biased variant passed: the test has no power"
    assert power >= MIN_POWER, f"N = {N} detects the shortcut with probability {power:.3f} only"

"""The real default pair end to end: SmolLM2-135M-Instruct verifies its drafts' guesses.

`scripts/setup.sh` converts the target into models/smollm2-135m-instruct (so CI has it); the drafts
models/smollm2-135m-draft (distilled) and models/smollm2-135m-draft-from-target (cut from the target) are
committed. For a chat prompt sent through the tokenizer's template, the greedy speculative text (each
tokens-only draft and the n-gram drafter, over REST and gRPC) must equal the
target's own greedy text (the cloud's POST /v1/generate) over 64 tokens, token for token, with no
token committed unverified. A divergence is accepted only where the target's two candidates are a
float tie (see test_edge_greedy.assert_equal_or_tie).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter, NGramDrafter
from edge.settings import EdgeSettings
from tests.e2e.test_edge_greedy import assert_equal_or_tie
from tests.server import CloudProcess

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "smollm2-135m-instruct"
DRAFT = REPO / "models" / "smollm2-135m-draft"
CUT = REPO / "models" / "smollm2-135m-draft-from-target"
N_NEW = 64
QUESTION = "Write a Python function that returns the n-th Fibonacci number."

if not (TARGET / "model.safetensors").is_file():
    if os.environ.get("CI"):
        raise RuntimeError(f"{TARGET} is missing: scripts/setup.sh should have made it (specsplit-models prepare smollm2)")
    pytest.skip("the real target is not prepared here: run `specsplit-models prepare smollm2`",
                allow_module_level=True)


@pytest.fixture(scope="module")
def real_cloud() -> Iterator[CloudProcess]:
    with CloudProcess(TARGET, startup_timeout_s=180, extra_args=("--runner", "torch")) as cloud:
        yield cloud


@pytest.fixture(scope="module")
def real_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def references(real_cloud: CloudProcess, real_tokenizer: Any) -> dict[str, Any]:
    """The target's own greedy answer to QUESTION (cloud_only: POST /v1/generate), computed once."""
    client = EdgeClient(settings(real_cloud, "rest", mode="cloud_only"), tokenizer=real_tokenizer)
    return {"result": client.generate(chat(real_tokenizer, QUESTION))}


def chat(tokenizer: Any, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def settings(cloud: CloudProcess, transport: str, **kw: Any) -> EdgeSettings:
    where = {"cloud_url": cloud.http_url} if transport == "rest" else {"grpc_target": cloud.grpc_target}
    values: dict[str, Any] = {"temperature": 0, "max_new_tokens": N_NEW, "timeout_ms": 60_000,
                              "timeout_fallback": False, **where, **kw}
    return EdgeSettings(**values)


@pytest.mark.parametrize("transport", ["rest", "grpc"])
@pytest.mark.parametrize("kind", ["model", "cut", "ngram"])
def test_real_pair_greedy_speculative_equals_the_target(real_cloud: CloudProcess, real_tokenizer: Any,
                                                        references: dict[str, Any], kind: str,
                                                        transport: str) -> None:
    """kind "model": the distilled draft; "cut": the tokens-only draft cut from the target (a compact directory);
    "ngram": the n-gram drafter (the heads fed the target's states: tests/research/e2e/test_real_pair_heads.py)."""
    if kind == "cut" and not CUT.is_dir():
        raise RuntimeError(f"{CUT} is missing: it is committed with the repository")
    tokens_only = DRAFT if kind == "model" else CUT
    s = settings(real_cloud, transport, draft=str(tokens_only))
    drafter = NGramDrafter(order=4) if kind == "ngram" else ModelDrafter(tokens_only)
    spec = EdgeClient(s, drafter=drafter, tokenizer=real_tokenizer).generate(chat(real_tokenizer, QUESTION))
    check_greedy(spec, references["result"], s)
    if kind != "ngram":  # a trained draft: some of its guesses are kept
        assert spec.metrics.accepted > 0


def check_greedy(spec: Any, ref: Any, s: EdgeSettings) -> None:
    """The speculative text is the target's over all N_NEW tokens (or differs at a float tie), none unverified."""
    from transformers import AutoModelForCausalLM

    assert len(ref.token_ids) == N_NEW  # the answer is longer than 64 tokens: all 64 are compared
    if spec.token_ids != ref.token_ids:  # only then is the target loaded here, to tell a float tie
        target = AutoModelForCausalLM.from_pretrained(TARGET).eval()
        assert_equal_or_tie(spec.token_ids, ref.token_ids, spec.prompt_ids, target, s.sampling())
    assert spec.metrics.local_commits == 0 and spec.metrics.verify_calls >= 1


def test_real_target_split_over_three_ranks_gives_the_same_text(real_tokenizer: Any,
                                                                references: dict[str, Any]) -> None:
    """SmolLM2-135M-Instruct under `torchrun --nproc-per-node 3` (9 attention heads and 3 KV heads split
    3 ways): the cut draft's greedy speculative text over REST equals the one-process target's
    own over 64 tokens, and no rank holds more than a third of the weights plus 10 % (each rank's
    `rank_memory` log line against the size of model.safetensors)."""
    import httpx

    from bench.tensor_parallel import rank_memory
    from tests.e2e.test_tensor_parallel import TorchrunCloud

    with TorchrunCloud(TARGET, 3) as three:
        assert httpx.get(three.http_url + "/v1/model").json()["tensor_parallel"] == 3
        s = settings(three, "rest", draft=str(CUT))
        spec = EdgeClient(s, drafter=ModelDrafter(CUT), tokenizer=real_tokenizer).generate(
            chat(real_tokenizer, QUESTION))
        memory = rank_memory(three.log_path.read_text(errors="replace"))
    ref = references["result"]
    if spec.token_ids != ref.token_ids:  # only then is the target loaded here, to tell a float tie
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(TARGET).eval()
        assert_equal_or_tie(spec.token_ids, ref.token_ids, spec.prompt_ids, target, s.sampling())
    assert spec.metrics.local_commits == 0 and spec.metrics.accepted > 0
    whole = (TARGET / "model.safetensors").stat().st_size  # float32 weights and a small header
    assert sorted(memory) == [0, 1, 2], memory
    assert all(m["weight_bytes"] <= (1 / 3 + 0.1) * whole for m in memory.values()), (memory, whole)

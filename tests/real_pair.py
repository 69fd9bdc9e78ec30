"""The real SmolLM2 pair for end-to-end tests: one SmolLM2-135M-Instruct cloud for the whole session.

tests/e2e/test_real_pair.py and tests/research/e2e/test_real_pair_heads.py both verify against it, so the
cloud (about half a minute to start on a 2-core CPU, its start-up probe included) and the target's own greedy
answer are made once. A plugin of the root conftest (`pytest_plugins`), so its session fixtures have one
instance. A module calls `require_target()` first: it skips where the target is not prepared (raises under CI,
where scripts/setup.sh makes it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "models" / "smollm2-135m-instruct"
DRAFT = REPO / "models" / "smollm2-135m-draft"
CUT = REPO / "models" / "smollm2-135m-draft-from-target"
N_NEW = 64
QUESTION = "Write a Python function that returns the n-th Fibonacci number."


def require_target() -> None:
    """Skip the calling module where the real target is not prepared (an error under CI)."""
    if not (TARGET / "model.safetensors").is_file():
        if os.environ.get("CI"):
            raise RuntimeError(f"{TARGET} is missing: scripts/setup.sh should have made it "
                               "(specsplit-models prepare smollm2)")
        pytest.skip("the real target is not prepared here: run `specsplit-models prepare smollm2`",
                    allow_module_level=True)


@pytest.fixture(scope="session")
def real_cloud() -> Iterator[Any]:
    from tests.server import CloudProcess

    with CloudProcess(TARGET, startup_timeout_s=180, extra_args=("--runner", "torch")) as cloud:
        yield cloud


@pytest.fixture(scope="session")
def real_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="session")
def references(real_cloud: Any, real_tokenizer: Any) -> dict[str, Any]:
    """The target's own greedy answer to QUESTION (cloud_only: POST /v1/generate), computed once."""
    from edge.client import EdgeClient

    client = EdgeClient(settings(real_cloud, "rest", mode="cloud_only"), tokenizer=real_tokenizer)
    return {"result": client.generate(chat(real_tokenizer, QUESTION))}


def chat(tokenizer: Any, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def settings(cloud: Any, transport: str, **kw: Any) -> Any:
    from edge.settings import EdgeSettings

    where = {"cloud_url": cloud.http_url} if transport == "rest" else {"grpc_target": cloud.grpc_target}
    values: dict[str, Any] = {"temperature": 0, "max_new_tokens": N_NEW, "timeout_ms": 60_000,
                              "timeout_fallback": False, **where, **kw}
    return EdgeSettings(**values)


def check_greedy(spec: Any, ref: Any, s: Any) -> None:
    """The speculative text is the target's over all N_NEW tokens (or differs at a float tie), none unverified."""
    from transformers import AutoModelForCausalLM

    from tests.e2e.test_edge_greedy import assert_equal_or_tie

    assert len(ref.token_ids) == N_NEW  # the answer is longer than 64 tokens: all 64 are compared
    if spec.token_ids != ref.token_ids:  # only then is the target loaded here, to tell a float tie
        target = AutoModelForCausalLM.from_pretrained(TARGET).eval()
        assert_equal_or_tie(spec.token_ids, ref.token_ids, spec.prompt_ids, target, s.sampling())
    assert spec.metrics.local_commits == 0 and spec.metrics.verify_calls >= 1

"""Drafting fixtures: a tiny random Llama target, answer shards it wrote greedily, and their states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from drafting.shards import shard_path, write_shard
from tests.tiny_models import build

WINDOW = 8  # the heads' window in these tests (prompts are longer, so the state range starts inside them)
HELDOUT_EVERY = 3  # shard 0 is held out, shards 1 and 2 train


def greedy_rows(model: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` rows of a random prompt (10-15 ids) and the model's plain greedy answer (12-20 ids)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(5, model.config.vocab_size, (int(torch.randint(10, 16, (1,), generator=gen)),),
                            generator=gen).tolist()
        prompt_len = len(ids)
        for _ in range(int(torch.randint(12, 21, (1,), generator=gen))):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        rows.append({"prompt_len": prompt_len, "ids": ids, "temperature": 0.0})
    return rows


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("drafting") / "target", seed=3)


@pytest.fixture(scope="session")
def tiny_model(tiny_target: Path) -> Any:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory, tiny_model: Any) -> Path:
    """A data root with three answers shards of 6 greedy rows each."""
    root = tmp_path_factory.mktemp("data")
    with torch.no_grad():
        for i in range(3):
            write_shard(shard_path(root, "answers", i), greedy_rows(tiny_model, 6, seed=i))
    return root


@pytest.fixture(scope="session")
def tiny_work(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path, tiny_model: Any) -> Path:
    """A work directory holding the states of every tiny answers shard."""
    from drafting.states import make_states
    work = tmp_path_factory.mktemp("work")
    make_states(work, tiny_data, tiny_model, WINDOW, batch=4)
    return work

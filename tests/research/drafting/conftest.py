"""Drafting fixtures: a tiny random Llama target, answer shards it wrote greedily, and their states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from research.drafting.shards import shard_path, write_shard
from tests.tiny_models import build

WINDOW = 8  # the heads' window in these tests (prompts are longer, so the state range starts inside them)
HELDOUT_EVERY = 3  # shard 0 is held out, shards 1 and 2 train


def greedy_rows(model: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` rows of a random 12-id prompt and the model's plain greedy answer (12-20 ids), decoded together."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, model.config.vocab_size, (n, 12), generator=gen)  # [n, 12]
    for _ in range(20):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)  # [n, t + 1]
    keep = torch.randint(24, 33, (n,), generator=gen)  # [n] row lengths
    return [{"prompt_len": 12, "ids": r[:m].tolist(), "temperature": 0.0} for r, m in zip(ids, keep.tolist(), strict=True)]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose final norm is scaled by 8: its next-token distributions are peaked
    (entropy about 8.2 nats of 8.3 without it), so a head has something to learn in a few steps."""
    from transformers import AutoModelForCausalLM
    out = build("llama", tmp_path_factory.mktemp("drafting") / "target", seed=3)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_target: Path) -> Any:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory, tiny_model: Any) -> Path:
    """A data root with three answers shards of 6 greedy rows each."""
    root = tmp_path_factory.mktemp("data")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: a second thread only waits on a busy machine
    with torch.no_grad():
        rows = greedy_rows(tiny_model, 18, seed=0)
    torch.set_num_threads(threads)
    for i in range(3):
        write_shard(shard_path(root, "answers", i), rows[6 * i:6 * i + 6])
    return root


@pytest.fixture(scope="session")
def tiny_work(tmp_path_factory: pytest.TempPathFactory, tiny_data: Path, tiny_model: Any) -> Path:
    """A work directory holding the states of every tiny answers shard."""
    from research.drafting.states import make_states
    work = tmp_path_factory.mktemp("work")
    make_states(work, tiny_data, tiny_model, WINDOW, batch=4)
    return work

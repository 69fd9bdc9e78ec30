"""The target's teacher-forced states and the frequency-ranked output rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from research.drafting.shards import read_shard, shard_path
from research.drafting.states import (
    coverage,
    frequent_ids,
    is_heldout,
    load_states,
    make_states,
    output_ids,
    state_start,
    states_path,
)
from tests.research.drafting.conftest import HELDOUT_EVERY, WINDOW


def test_states_match_a_direct_forward_of_each_row(tiny_work: Path, tiny_data: Path, tiny_model: Any) -> None:
    for i in range(3):
        rows = read_shard(shard_path(tiny_data, "answers", i))
        got = load_states(states_path(tiny_work, i))
        assert len(got) == len(rows)
        for row, st in zip(rows, got, strict=True):
            n = len(row["ids"])
            start = state_start(row["prompt_len"], WINDOW)
            assert st["start"] == start > 0 and st["ids"].tolist() == row["ids"]
            with torch.no_grad():
                want = tiny_model.base_model(torch.tensor([row["ids"]])).last_hidden_state[0]  # [n, d]
            assert st["states"].dtype == torch.float16 and st["states"].shape == (n - 1 - start, 64)
            torch.testing.assert_close(st["states"].float(), want[start:n - 1], atol=2e-2, rtol=2e-3)
            # the stored state is the output layer's input: its logits are the target's
            logits = tiny_model.lm_head(st["states"][-1].float())
            assert int(logits.argmax()) == int(tiny_model(torch.tensor([row["ids"][:-1]])).logits[0, -1].argmax())


def test_states_skip_shards_already_done(tiny_work: Path, tiny_data: Path, tiny_model: Any) -> None:
    assert make_states(tiny_work, tiny_data, tiny_model, WINDOW, batch=4) == []


def test_frequent_ids_rank_by_count_then_by_id() -> None:
    rows = [{"prompt_len": 2, "ids": [7, 7, 3, 3, 3, 5, 9]}, {"prompt_len": 1, "ids": [1, 5, 9, 9]}]
    ids = frequent_ids(rows, vocab=10, n_out=5)  # answers: 3 x3, 9 x3, 5 x2, then unseen 0, 1, ... by id
    assert ids.tolist() == [3, 9, 5, 0, 1]
    assert coverage(ids, rows) == 1.0
    assert coverage(torch.tensor([3]), rows) == 3 / 8


def test_output_ids_count_training_shards_once(tiny_data: Path, tmp_path: Path) -> None:
    res = output_ids(tmp_path, tiny_data, 4096, 64, HELDOUT_EVERY)
    assert res["shards"] == [1, 2] and is_heldout(0, HELDOUT_EVERY) and len(res["ids"]) == 64
    train = [r for i in (1, 2) for r in read_shard(shard_path(tiny_data, "answers", i))]
    assert res["ids"] == frequent_ids(train, 4096, 64).tolist()
    assert 0 < res["coverage_heldout"] <= res["coverage_train"] <= 1
    assert output_ids(tmp_path, tiny_data, 4096, 64, HELDOUT_EVERY) == res  # read back, not recounted

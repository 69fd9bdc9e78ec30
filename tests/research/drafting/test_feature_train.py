"""The feature-fed head and the cut draft (research/scripts/train_heads.py's work) end to end on a tiny target."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from research.drafting.cut_draft import draft_agreement, export_cut_draft, train_cut_draft
from research.drafting.feature_data import HeadsConfig, frequency_order, keep_states
from research.drafting.feature_train import export_feature_head, train_feature_head
from research.drafting.teacher import load_shards, write_teacher_shards
from research.heads.feature_head import FeatureHead
from tests.research.drafting.conftest import greedy_rows


@pytest.fixture(scope="module")
def heads_cfg(tmp_path_factory: pytest.TempPathFactory, tiny_target: Path, tiny_model: Any) -> HeadsConfig:
    """A work directory with `chat` and `eval` shards of the tiny target's greedy answers and their states."""
    work = tmp_path_factory.mktemp("heads")
    with torch.no_grad():
        rows = [{**r, "prompt": None} for r in greedy_rows(tiny_model, 12, seed=1)]
    write_teacher_shards(work, "chat", tiny_model, rows[:8], keep_states, batch=4)
    write_teacher_shards(work, "eval", tiny_model, rows[8:], keep_states, batch=4)
    return HeadsConfig(work=work, target=tiny_target, n_out=512, threads=1, train_steps=4, batch=2, window=8,
                       unroll=2, log_every=1, draft_layers=1, draft_rank=8, draft_window=24, draft_batch=2)


def test_teacher_shards_keep_the_state_that_chose_each_answer_token(heads_cfg: HeadsConfig, tiny_model: Any) -> None:
    rec = load_shards(heads_cfg.work, "chat")[0]
    assert rec["start"] == 12 and rec["hidden"].shape[0] == len(rec["ids"]) - 12
    greedy = tiny_model.lm_head(rec["hidden"].float()).argmax(-1)  # [n] the target's choice at each state
    assert greedy.tolist() == rec["ids"][12:]


def test_head_trains_resumes_and_exports_with_a_report(heads_cfg: HeadsConfig, tmp_path: Path) -> None:
    assert len(frequency_order(heads_cfg)["order"]) == 4096
    train_feature_head(heads_cfg)
    saved = torch.load(heads_cfg.work / "head.pt", weights_only=False)
    assert saved["state"]["step"] == 4 and len(saved["state"]["log"]) == 4
    train_feature_head(HeadsConfig(**{**vars(heads_cfg), "train_steps": 6}))  # resumes from step 4
    assert torch.load(heads_cfg.work / "head.pt", weights_only=False)["state"]["step"] == 6
    report = export_feature_head(heads_cfg, tmp_path / "head")
    assert FeatureHead.load(tmp_path / "head").cfg.n_out == 512
    assert json.loads((tmp_path / "head" / "report.json").read_text())["steps"] == 6
    assert report["eval"]["rows"] == 4 and len(report["eval"]["by_position"]) == 8


def test_cut_draft_trains_and_exports_a_compact_directory(heads_cfg: HeadsConfig, tmp_path: Path) -> None:
    train_cut_draft(heads_cfg)
    report = export_cut_draft(heads_cfg, tmp_path / "draft")
    assert report["steps"] == 4 and report["layers"] == 1 and report["eval"]["starts"] > 0
    assert (tmp_path / "draft" / "report.json").exists()


def test_draft_agreement_counts_runs_of_a_teacher_forced_draft() -> None:
    ids = list(range(20))
    wrong = 15  # the draft misses the token at position 15 (it predicts ids[15] wrongly at position 14)

    class Model:
        def __call__(self, input_ids: torch.Tensor) -> Any:
            nxt = input_ids[0] + 1  # [T] the truth
            nxt[wrong - 1] = 0
            return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, 32).float()[None])

    res = draft_agreement(SimpleNamespace(model=Model(), out_ids=None), [{"ids": ids, "start": 10}], k=3)
    # starts at positions 9..16 (draft j from start t is the choice at t + j - 1); the miss is at 14
    assert res["starts"] == 8
    runs = [min(3, 14 - t) if t <= 14 else 3 for t in range(9, 17)]
    assert res["tokens_per_call"][3] == round(sum(runs) / 8 + 1, 4)

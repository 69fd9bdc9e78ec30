"""The distilled draft (scripts/distill_draft.py's work) on a tiny target, and the stdlib corpus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from research.drafting import distill
from research.drafting.corpus import is_held_out, stdlib_files, text_chunks
from research.drafting.evaluate import pair_agreement
from research.drafting.teacher import write_teacher_shards
from tests.research.drafting.conftest import greedy_rows


def test_stdlib_files_split_by_the_path_hash() -> None:
    train, held = stdlib_files(top_level=True)
    assert train and held and not set(train) & set(held)
    assert all(is_held_out(p.name) for p in held) and not any(is_held_out(p.name) for p in train)


def test_text_chunks_are_full_width_and_limited() -> None:
    class Tok:
        def __call__(self, text: str) -> Any:
            return type("E", (), {"input_ids": [ord(c) for c in text]})()

    chunks = text_chunks(Tok(), stdlib_files(top_level=True)[0][:3], 16, 64, 10, seed=0)
    assert len(chunks) == 10 and all(len(c) == 16 for c in chunks)


def test_pair_agreement_of_a_model_with_itself_is_total() -> None:
    logits = torch.randn(3, 5, 11)  # [b, t, V]
    agree, beta = pair_agreement(logits, logits)
    assert bool(agree.all()) and torch.allclose(beta, torch.ones(3, 5))


def test_distilled_draft_trains_on_top_k_labels_and_exports(tmp_path: Path, tiny_target: Path, tiny_model: Any) -> None:
    with torch.no_grad():
        rows = [{**r, "prompt": None} for r in greedy_rows(tiny_model, 8, seed=2)]
    keep = distill.keep_topk(8)
    write_teacher_shards(tmp_path, "chat", tiny_model, rows[:6], keep, batch=3)
    write_teacher_shards(tmp_path, "eval", tiny_model, rows[6:], keep, batch=2)
    rec = distill.load_records(tmp_path)[0][0]
    assert rec["top_lp"].shape == (len(rec["ids"]) - 12, 8)
    assert rec["top_ix"][:, 0].tolist() == rec["ids"][12:]  # greedy answers: the top label is the token
    cfg = distill.DistillConfig(work=tmp_path, target=tiny_target, layers=1, width=64, batch=2, train_minutes=0.01)
    state = distill.train(cfg)
    assert state["step"] >= 1 and state["tokens"] > 0 and (tmp_path / "ckpt.pt").exists()
    report = distill.export(cfg, tmp_path / "draft")
    assert report["eval_prompts"] == 2 and 0 <= report["greedy_agreement"] <= 1 and 0 < report["beta_T1"] <= 1
    assert json.loads((tmp_path / "draft" / "distill_report.json").read_text())["train_steps"] == state["step"]

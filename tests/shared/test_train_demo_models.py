"""scripts/train_demo_models.py --smoke writes a loadable demo pair and its training report."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_demo_models.py"
REPORT_KEYS = {
    "target_val_loss", "draft_val_loss", "greedy_agreement", "beta_t1", "target_ms_per_token",
    "draft_ms_per_token", "cost_ratio_target_over_draft", "target_params", "draft_params", "target_shape",
    "draft_shape", "vocab", "target_training_runs", "draft_training_runs", "train_tokens_available", "held_out_tokens",
    "held_out_windows", "window", "torch_threads", "machine", "python", "torch",
}


# small batches, short windows and one thread keep it to seconds; the stages are the real ones
SMOKE = [sys.executable, str(SCRIPT), "--smoke", "--batch", "2", "--seq", "32", "--threads", "1"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One smoke run's output folder, read by the first test and copied by the resume test."""
    out = tmp_path_factory.mktemp("smoke")
    proc = subprocess.run(SMOKE + ["--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_smoke_run_writes_loadable_models_and_a_report(smoke_run: Path) -> None:
    report = json.loads((smoke_run / "training_report.json").read_text())
    assert REPORT_KEYS <= set(report), REPORT_KEYS - set(report)
    for key in ("target_val_loss", "draft_val_loss", "target_ms_per_token", "draft_ms_per_token"):
        assert math.isfinite(report[key]) and report[key] > 0, key
    assert 0 <= report["greedy_agreement"] <= 1 and 0 < report["beta_t1"] <= 1
    assert [r["steps"] for r in report["target_training_runs"]] == [3]
    assert [r["steps"] for r in report["draft_training_runs"]] == [3]
    assert report["target_params"] > report["draft_params"] > 0
    assert report["window"] == 32 and report["torch_threads"] == 1

    tok = AutoTokenizer.from_pretrained(smoke_run / "demo-target")
    draft_tok = AutoTokenizer.from_pretrained(smoke_run / "demo-draft")
    assert tok.get_vocab() == draft_tok.get_vocab() and len(tok) == report["vocab"]
    text = "def add(a, b):\n    return a + b\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text

    for sub, shape in (("demo-target", report["target_shape"]), ("demo-draft", report["draft_shape"])):
        model = AutoModelForCausalLM.from_pretrained(smoke_run / sub).eval()
        assert (model.config.n_layer, model.config.n_embd, model.config.n_head) == (
            shape["n_layer"], shape["n_embd"], shape["n_head"])
        assert model.config.vocab_size == len(tok)
        assert model.config.eos_token_id == tok.eos_token_id
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits  # [1, n, vocab]
        assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


def test_resume_continues_the_saved_pair_and_keeps_the_tokenizer(smoke_run: Path, tmp_path: Path) -> None:
    shutil.copytree(smoke_run, tmp_path, dirs_exist_ok=True)
    vocab_before = (tmp_path / "demo-target" / "tokenizer.json").read_text()
    weights_before = (tmp_path / "demo-target" / "model.safetensors").read_bytes()
    proc = subprocess.run(SMOKE + ["--out", str(tmp_path), "--resume"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "training_report.json").read_text())
    assert [r["steps"] for r in report["target_training_runs"]] == [3, 3]
    assert [r["steps"] for r in report["draft_training_runs"]] == [3, 3]
    assert (tmp_path / "demo-target" / "tokenizer.json").read_text() == vocab_before
    assert (tmp_path / "demo-target" / "model.safetensors").read_bytes() != weights_before

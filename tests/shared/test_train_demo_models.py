"""scripts/train_demo_models.py --smoke writes a loadable demo pair and its training report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_demo_models.py"
REPORT_KEYS = {
    "target_val_loss", "draft_val_loss", "greedy_agreement", "beta_t1", "target_ms_per_token",
    "draft_ms_per_token", "cost_ratio_target_over_draft", "target_params", "draft_params", "target_shape",
    "draft_shape", "vocab", "target_training_runs", "draft_training_runs", "train_tokens_available", "held_out_tokens",
    "held_out_windows", "window", "torch_threads", "machine", "python", "torch",
}


def test_smoke_run_writes_loadable_models_and_a_report(tmp_path: Path) -> None:
    # small batches, short windows and one thread keep it to seconds; the stages are the real ones
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--batch", "2", "--seq", "32", "--threads", "1",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    report = json.loads((tmp_path / "training_report.json").read_text())
    assert REPORT_KEYS <= set(report), REPORT_KEYS - set(report)
    for key in ("target_val_loss", "draft_val_loss", "target_ms_per_token", "draft_ms_per_token"):
        assert math.isfinite(report[key]) and report[key] > 0, key
    assert 0 <= report["greedy_agreement"] <= 1 and 0 < report["beta_t1"] <= 1
    assert [r["steps"] for r in report["target_training_runs"]] == [3]
    assert [r["steps"] for r in report["draft_training_runs"]] == [3]
    assert report["target_params"] > report["draft_params"] > 0
    assert report["window"] == 32 and report["torch_threads"] == 1

    tok = AutoTokenizer.from_pretrained(tmp_path / "demo-target")
    draft_tok = AutoTokenizer.from_pretrained(tmp_path / "demo-draft")
    assert tok.get_vocab() == draft_tok.get_vocab() and len(tok) == report["vocab"]
    text = "def add(a, b):\n    return a + b\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text

    for sub, shape in (("demo-target", report["target_shape"]), ("demo-draft", report["draft_shape"])):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / sub).eval()
        assert (model.config.n_layer, model.config.n_embd, model.config.n_head) == (
            shape["n_layer"], shape["n_embd"], shape["n_head"])
        assert model.config.vocab_size == len(tok)
        assert model.config.eos_token_id == tok.eos_token_id
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits  # [1, n, vocab]
        assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


def test_resume_continues_the_saved_pair_and_keeps_the_tokenizer(tmp_path: Path) -> None:
    base = [sys.executable, str(SCRIPT), "--smoke", "--batch", "2", "--seq", "32", "--threads", "1",
            "--target-minutes", "5", "--draft-minutes", "5", "--out", str(tmp_path)]
    assert subprocess.run(base, capture_output=True, timeout=300).returncode == 0
    vocab_before = (tmp_path / "demo-target" / "tokenizer.json").read_text()
    weights_before = (tmp_path / "demo-target" / "model.safetensors").read_bytes()
    proc = subprocess.run(base + ["--resume"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "training_report.json").read_text())
    assert [r["steps"] for r in report["target_training_runs"]] == [3, 3]
    assert [r["steps"] for r in report["draft_training_runs"]] == [3, 3]
    assert (tmp_path / "demo-target" / "tokenizer.json").read_text() == vocab_before
    assert (tmp_path / "demo-target" / "model.safetensors").read_bytes() != weights_before

"""Fixtures shared by every test folder: model directories (bundled demo pair, tiny random pair)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels (cloud/runners/paged_kernel.py) run under Triton's interpreter where no CUDA device is: set before
# anything imports triton, which reads it once
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the real SmolLM2 pair's session fixtures (one cloud for every module that verifies against it)
pytest_plugins = ("tests.real_pair",)

REPO = Path(__file__).resolve().parent.parent
DEMO_TARGET = REPO / "models" / "demo-target"
DEMO_DRAFT = REPO / "models" / "demo-draft"
# the edge's draft models run in the cloud's test dtype (float32 unless SPECSPLIT_TEST_DTYPE names another), so a
# test's drafts are the same on every machine; the default itself ("auto") is tested in tests/edge/test_settings.py
os.environ.setdefault("SPECSPLIT_EDGE_DRAFT_DTYPE", os.environ.get("SPECSPLIT_TEST_DTYPE", "float32"))


def build_tiny_model(out_dir: Path, n_layer: int, n_embd: int, seed: int) -> Path:
    """A random-initialised GPT-2 with the demo tokenizer, saved in Hugging Face format."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=n_embd, n_layer=n_layer, n_head=2,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def demo_target_dir() -> Path:
    return DEMO_TARGET


@pytest.fixture(scope="session")
def demo_draft_dir() -> Path:
    return DEMO_DRAFT


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, draft_dir): tiny random GPT-2s sharing the demo tokenizer; fast on CPU."""
    root = tmp_path_factory.mktemp("tiny")
    return (build_tiny_model(root / "target", 2, 64, seed=1), build_tiny_model(root / "draft", 1, 32, seed=2))

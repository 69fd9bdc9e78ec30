"""Which folder under models/ speaks the cloud's tokenizer (edge/model_choice.py): any folder, named as its owner
likes, the bundled drafts first; a draft needs weights, cloud_only the tokenizer alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint


def test_a_draft_of_ones_own_under_models_is_found_by_its_tokenizer(
        tiny_pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import edge.settings
    from edge.model_choice import draft_for_tokenizer, models_speaking

    models = tmp_path / "models"
    own, bundled, tokenizer_only = models / "my-finetune", models / "demo-draft", models / "just-a-tokenizer"
    shutil.copytree(tiny_pair[1], own)
    shutil.copytree(tiny_pair[1], bundled)
    tokenizer_only.mkdir()
    for f in tiny_pair[1].glob("tokenizer*"):
        shutil.copy(f, tokenizer_only / f.name)
    monkeypatch.setattr(edge.settings, "REPO_ROOT", tmp_path)
    fp = tokenizer_fingerprint(load_tokenizer(own))
    assert draft_for_tokenizer(fp, 4096) == str(bundled)  # the bundled name first
    tok = AutoTokenizer.from_pretrained(bundled)
    tok.add_special_tokens({"additional_special_tokens": ["<|only-here|>"]})  # the bundled one now speaks another
    tok.save_pretrained(bundled)
    assert draft_for_tokenizer(fp, 4096) == str(own)  # a name no list holds
    assert models_speaking(fp, 4096, drafts_only=False) == [own, tokenizer_only]  # cloud_only: the tokenizer alone
    assert str(tokenizer_only) not in {str(p) for p in models_speaking(fp, 4096, drafts_only=True)}
    assert draft_for_tokenizer("0" * 16, 4096) is None

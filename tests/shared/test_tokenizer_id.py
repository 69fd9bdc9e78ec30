"""The tokenizer fingerprint: kept per tokenizer object, recomputed when the tokenizer changes."""

from __future__ import annotations

from pathlib import Path

from shared.tokenizer_id import _fingerprint, load_tokenizer, tokenizer_fingerprint


def test_the_kept_fingerprint_follows_added_tokens_and_special_tokens(demo_target_dir: Path) -> None:
    tok = load_tokenizer(demo_target_dir)
    first = tokenizer_fingerprint(tok)
    assert first == _fingerprint(tok) == tokenizer_fingerprint(load_tokenizer(demo_target_dir))
    assert tokenizer_fingerprint(tok) == first  # kept
    tok.add_tokens(["<|new-token|>"])
    added = tokenizer_fingerprint(tok)
    assert added != first and added == _fingerprint(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|new-token|>"]})  # same size, one more special
    assert tokenizer_fingerprint(tok) == _fingerprint(tok) != added
    assert tokenizer_fingerprint(load_tokenizer(demo_target_dir)) == first  # another object, its own entry

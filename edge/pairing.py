"""Before a session: do the edge's tokenizer and draft speak the target's ids?

The cloud reports its tokenizer's fingerprint and vocabulary size (GET /v1/model). The edge
encodes prompts and decodes text with its own tokenizer (`--tokenizer`, default the draft's
directory), and the draft model was trained on some tokenizer of its own directory: all three
must agree, or the ids on the wire mean different text on each side and nothing else notices.
"""

from __future__ import annotations

from typing import Any

from shared.errors import InvalidArgument
from shared.protocol import ModelInfo
from shared.tokenizer_id import tokenizer_fingerprint


def check_pairing(info: ModelInfo, tokenizer: Any, tokenizer_dir: str, draft_fingerprint: str | None,
                  draft_vocab: int | None) -> None:
    """InvalidArgument naming the mismatch and the fix; a cloud that reports no fingerprint is trusted."""
    if draft_vocab is not None and info.vocab_size and draft_vocab != info.vocab_size:
        raise InvalidArgument(f"the draft model has {draft_vocab} logits, the target {info.vocab_size}: they do "
                              "not share a tokenizer; use a draft trained on the target's tokenizer")
    if not info.tokenizer_fingerprint:
        return
    mine = getattr(tokenizer, "fingerprint", None) or tokenizer_fingerprint(tokenizer)
    if mine != info.tokenizer_fingerprint:
        raise InvalidArgument(
            f"the edge's tokenizer ({tokenizer_dir}, fingerprint {mine}) differs from the target's "
            f"({info.tokenizer_fingerprint}); pass --tokenizer DIR with the target's tokenizer files")
    if draft_fingerprint and draft_fingerprint != info.tokenizer_fingerprint:
        raise InvalidArgument(
            f"the draft model's own tokenizer (fingerprint {draft_fingerprint}) differs from the target's "
            f"({info.tokenizer_fingerprint}): its ids would mean other text; use a draft trained on the "
            "target's tokenizer")

"""Before a session: do the edge's tokenizer and draft speak the target's ids?

The cloud reports its tokenizer's fingerprint, its logits' rows (`vocab_size`) and the ids its
tokenizer defines (`tokenizer_size`). The edge encodes prompts and decodes text with its own
tokenizer (`--tokenizer`, default the draft's directory), and the draft model was trained on some
tokenizer of its own directory: all three must be the same tokenizer, or the ids on the wire mean
different text on each side and nothing else notices. The embedding tables may differ in size (one
family's models pad them differently): both sides then take p and q over the tokenizer's ids only.
"""

from __future__ import annotations

from typing import Any

from shared.errors import InvalidArgument
from shared.protocol import ModelInfo
from shared.tokenizer_id import tokenizer_fingerprint


def support_size(info: ModelInfo) -> int:
    """The ids p and q are taken over: the target's tokenizer's (its logit rows for an older cloud)."""
    return info.tokenizer_size or info.vocab_size


def check_pairing(info: ModelInfo, tokenizer: Any, tokenizer_dir: str, draft_fingerprint: str | None,
                  draft_rows: int | None) -> int:
    """The support size both sides sample over; InvalidArgument naming the mismatch and the fix. A cloud
    that reports no fingerprint is trusted on the tokenizer, and its rows must then equal the draft's."""
    support = support_size(info)
    if draft_rows is not None and not info.tokenizer_fingerprint and info.vocab_size \
            and draft_rows != info.vocab_size:
        raise InvalidArgument(f"the draft model has {draft_rows} logits, the target {info.vocab_size}: they do "
                              "not share a tokenizer; use a draft trained on the target's tokenizer")
    if draft_rows is not None and draft_rows < support:
        raise InvalidArgument(f"the draft model has {draft_rows} logits, fewer than the {support} ids of the "
                              "target's tokenizer: it cannot speak every id; use a draft trained on that tokenizer")
    if not info.tokenizer_fingerprint:
        return support
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
    return support


def fit_drafter(drafter: Any, support: int) -> None:
    """Make the drafter (and the parts it wraps) take q over the first `support` ids."""
    if hasattr(drafter, "vocab_size"):
        drafter.vocab_size = support

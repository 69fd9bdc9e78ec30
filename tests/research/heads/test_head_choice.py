"""A head made for another target is never loaded: its config is read, its weights are not."""

from __future__ import annotations

from typing import Any

import pytest

from edge.drafters.ngram import NGramDrafter
from research.heads import ATTENTION_HEAD, HeadChoice
from shared.protocol import ModelInfo


def info(width: int, fingerprint: str) -> ModelInfo:
    return ModelInfo(model_id="t", vocab_size=100, feature_size=width, feature_encodings=["int8", "float16"],
                     tokenizer_fingerprint=fingerprint, max_feature_window=64)


@pytest.mark.skipif(not ATTENTION_HEAD.is_dir(), reason="the committed attention head")
def test_a_head_for_another_target_is_never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    from research.heads import attention_head

    loads: list[Any] = []
    monkeypatch.setattr(attention_head.AttentionHead, "load", classmethod(lambda cls, *a, **k: loads.append(a)))
    choice = HeadChoice(ATTENTION_HEAD)
    drafter = NGramDrafter()
    assert choice.fed(info(1536, "qwen-coder"), drafter) is None  # the coder target: width 1536
    assert loads == []
    assert choice._head_fits(info(576, "61485bea3b3ca58c"))  # its own target: fits, by its config alone
    assert loads == []
    choice.head()
    assert len(loads) == 1


def test_a_cloud_without_the_encoding_asks_for_none() -> None:
    choice = HeadChoice("nowhere", feature_encoding="int8")
    assert choice.encoding_for(ModelInfo(model_id="t", vocab_size=100, feature_encodings=["float16"])) == ""
    assert HeadChoice("nowhere").encoding_for(info(576, "x")) == "int8"

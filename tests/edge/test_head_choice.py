"""A head made for another target is never loaded: its config is read, its weights are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge.client import EdgeClient
from edge.drafters.ngram import NGramDrafter
from edge.settings import EdgeSettings
from shared.protocol import ModelInfo

REPO = Path(__file__).resolve().parents[2]
HEAD = REPO / "models" / "smollm2-135m-attention-head"


def info(width: int, fingerprint: str) -> ModelInfo:
    return ModelInfo(model_id="t", vocab_size=100, feature_size=width, feature_encodings=["int8", "float16"],
                     tokenizer_fingerprint=fingerprint, max_feature_window=64)


@pytest.mark.skipif(not HEAD.is_dir(), reason="the committed attention head")
def test_a_head_for_another_target_is_never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    from edge.drafters import attention_head

    loads: list[Any] = []
    monkeypatch.setattr(attention_head.AttentionHead, "load", classmethod(lambda cls, *a, **k: loads.append(a)))
    client = EdgeClient(EdgeSettings(cloud_url="http://127.0.0.1:1", head=str(HEAD), draft="ngram",
                                     tokenizer=str(REPO / "models" / "demo-target")))
    drafter = NGramDrafter()
    assert client._feature_fed(info(1536, "qwen-coder"), drafter) is None  # the coder target: width 1536
    assert loads == []
    client._feature_fed(info(576, "61485bea3b3ca58c"), drafter)  # its own target: loaded
    assert len(loads) == 1

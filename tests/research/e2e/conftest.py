"""The head's end-to-end fixtures: tests/e2e's (a real `specsplit-cloud` process, the tiny pair's tokenizer and
drafter) and a random attention head for the tiny target."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import _one_torch_thread, cloud, drafter, tiny_cloud_server, tokenizer

__all__ = ["_one_torch_thread", "attention_head_dir", "cloud", "drafter", "tiny_cloud_server", "tokenizer"]


@pytest.fixture(scope="module")
def attention_head_dir(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random attention head (window 8) for the tiny target, saved as research.heads.HeadChoice loads one."""
    from tests.research.heads.test_attention_drafter import build_head
    out = tmp_path_factory.mktemp("attention") / "head"
    build_head(tiny_pair[0]).save(out)
    return out

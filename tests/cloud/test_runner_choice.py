"""Which runner a cloud starts on: `auto` resolved with its reason (logged), a --dtype never silently ignored."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cloud.settings import CloudSettings


def test_dtype_with_the_llamacpp_runner_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValidationError, match="--dtype float32 is the PyTorch runner's.*use --runner torch"):
        CloudSettings(model=tmp_path, runner="llamacpp", dtype="float32")
    assert CloudSettings(model=tmp_path, runner="llamacpp").runner_choice() == "llamacpp"


def test_auto_says_why_it_chose(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert CloudSettings(model=tmp_path, dtype="bfloat16").runner_and_reason() == \
        ("torch", "auto: --dtype bfloat16 asks for the PyTorch weights")
    assert CloudSettings(model=tmp_path, device="cuda").runner_and_reason()[0] == "torch"
    assert CloudSettings(model=tmp_path, runner="torch").runner_and_reason() == ("torch", "asked for")
    empty = tmp_path / "hf"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert CloudSettings(model=empty).runner_and_reason() == ("torch", "auto: the model directory holds no GGUF")

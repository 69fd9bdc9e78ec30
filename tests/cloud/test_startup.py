"""Start-up refusals of `specsplit-cloud`: one line naming the cause and the fix, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud import cli


def test_a_model_directory_without_a_tokenizer_is_refused_in_one_line(
        tmp_path: Path, tiny_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_pair[0].iterdir():  # config and weights, no tokenizer files
        if not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (bare / f.name).write_bytes(f.read_bytes())
    assert cli.main(["--model", str(bare), "--http-port", "0", "--grpc-port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no tokenizer" in err and str(bare) in err

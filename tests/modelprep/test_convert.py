"""`specsplit-models convert SOURCE --out DIR` on tiny models: a GGUF file (Q8_0 matrices) that llama.cpp runs here
becomes a directory of the GGUF with its tokenizer and config, no weight dequantized (the cloud's llama.cpp runner
and the edge's llama.cpp drafter load it); with --safetensors, or where llama.cpp cannot run it, the float32 copy
too, checked against the source's logits; a Hugging Face directory is saved in its dtype. Every directory is
readable by every user and records its source; what the cloud would refuse, a missing file and a bad GGUF end in
one line and leave nothing behind."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from modelprep import cli
from shared.hf_model import load_causal_lm
from shared.tokenizer_id import load_tokenizer
from tests.modelprep.tiny_files import write_gguf
from tests.tiny_models import build


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def convert(source: Path, out: Path, *extra: str) -> int:
    return cli.main(["convert", str(source), "--out", str(out), *extra])


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    """The error: stderr's last line (transformers' progress bars may come before it), and no traceback."""
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert last.startswith("specsplit-models: ") and "Traceback" not in err, err
    return last


def test_with_safetensors_a_gguf_becomes_a_checked_float32_directory_with_its_gguf_readable_by_every_user(
        tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    old = os.umask(0o077)  # a private umask: the modes are set, not inherited
    try:
        assert convert(tiny_gguf, out, "--safetensors") == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    files = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "model.gguf", "source.json"} <= set(files)
    assert set(files.values()) == {0o644}, files
    assert (out / "model.gguf").stat().st_ino == tiny_gguf.stat().st_ino
    record = json.loads((out / "source.json").read_text())
    assert record["source"] == {"path": str(tiny_gguf.resolve()), "format": "gguf",
                                "bytes": tiny_gguf.stat().st_size,
                                "sha256": hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()}
    assert record["command"] == f"specsplit-models convert {tiny_gguf} --out {out} --safetensors"
    assert record["dtype"] == "float32" and record["check"]["max_abs_logit_diff"] <= 1e-4
    # what the cloud loads: its tokenizer check and its loader
    assert len(load_tokenizer(out)) == 4096
    model = load_causal_lm(out, "cpu", torch.float32)
    assert model.config.model_type == "qwen2" and not any(p.dtype != torch.float32 for p in model.parameters())


def test_the_gguf_is_copied_where_it_cannot_be_linked(tiny_gguf: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    assert convert(tiny_gguf, tmp_path / "mine") == 0
    copy = tmp_path / "mine" / "model.gguf"
    assert copy.stat().st_ino != tiny_gguf.stat().st_ino and copy.read_bytes() == tiny_gguf.read_bytes()
    assert copy.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664])
def test_convert_never_changes_the_sources_mode(tiny_gguf: Path, tmp_path: Path, mode: int) -> None:
    """A private GGUF stays private: it is copied (not linked and chmodded); one readable by every user is linked
    and keeps its own mode whatever it is. The record holds the source's sha256 either way."""
    src = tmp_path / "private.gguf"
    src.write_bytes(tiny_gguf.read_bytes())
    src.chmod(mode)
    assert convert(src, tmp_path / "mine") == 0
    assert src.stat().st_mode & 0o777 == mode
    gguf = tmp_path / "mine" / "model.gguf"
    assert (gguf.stat().st_ino == src.stat().st_ino) == (mode & 0o044 == 0o044)
    if mode & 0o044 != 0o044:
        assert gguf.stat().st_mode & 0o777 == 0o644 and gguf.read_bytes() == src.read_bytes()
    record = json.loads((tmp_path / "mine" / "source.json").read_text())
    assert record["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


def test_a_hugging_face_directory_is_saved_in_its_dtype_with_its_tokenizer(tmp_path: Path) -> None:
    src = build("llama", tmp_path / "src")
    (src / "model.safetensors").chmod(0o600)
    assert convert(src, tmp_path / "mine") == 0
    assert (src / "model.safetensors").stat().st_mode & 0o777 == 0o600  # the source as it was
    out = tmp_path / "mine"
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
    assert not (out / "model.gguf").exists()
    record = json.loads((out / "source.json").read_text())
    assert record["source"]["format"] == "huggingface" and record["dtype"] == "float32"
    assert record["source"]["files"]["model.safetensors"]["sha256"] == hashlib.sha256(
        (src / "model.safetensors").read_bytes()).hexdigest()
    assert record["check"]["max_abs_logit_diff"] == 0.0
    ids = torch.tensor([[5, 17, 300, 2]])
    a, b = (load_causal_lm(d, "cpu", torch.float32) for d in (src, out))
    assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
def test_an_architecture_the_cloud_refuses_is_one_line_and_nothing_is_written(
        arch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = build(arch, tmp_path / "src")
    capsys.readouterr()
    assert convert(src, tmp_path / "mine") == 2
    err = one_line_error(capsys)
    assert "the cloud refuses this model" in err and "cannot be rolled back" in err
    assert not (tmp_path / "mine").exists() and not (tmp_path / "mine.partial").exists()


def test_a_gguf_the_cloud_refuses_is_one_line_and_nothing_is_written(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    src = write_gguf(tmp_path / "mamba.gguf", "mamba")
    capsys.readouterr()
    assert convert(src, tmp_path / "mine") == 2
    err = one_line_error(capsys)
    assert "mamba.gguf: the cloud refuses this model: model type 'mamba'" in err and "cannot be rolled back" in err
    assert not (tmp_path / "mine").exists() and not (tmp_path / "mine.partial").exists()


def test_a_missing_source_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert convert(tmp_path / "nowhere.gguf", tmp_path / "mine") == 2
    assert "nowhere.gguf does not exist" in one_line_error(capsys)


def test_a_file_that_is_not_gguf_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04 not a gguf")
    assert convert(tmp_path / "model.bin", tmp_path / "mine") == 2
    assert "is not a GGUF file" in one_line_error(capsys)


def test_a_truncated_gguf_is_one_line(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    assert convert(cut, tmp_path / "mine") == 2
    assert f"cannot read {cut} as GGUF" in one_line_error(capsys)
    assert not (tmp_path / "mine").exists() and not (tmp_path / "mine.partial").exists()


def test_a_directory_without_a_config_or_a_tokenizer_is_one_line(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert convert(tmp_path / "empty", tmp_path / "mine") == 2
    assert "has no config.json" in one_line_error(capsys)
    src = build("llama", tmp_path / "src")
    for f in src.glob("tokenizer*"):
        f.unlink()
    capsys.readouterr()
    assert convert(src, tmp_path / "mine") == 2
    assert "tokenizer in" in one_line_error(capsys)  # the cloud's own message (shared.tokenizer_id)


def test_an_existing_out_is_kept_unless_forced(tiny_gguf: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep").write_text("mine")
    assert convert(tiny_gguf, out) == 2
    assert "exists: choose another --out, or pass --force" in one_line_error(capsys)
    assert convert(tiny_gguf, out, "--force") == 0
    assert not (out / "keep").exists() and (out / "model.gguf").is_file()


def needs_llama_cpp() -> None:
    from shared.llama_runtime import unavailable

    why = unavailable()
    if why is not None:
        pytest.skip(why)


def refuse_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model's weights through transformers fails the test: the GGUF alone needs none."""
    import transformers

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)


def test_a_gguf_llama_cpp_runs_is_kept_with_its_tokenizer_and_no_float32_copy(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default a GGUF this machine's llama.cpp runs becomes model.gguf with its tokenizer and config and no
    safetensors, without dequantizing a weight; the cloud's llama.cpp runner and the edge's llama.cpp drafter load
    the directory, with the tokenizer the cloud's checks accept."""
    needs_llama_cpp()
    refuse_weights(monkeypatch)
    out = tmp_path / "mine"
    assert convert(tiny_gguf, out) == 0
    files = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "model.gguf", "source.json"} <= set(files), files
    assert not [n for n in files if n.endswith((".safetensors", ".bin"))], files
    assert set(files.values()) == {0o644} and (out / "model.gguf").stat().st_ino == tiny_gguf.stat().st_ino
    record = json.loads((out / "source.json").read_text())
    assert record["dtype"] == "gguf" and record["source"]["sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    monkeypatch.undo()

    from cloud.runners.llamacpp import LlamaTarget
    from edge.drafters.llamacpp import LlamaCppDrafter
    from edge.settings import EdgeSettings, load_draft_model
    from shared.tokenizer_id import tokenizer_fingerprint

    target = LlamaTarget(out, threads=1)
    assert target.info.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(out))
    assert isinstance(load_draft_model(EdgeSettings(draft=str(out), draft_runtime="auto")), LlamaCppDrafter)


def test_where_llama_cpp_cannot_run_a_gguf_the_float32_copy_is_written_saying_why(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from modelprep import convert as conv

    monkeypatch.setattr(conv, "llama_cpp_refuses", lambda src: "llama-cpp-python is not installed")
    out = tmp_path / "mine"
    assert convert(tiny_gguf, out) == 0
    assert (out / "model.safetensors").is_file() and (out / "model.gguf").is_file()
    assert "llama.cpp cannot run it here: llama-cpp-python is not installed" in capsys.readouterr().err


def test_no_safetensors_keeps_the_gguf_alone_even_where_llama_cpp_cannot_run_it(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-safetensors is for a device elsewhere: the GGUF alone, whatever this machine's llama.cpp; a draft
    there without llama.cpp then stops on the one line saying why, not on a missing weights file."""
    from modelprep import convert as conv
    from shared import llama_runtime

    monkeypatch.setattr(conv, "llama_cpp_refuses", lambda src: "llama-cpp-python is not installed")
    refuse_weights(monkeypatch)
    out = tmp_path / "mine"
    assert convert(tiny_gguf, out, "--no-safetensors") == 0
    assert (out / "model.gguf").is_file() and not list(out.glob("*.safetensors"))
    monkeypatch.undo()

    from edge.settings import EdgeSettings, load_draft_model
    from shared.kvpool import UnsupportedModel

    monkeypatch.setattr(llama_runtime, "unavailable", lambda: "llama-cpp-python is not installed (test)")
    with pytest.raises(UnsupportedModel, match=r"not installed \(test\)"):
        load_draft_model(EdgeSettings(draft=str(out), draft_runtime="auto"))


def test_no_safetensors_for_a_hugging_face_directory_is_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    src = build("llama", tmp_path / "src")
    assert convert(src, tmp_path / "mine", "--no-safetensors") == 2
    assert "--no-safetensors is for a GGUF source" in one_line_error(capsys)
    assert not (tmp_path / "mine").exists()

"""The weights' part of a cloud's numerics (cloud/numerics.py `weights_fingerprint`): the content of the weight
files, not their names and sizes, hashed once per file version and read back from the cache after."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cloud import numerics
from cloud.numerics import weights_fingerprint


def checkpoint(d: Path, weights: bytes) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_two_fine_tunes_with_the_same_names_and_sizes_differ(tmp_path: Path) -> None:
    base = bytes(range(256)) * 64
    tuned = base[:5000] + bytes([base[5000] ^ 1]) + base[5001:]  # one byte of one weight
    a, b = checkpoint(tmp_path / "a", base), checkpoint(tmp_path / "b", tuned)
    cache = tmp_path / "cache.json"
    assert weights_fingerprint(a, cache) != weights_fingerprint(b, cache)
    assert weights_fingerprint(a, cache) == weights_fingerprint(checkpoint(tmp_path / "c", base), cache)
    gguf_a, gguf_b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    gguf_a.write_bytes(b"GGUF" + bytes(2 << 20))
    gguf_b.write_bytes(b"GGUF" + bytes(2 << 20)[:-1] + b"\x01")  # past the first MiB
    assert weights_fingerprint(gguf_a, cache) != weights_fingerprint(gguf_b, cache)


def test_a_large_file_is_hashed_once_per_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics, "CACHED_FROM_BYTES", 0)
    hashed: list[Path] = []
    sha = numerics.file_sha256
    monkeypatch.setattr(numerics, "file_sha256", lambda p: hashed.append(p) or sha(p))
    d, cache = checkpoint(tmp_path / "m", b"x" * 4096), tmp_path / "cache" / "weights.json"
    first = weights_fingerprint(d, cache)
    assert weights_fingerprint(d, cache) == first and len(hashed) == 1  # the second start reads the cache
    (d / "model.safetensors").write_bytes(b"y" * 4096)  # the same size, another version
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert weights_fingerprint(d, cache) != first and len(hashed) == 2


def test_an_unwritable_cache_still_fingerprints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics, "CACHED_FROM_BYTES", 0)
    blocker = tmp_path / "file"
    blocker.write_text("")
    d = checkpoint(tmp_path / "m", b"z" * 100)
    assert weights_fingerprint(d, blocker / "weights.json") == weights_fingerprint(d, tmp_path / "ok.json")

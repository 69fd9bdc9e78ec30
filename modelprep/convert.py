"""A GGUF file or a Hugging Face directory into a model directory the cloud and the edge load.

`convert_gguf_file` is `specsplit-models convert FILE.gguf`: where this machine's llama.cpp loads the file (what the
cloud's llama.cpp runner and the edge's llama.cpp drafter run), `convert_gguf_alone` writes the GGUF with the
tokenizer and config read from its header and no float32 copy (no weight is read, so it needs little memory);
asked for (`safetensors=True`), or where llama.cpp cannot run it here, `convert_gguf` writes the float32 copy too.
`convert_gguf` dequantizes a GGUF file with transformers (float32) and checks the saved directory's logits
against the GGUF load on a fixed text (`CHECK_ATOL`). A model loaded from GGUF refuses `save_pretrained` until
its quantizer marker is cleared; the weights are plain float32 tensors by then, so clearing it loses nothing.
`convert_hf_dir` re-saves a Hugging Face directory (its stored dtype) as safetensors with its tokenizer,
checked the same way. Both refuse an architecture the cloud refuses (`shared.attention_layout`; a directory
before its weights are read, a GGUF file once loaded: transformers reads its config only by parsing the whole
header, as for its tokenizer and weights), and both finish a directory alike (`finish_dir`):

- `model.gguf` (a GGUF source only: a Hugging Face directory yields no GGUF, and the runs that want one, the
  cloud's `--runner llamacpp` and the edge's llama.cpp drafting, take the PyTorch path instead): the GGUF file,
  hard-linked when every user may read it already, else copied (a copy where linking fails too), for drafters
  that read GGUF. The source's mode is never changed: a linked file shares its inode, so it keeps its mode;
- `source.json`: what was converted (path, bytes, sha256), by which command, and the logit check;
- every file written mode 0644 and every directory 0755, so a container running as another user reads it.

Each writes into `<out>.partial` and renames it when checked: a directory named `out` is complete.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from shared.hashing import file_sha256

# The text the converted logits are checked on (any fixed text would do).
CHECK_TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""
# Largest |logit difference| accepted between the source's load and the saved directory.
CHECK_ATOL = 1e-4
# The record of what a directory was converted from (see the module docstring).
RECORD = "source.json"
# The GGUF file inside a converted directory.
GGUF_IN_DIR = "model.gguf"
GGUF_MAGIC = b"GGUF"

log = logging.getLogger(__name__)


class PrepareError(RuntimeError):
    """A one-line reason a model cannot be prepared or converted, with the fix."""


def is_prepared(out_dir: Path) -> bool:
    """True when `out_dir` already holds a converted model with its tokenizer."""
    return all((out_dir / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def sha256_of(path: Path) -> str:
    return file_sha256(path)


def size_text(n: int) -> str:
    """Bytes as the logs show them: '1.12 GB' (decimal, as pip and du -h --si do)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_gguf_file(src: Path) -> None:
    """PrepareError (one line) unless `src` is a readable file that starts like a GGUF file."""
    if not src.exists():
        raise PrepareError(f"{src} does not exist: pass a .gguf file or a Hugging Face model directory")
    with src.open("rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise PrepareError(f"{src} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r}): pass a "
                           "GGUF file or a Hugging Face model directory")


def check_architecture(config: Any, src: Path) -> None:
    """PrepareError naming the cloud's reason when it would refuse this config (shared.attention_layout)."""
    from shared.attention_layout import UnsupportedModel, attention_layout

    try:
        attention_layout(config)
    except UnsupportedModel as e:
        raise PrepareError(f"{src}: the cloud refuses this model: {e}") from None


def _needs(modules: tuple[str, ...]) -> None:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise PrepareError(f"reading GGUF needs the `{module}` package: pip install '.[models]' "
                               f"(scripts/setup.sh installs it)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def llama_cpp_refuses(src: Path) -> str | None:
    """None when this machine's llama.cpp loads `src` (the cloud's llama.cpp runner and the edge's llama.cpp drafter
    run it), else why not, in one line. The weights are memory-mapped, not read whole."""
    from shared.kvpool import UnsupportedModel
    from shared.llama_runtime import GGUFModel, unavailable

    why = unavailable()
    if why is not None:
        return why
    try:
        GGUFModel(src, repack=False)
    except UnsupportedModel as e:
        return str(e)
    return None


def convert_gguf_file(src: Path, out_dir: Path, *, command: str = "", safetensors: bool | None = None) -> Path:
    """`specsplit-models convert FILE.gguf`: `safetensors` True writes the float32 copy for PyTorch (`convert_gguf`),
    False the GGUF alone with its tokenizer and config (`convert_gguf_alone`); None picks the GGUF alone where this
    machine's llama.cpp runs the file, else the float32 copy as well, saying why."""
    check_gguf_file(src)
    if safetensors is None:
        why = llama_cpp_refuses(src)
        safetensors = why is not None
        if why is None:
            log.info("%s: llama.cpp runs it here, so no float32 copy is written (--safetensors writes one for PyTorch: "
                     "a GPU cloud, --runner torch, a PyTorch draft)", src.name)
        else:
            log.info("%s: writing float32 safetensors for PyTorch, since llama.cpp cannot run it here: %s", src.name,
                     why)
    if safetensors:
        return convert_gguf(src, out_dir, command=command)
    return convert_gguf_alone(src, out_dir, command=command)


def convert_gguf_alone(src: Path, out_dir: Path, *, command: str = "") -> Path:
    """A GGUF file into `out_dir` for llama.cpp: the file as `model.gguf` (linked or copied, `finish_dir`), the
    tokenizer and config read from its header (transformers: no weight is dequantized), after the cloud's
    architecture check and a check that the tokenizer speaks the file's own vocabulary."""
    check_gguf_file(src)
    _needs(("gguf",))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    from shared.llama_runtime import vocabulary_mismatch

    size = src.stat().st_size
    log.info("%s: reading its config and tokenizer from the header (%s; no weights are read)", src.name,
             size_text(size))
    start = time.monotonic()
    try:
        config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
        check_architecture(config, src)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    except PrepareError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged or unsupported GGUF, in one line
        raise PrepareError(f"cannot read {src} as GGUF: {_first_line(e)}") from None
    wrong = vocabulary_mismatch(src, tokenizer)
    if wrong is not None:
        raise PrepareError(f"the tokenizer read from {src} is not its own vocabulary ({wrong}); nothing was written: "
                           "report this model")
    log.info("%s: config and tokenizer read in %.0f s (model type %s, %d tokens)", src.name, time.monotonic() - start,
             config.model_type, len(tokenizer))
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {"source": {"path": str(src.resolve()), "format": "gguf", "bytes": size, "sha256": sha256_of(src)},
              "command": command, "dtype": "gguf",
              "weights": f"{GGUF_IN_DIR} alone, for llama.cpp (convert with --safetensors for PyTorch's float32 copy)"}
    finish_dir(tmp, record, src)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    log.info("prepared %s", out_dir)
    return out_dir


def convert_gguf(src: Path, out_dir: Path, *, command: str = "", sha256: str | None = None,
                 extra: dict[str, Any] | None = None) -> Path:
    """A GGUF file into a float32 Hugging Face directory at `out_dir`, checked against the GGUF load.
    `sha256`: the file's, when the caller has checked it already; `extra`: more fields for the record."""
    check_gguf_file(src)
    _needs(("gguf", "accelerate"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    size = src.stat().st_size
    # transformers parses the whole GGUF header for its config, its tokenizer and its weights alike (tens of
    # seconds for a 151,936-token vocabulary), so the architecture is checked on the loaded model's config
    # rather than on a config read once more beforehand
    log.info("%s: reading its tokenizer (%s)", src.name, size_text(size))
    start = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        log.info("%s: tokenizer read in %.0f s (%d tokens); dequantizing the weights to float32", src.name,
                 time.monotonic() - start, len(tokenizer))
        start = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - a damaged or unsupported GGUF, in one line
        raise PrepareError(f"cannot read {src} as GGUF: {_first_line(e)}") from None
    check_architecture(model.config, src)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    log.info("%s: weights loaded in %.0f s (model type %s, %.0f M parameters)", src.name, time.monotonic() - start,
             model.config.model_type, n_params / 1e6)
    # The quantizer marker only blocks saving: the weights are dequantized float32 tensors by now.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    digest = sha256 or sha256_of(src)
    record = {"source": {"path": str(src.resolve()), "format": "gguf", "bytes": size, "sha256": digest},
              "command": command, "dtype": "float32", **(extra or {})}
    return _save_checked(model, tokenizer, out_dir, record, gguf=src, dtype=torch.float32)


def convert_hf_dir(src: Path, out_dir: Path, *, command: str = "") -> Path:
    """A Hugging Face model directory into `out_dir` (its stored dtype, safetensors, its tokenizer), after
    the cloud's architecture and tokenizer checks; checked against the source's load."""
    if not src.is_dir():
        raise PrepareError(f"{src} does not exist: pass a .gguf file or a Hugging Face model directory")
    if not (src / "config.json").is_file():
        raise PrepareError(f"{src} has no config.json: not a Hugging Face model directory (or pass a .gguf file)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    from shared.attention_layout import UnsupportedModel
    from shared.tokenizer_id import load_tokenizer

    try:
        config = AutoConfig.from_pretrained(src)
    except (OSError, ValueError, KeyError) as e:
        raise PrepareError(f"cannot read the model config in {src}: {_first_line(e)}") from None
    check_architecture(config, src)
    try:
        tokenizer = load_tokenizer(src)
    except UnsupportedModel as e:
        raise PrepareError(f"{e}") from None
    files = sorted(p for p in src.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    log.info("%s: loading the model (%s in %d files, model type %s)", src, size_text(size), len(files), config.model_type)
    start = time.monotonic()
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise PrepareError(f"cannot load {src}: {_first_line(e)}") from None
    model.eval()
    log.info("%s: loaded in %.0f s (%s); the directory gets its weights as safetensors and no model.gguf (llama.cpp "
             "runs want a GGUF: convert the model's .gguf file instead)", src, time.monotonic() - start, model.dtype)
    weights = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in files
               if p.suffix in (".safetensors", ".bin", ".json", ".model", ".txt", ".jinja")}
    record = {"source": {"path": str(src.resolve()), "format": "huggingface", "bytes": size, "files": weights},
              "command": command, "dtype": str(model.dtype).removeprefix("torch.")}
    return _save_checked(model, tokenizer, out_dir, record, gguf=None, dtype=model.dtype)


def _save_checked(model: Any, tokenizer: Any, out_dir: Path, record: dict[str, Any], *, gguf: Path | None,
                  dtype: Any) -> Path:
    """Save `model` and `tokenizer` into `<out_dir>.partial`, check its logits against `model`'s, finish it
    (`finish_dir`) and rename it to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer(CHECK_TEXT, return_tensors="pt").input_ids  # [1, T]
    with torch.no_grad():
        reference = model(ids).logits  # [1, T, vocab]
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    start = time.monotonic()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model
    saved_bytes = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
    log.info("%s: saved %s in %.0f s; checking its logits", out_dir.name, size_text(saved_bytes), time.monotonic() - start)
    start = time.monotonic()
    saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
    with torch.no_grad():
        diff = (saved(ids).logits.float() - reference.float()).abs().max().item()
    del saved
    if diff > CHECK_ATOL:
        shutil.rmtree(tmp)
        raise PrepareError(f"the converted logits differ from the source's by {diff:.3g} (> {CHECK_ATOL}); "
                           "nothing was written: report this model")
    log.info("%s: max |logit diff| against the source %.3g (%.0f s)", out_dir.name, diff, time.monotonic() - start)
    record = {**record, "check": {"text": CHECK_TEXT, "max_abs_logit_diff": diff}}
    finish_dir(tmp, record, gguf)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    log.info("prepared %s", out_dir)
    return out_dir


def finish_dir(out_dir: Path, record: dict[str, Any] | None, gguf: Path | None) -> None:
    """Link `gguf` in as `model.gguf` (when given and missing), write the record (when given) and make the
    directory readable by every user."""
    if gguf is not None and not (out_dir / GGUF_IN_DIR).is_file():
        link_or_copy(gguf, out_dir / GGUF_IN_DIR)
    if record is not None:
        made = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        text = json.dumps({**record, "made": made}, indent=1) + "\n"
        (out_dir / RECORD).write_text(text)
    make_world_readable(out_dir)


def link_or_copy(src: Path, dst: Path) -> str:
    """`dst` as a hard link to `src` when every user may read `src` already (a link shares its mode, which is
    never changed here), else a copy, as where the file system refuses the link; returns which."""
    if src.stat().st_mode & 0o044 != 0o044:
        log.info("%s: %s is not readable by every user; copying it (%s) rather than linking it", dst.parent.name,
                 src, size_text(src.stat().st_size))
        shutil.copyfile(src, dst)
        return "copied"
    try:
        os.link(src, dst)
        return "linked"
    except OSError as e:
        log.info("%s: cannot hard-link %s (%s); copying it (%s)", dst.parent.name, src, e.strerror,
                 size_text(src.stat().st_size))
        shutil.copyfile(src, dst)
        return "copied"


def make_world_readable(root: Path) -> None:
    """Mode 0755 for `root` and the directories under it, 0644 for the files it wrote (safetensors writes 0600);
    a file linked in from elsewhere (more than one link) keeps its owner's mode."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        if path.is_symlink() or (path.is_file() and path.stat().st_nlink > 1):
            continue
        want = 0o755 if path.is_dir() else 0o644
        if path.stat().st_mode & 0o777 != want:
            try:
                path.chmod(want)
            except PermissionError:  # a hard link to a file another user owns (an installed wheel's GGUF)
                log.warning("%s: cannot make it readable by every user (not its owner)", path)

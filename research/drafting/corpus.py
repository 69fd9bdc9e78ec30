"""Text that ships with Python: the standard library's source, the corpus every draft here can read.

One held-out rule for every use: a file is held out when crc32(its path under the library) % 20 == 0
(~5 %, stable across versions), so `bench/prompts/code.jsonl` (scripts/make_bench_prompts.py) takes its
prompts from files no draft trained on. The demo pair trains on the rest; the drafts of SmolLM2 read
chunks of it, and its docstrings as answers to "What does `module.name` do?".
"""

from __future__ import annotations

import ast
import random
import sysconfig
import zlib
from pathlib import Path
from typing import Any

HELD_OUT_MODULUS = 20  # a file is held out when crc32(relative path) % 20 == 0 (~5%)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str) -> bool:
    """True for the ~5% of stdlib files kept out of training (stable: hashes the path)."""
    return zlib.crc32(rel_path.encode()) % HELD_OUT_MODULUS == 0


def stdlib_files(top_level: bool = False, tests: bool = True) -> tuple[list[Path], list[Path]]:
    """(train, held_out) lists of the standard library's .py files, site-packages excluded; only the
    top-level modules with `top_level`, and without test packages (a first path part naming a test)
    unless `tests`."""
    root = stdlib_root()
    train: list[Path] = []
    held: list[Path] = []
    for path in sorted(root.glob("*.py") if top_level else root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel or (not tests and "test" in rel.split("/")[0]):
            continue
        (held if is_held_out(rel) else train).append(path)
    return train, held


def read_text(path: Path) -> str:
    """The file's text, or "" when it is not UTF-8 or cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def text_chunks(tok: Any, files: list[Path], width: int, stride: int, limit: int, seed: int) -> list[list[int]]:
    """At most `limit` chunks of `width` token ids, every `stride` ids of each file, files in an order
    shuffled with `seed`."""
    files = list(files)
    random.Random(seed).shuffle(files)
    chunks: list[list[int]] = []
    for f in files:
        text = read_text(f)
        if text:
            ids = tok(text).input_ids
            chunks.extend(ids[o:o + width] for o in range(0, len(ids) - width + 1, stride))
        if len(chunks) >= limit:
            break
    return chunks[:limit]


def stdlib_docstrings(limit: int) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the top-level training modules' public classes and functions
    documented in 200 characters or more, in a seeded order."""
    out: list[tuple[str, str]] = []
    for path in stdlib_files(top_level=True)[0]:
        try:
            tree = ast.parse(read_text(path))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    out.append((f"{path.stem}.{node.name}", doc))
    random.Random(2).shuffle(out)
    return out[:limit]

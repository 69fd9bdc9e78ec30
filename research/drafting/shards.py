"""Shards of the head's training data: small gzipped JSON-lines files of token ids, committed to git.

Ids are all that is kept (a few bytes a token): the target's states are recomputed from them by one
teacher-forced forward per sequence, which costs minutes where generating them cost hours. One file per
shard, written to a temporary name and renamed, so a stopped run never leaves half a shard behind.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[2] / "data" / "head"


def shard_path(root: Path, kind: str, index: int) -> Path:
    """`root/kind/00042.jsonl.gz`."""
    return root / kind / f"{index:05d}.jsonl.gz"


def write_shard(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write `rows` atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def read_shard(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def shard_indices(root: Path, kind: str) -> list[int]:
    """The indices of the complete shards of `kind`, ascending."""
    d = root / kind
    return sorted(int(p.name.split(".")[0]) for p in d.glob("*.jsonl.gz")) if d.is_dir() else []


def iter_rows(root: Path, kind: str) -> Iterator[dict[str, Any]]:
    for i in shard_indices(root, kind):
        yield from read_shard(shard_path(root, kind, i))

"""What training may never contain: any word 8-gram of an evaluation prompt.

Evaluation texts: the real-pair bench's chat prompts (`bench/real_pair.py`), the benchmark prompt files
(`bench/prompts/*.jsonl`), the committed Spec-Bench subset (`bench/specbench/questions.jsonl`), and, when
given, Spec-Bench's whole question file (every turn of every question). A request or answer that shares
an 8-gram with any of them is dropped before it is stored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
N = 8
_WORD = re.compile(r"[a-z0-9]+")


def ngrams(text: str, n: int = N) -> set[tuple[str, ...]]:
    """Lower-cased word n-grams of `text` (punctuation and case ignored)."""
    w = _WORD.findall(text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def _jsonl_texts(path: Path) -> Iterable[str]:
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for key in ("prompt", "text", "question"):
            if isinstance(row.get(key), str):
                yield row[key]
        yield from row.get("turns", [])


def evaluation_texts(specbench_file: Path | None = None) -> list[str]:
    """Every evaluation prompt this repository measures on (see the module docstring)."""
    from bench.real_pair import PROMPTS
    texts = list(PROMPTS)
    for path in sorted((REPO / "bench" / "prompts").glob("*.jsonl")):
        texts.extend(_jsonl_texts(path))
    subset = REPO / "bench" / "specbench" / "questions.jsonl"
    if subset.exists():
        texts.extend(_jsonl_texts(subset))
    if specbench_file is not None:
        texts.extend(_jsonl_texts(specbench_file))
    return texts


class HeldOut:
    """The set of evaluation 8-grams; `clean(text)` is True when `text` shares none."""

    def __init__(self, texts: Iterable[str]):
        self.grams: set[tuple[str, ...]] = set()
        for t in texts:
            self.grams |= ngrams(t)

    def clean(self, text: str) -> bool:
        return self.grams.isdisjoint(ngrams(text))

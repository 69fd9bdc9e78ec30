"""`specsplit-bench --only tp`: the ranks' memory lines are read back, and the section renders and splices."""

from __future__ import annotations

import json
from pathlib import Path

from bench.tensor_parallel import END, START, rank_memory, render, splice_tp


def test_rank_memory_reads_every_ranks_line() -> None:
    lines = [json.dumps({"msg": "x", "event": "rank_memory", "rank": r, "weight_bytes": 100 + r,
                         "kv_bytes_per_token": 8}) for r in (0, 1)]
    text = "W1124 torchrun noise\n" + "\n".join(lines) + '\n{"msg": "serving"}\n'
    assert rank_memory(text) == {0: {"weight_bytes": 100, "kv_bytes_per_token": 8},
                                 1: {"weight_bytes": 101, "kv_bytes_per_token": 8}}


def test_section_names_refusals_and_ratios_and_is_spliced_in_place(tmp_path: Path) -> None:
    rows = [{"target": "x", "ranks": 1, "weight_bytes": 4 << 20, "kv_bytes": 1 << 20, "cloud_only_tokens_per_s": 10.0,
             "speculative_tokens_per_s": 12.0},
            {"target": "x", "ranks": 2, "refused": "9 attention heads and 3 KV heads do not split over 2 ranks"},
            {"target": "x", "ranks": 3, "weight_bytes": 1.5 * (1 << 20), "kv_bytes": (1 << 20) / 3,
             "cloud_only_tokens_per_s": 5.0, "speculative_tokens_per_s": 6.0},
            {"target": "twin", "ranks": 1, "weight_bytes": 8 << 20, "kv_bytes": 2 << 20,
             "cloud_only_tokens_per_s": 10.0, "speculative_tokens_per_s": 12.0},
            {"target": "twin", "ranks": 2, "weight_bytes": 4 << 20, "kv_bytes": 1 << 20,
             "cloud_only_tokens_per_s": 10.0, "speculative_tokens_per_s": 12.0}]
    text = render(rows, "specsplit-bench --only tp", 64, "load 1.0")
    assert "| x | 2 | refused: 9 attention heads" in text and "| x | 3 | 1.5 MiB | 0.38 |" in text
    assert "| 0.33 |" in text and "| twin | 2 | 4.0 MiB | 0.50 | 1.00 MiB | 0.50 |" in text  # each against its own N = 1
    assert "above 1/N" in text  # x at 3 ranks holds 0.38 > 1/3
    assert "2 CPU cores" in text and "unmeasured" in text
    out = tmp_path / "B.md"
    out.write_text("# Report\n\nbefore\n")
    splice_tp(text, out)
    splice_tp(text.replace("load 1.0", "load 2.0"), out)
    body = out.read_text()
    assert body.count(START) == 1 and body.count(END) == 1 and "load 2.0" in body and body.startswith("# Report")

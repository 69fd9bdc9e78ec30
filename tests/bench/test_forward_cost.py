"""The forward-cost section renders what was measured: every variant's row, ratios to its own one-token forward,
invariance's cost and bfloat16 against float32 (no model is loaded)."""

from __future__ import annotations

from bench.forward_cost import END, NEW, SESSIONS, START, VARIANTS, render


def fake(scale: float, tile: int) -> dict[str, float]:
    r = {f"new{n}": scale * (1 + n / 64) for n in NEW}
    r.update({"tree16": scale * 1.3, "tile": float(tile)})
    r.update({f"decode{s}": scale * (1 + s / 16) for s in SESSIONS})
    r.update({f"chain{s}": scale * (1 + s / 4) for s in SESSIONS})
    return r


def test_the_section_has_every_variant_and_the_ratios() -> None:
    by = {v: fake(100.0 if v[0] == "float32" else 50.0, (4 if v[0] == "float32" else 2) if v[1] else 0)
          for v in VARIANTS}
    text = render({"coder": by}, "specsplit-bench --only forward-cost", 1, "load 0.1")
    assert text.startswith(START) and text.endswith(END)
    for dtype, inv in VARIANTS:
        assert f"| {dtype} {'invariant' if inv else 'plain'} | " in text
    assert "Invariance's cost in bfloat16 (invariant / plain): 1 new 1.00x" in text
    assert "bfloat16 against float32, both invariant (bfloat16 / float32): 1 new 0.50x" in text
    assert "Qwen2.5-Coder-1.5B-Instruct bfloat16 2" in text and "float32 4" in text

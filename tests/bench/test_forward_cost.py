"""The forward-cost section renders what was measured: every variant's row (dtype, invariant or plain, executor),
ratios to its own one-token forward, invariance's cost, bfloat16 against float32 and the cloud's own forward against
transformers' modules (no model is loaded); an unknown variant is refused with the list."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.forward_cost import END, NEW, SESSIONS, START, VARIANTS, render, run


def fake(scale: float, tile: int) -> dict[str, float]:
    r = {f"new{n}": scale * (1 + n / 64) for n in NEW}
    r.update({"tree16": scale * 1.3, "tile": float(tile)})
    r.update({f"decode{s}": scale * (1 + s / 16) for s in SESSIONS})
    r.update({f"chain{s}": scale * (1 + s / 4) for s in SESSIONS})
    return r


def test_the_section_has_every_variant_and_the_ratios() -> None:
    by = {v: fake((100.0 if v[0] == "float32" else 50.0) * (0.8 if v[2] == "eager" else 1.0),
                  (4 if v[0] == "float32" else 2) if v[1] else 0)
          for v in VARIANTS.values()}
    text = render({"coder": by}, "specsplit-bench --only forward-cost", 1, "load 0.1")
    assert text.startswith(START) and text.endswith(END)
    for dtype, inv, ex in VARIANTS.values():
        assert f"| {dtype} {'invariant' if inv else 'plain'} {ex} | " in text
    assert "Invariance's cost in bfloat16 (invariant / plain): 1 new 1.00x" in text
    assert "bfloat16 against float32, both invariant (bfloat16 / float32): 1 new 0.50x" in text
    assert "(eager / transformers): 1 new 0.80x" in text
    assert "Qwen2.5-Coder-1.5B-Instruct bfloat16 eager 2" in text and "float32 transformers 4" in text


def test_an_unknown_variant_is_refused_naming_the_choices(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.forward_cost as fc

    monkeypatch.setitem(fc.MODELS, "coder", tmp_path)  # a model folder that "exists"
    (tmp_path / "config.json").write_text("{}")
    assert run(tmp_path / "B.md", "cmd", ("coder",), 1, ("float32-invariant-graphs",)) == 2
    assert "float32-invariant-eager" in capsys.readouterr().out and not (tmp_path / "B.md").exists()

"""The dtype benchmark's section (bench/defaults_by_dtype.py): the setting, each aim marked, text equality shown."""

from __future__ import annotations

from bench.defaults_by_dtype import END, START, prompt_sets, render


def test_the_section_marks_each_aim_and_counts_equal_texts() -> None:
    rows = [{"dtype": "float32", "prompts": "chat", "n": 8, "cloud_only": 20.0, "defaults": 30.0,
             "tokens_per_verify": 2.4, "streamed": 5, "equal": 8},
            {"dtype": "bfloat16", "prompts": "Spec-Bench", "n": 30, "cloud_only": 25.0, "defaults": 30.0,
             "tokens_per_verify": 2.1, "streamed": 0, "equal": 29}]
    machine = {"cpu": "AMD EPYC", "amx_bf16": False, "avx512_bf16": True, "load_start": 0.2, "load_end": 1.1}
    text = render(rows, "python -m bench.defaults_by_dtype", machine, 64, 7.0)
    assert text.startswith(START) and text.endswith(END)
    for needed in ("AMD EPYC (amx_bf16 absent, avx512_bf16 present)", "load average 0.20 at the start, 1.10 at the end",
                   "GPU figures are unmeasured", "`python -m bench.defaults_by_dtype` (7 minutes)"):
        assert needed in text, needed
    assert "| float32 | chat (8) | 20.00 | 30.00 | **1.50x** (aim >= 1.6x: missed) | 2.40 | 5 | 8 of 8 |" in text
    assert "| bfloat16 | Spec-Bench (30) | 25.00 | 30.00 | **1.20x** (aim >= 1.3x: missed) | 2.10 | 0 | 29 of 30 |" in text


def test_the_prompt_sets_are_the_real_pair_chat_prompts_and_the_spec_bench_first_turns() -> None:
    sets = prompt_sets()
    assert len(sets["chat"]) == 8 and len(sets["Spec-Bench"]) >= 6
    assert all(isinstance(t, str) and t for ts in sets.values() for t in ts)

"""The coder-pair benchmark's pure parts (bench/coder_pair.py): prompts, the rendered section, the splice, the
licence; no model is loaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from bench import coder_pair
from bench.coder_pair import (
    END,
    START,
    humaneval_message,
    humaneval_prompts,
    render,
    specbench_groups,
    splice_section,
)


def fake_result(speedup0: float = 2.5) -> dict[str, Any]:
    def e2e(rtt: int, base: float, spec: float) -> list[dict[str, Any]]:
        return [{"rtt_ms": rtt, "mode": "cloud_only", "tokens_per_s": base, "tokens_per_verify": 0.0, "streamed": 0,
                 "switches": 0},
                {"rtt_ms": rtt, "mode": "speculative", "tokens_per_s": spec, "tokens_per_verify": 6.4, "streamed": 3,
                 "switches": 1}]

    return {
        "command": "specsplit-bench --only coder-pair", "prompts": 6, "new_tokens": 96, "total_s": 1200.0,
        "dtype": "bfloat16", "dtype_note": "", "draft_ms": 31.5,
        "machine": {"cpu": "AMD EPYC", "amx_bf16": False, "avx512_bf16": True, "load_start": 0.1, "load_end": 1.9,
                    "pinned": True},
        "fixed": [{"shape": f"chain k = {k}", "tokens_per_verify": 3.0 + k / 4, "by_position": [0.9, 0.8],
                   "nodes_per_round": float(k)} for k in coder_pair.KS]
                 + [{"shape": "trees (auto)", "tokens_per_verify": 6.2, "by_position": [0.91, 0.85, 0.8],
                     "nodes_per_round": 17.5}],
        "sampled": {"tokens_per_verify": 3.1, "equal": 6, "prompts": 6},
        "specbench": [{"category": "coding", "questions": 1, "tokens_per_verify": 5.5, "streamed": 0},
                      {"category": "qa", "questions": 1, "tokens_per_verify": 3.25, "streamed": 4}],
        "e2e": e2e(0, 2.0, 2.0 * speedup0) + e2e(50, 1.9, 3.2) + e2e(100, 1.9, 1.7),
        "cpu": [{"mode": "cloud_only", "sessions": 1, "cpu_s_per_token": 0.6},
                {"mode": "speculative", "sessions": 1, "cpu_s_per_token": 0.15},
                {"mode": "cloud_only", "sessions": 4, "cpu_s_per_token": 0.3, "replayed": True, "p50_ms": 900.0,
                 "mismatches": 0, "errors": 0},
                {"mode": "speculative", "sessions": 4, "cpu_s_per_token": 0.2, "replayed": True, "p50_ms": 1200.0,
                 "mismatches": 1, "errors": 0},
                {"mode": "cloud_only", "sessions": 16, "cpu_s_per_token": 0.2, "replayed": True, "p50_ms": 1500.0,
                 "mismatches": 0, "errors": 0},
                {"mode": "speculative", "sessions": 16, "cpu_s_per_token": 0.125, "replayed": True, "p50_ms": 2500.0,
                 "mismatches": 0, "errors": 2}],
        "draft_costs": {"float32": {"token_ms": 90.0, "tree_ms": 1150.0},
                        "bfloat16": {"token_ms": 77.0, "tree_ms": 760.0}},
        "draft_dtype": "bfloat16",
        "rss_mb": {"edge": 2600.0, "edge_peak": 2900.0, "cloud": 3500.0, "cloud_peak": 3900.0},
    }


def test_the_section_states_the_setting_and_marks_each_aim() -> None:
    text = render(fake_result())
    assert text.startswith(START) and text.endswith(END)
    for needed in ("`specsplit-bench --only coder-pair`", "AMD EPYC", "amx_bf16 absent", "avx512_bf16 present",
                   "load average 0.10 at the start, 1.90 at the end", "one core", "2-core machine",
                   "GPU figures are unmeasured", "dtype bfloat16", "31.5 ms per token"):
        assert needed in text, needed
    assert "**6.20** (aim >= 6: met)" in text  # trees (auto), greedy
    assert "**0.910** (aim >= 0.88: met)" in text  # their first position
    assert "**3.10** (aim >= 3.5: missed)" in text  # T = 0.7
    assert "**6 of 6**" in text
    assert "**2.50x** (aim >= 2x: met)" in text and "**0.89x** (aim >= 1x: missed)" in text
    assert "**4.00x** (aim >= 3x: met)" in text  # CPU: one live session, with its aim
    assert "| 4 | 0.300 | 0.200 | **1.50x** | 1200 | 1 | 0 |" in text  # replayed, 4 sessions: no aim
    assert "| 16 | 0.200 | 0.125 | **1.60x** (aim >= 2x: missed) | 2500 | 0 | 2 |" in text
    assert "| bfloat16 | 77.0 | 760 |" in text and "as the edge loads it (bfloat16)" in text
    assert "| coding | 1 | **5.50** | 0 |" in text


def test_the_section_replaces_only_its_own_markers(tmp_path: Path) -> None:
    out = tmp_path / "B.md"
    out.write_text("# B\n\n<!-- real-pair:start -->\nreal\n<!-- real-pair:end -->\n")
    splice_section(render(fake_result(2.5)), out)
    splice_section(render(fake_result(1.5)), out)
    text = out.read_text()
    assert text.count(START) == 1 and "<!-- real-pair:start -->\nreal\n<!-- real-pair:end -->" in text
    assert "**1.50x** (aim >= 2x: missed)" in text and "2.50x" not in text


def test_humaneval_prompts_load_in_file_order_as_chat_messages() -> None:
    rows = humaneval_prompts(20)
    assert [r["task_id"] for r in rows] == [f"HumanEval/{i}" for i in range(20)]
    assert humaneval_prompts(3) == rows[:3]
    assert rows[0]["prompt"].startswith("from typing import List\n\n\ndef has_close_elements(")
    msg = humaneval_message(rows[0]["prompt"])
    assert msg.startswith("Complete this Python function:\n```python\nfrom typing") and msg.endswith('"""\n```')


def test_the_humaneval_licence_and_source_are_recorded() -> None:
    readme = (coder_pair.HUMANEVAL.parent / "README.md").read_text()
    assert "https://github.com/openai/human-eval" in readme and "6d43fb980f9fee3c892a914eda09951f772ad10d" in readme
    assert "The MIT License" in readme and "Copyright (c) OpenAI" in readme


def test_specbench_groups_put_coding_first_apart_from_the_rest_of_mt_bench() -> None:
    groups = specbench_groups(1)
    assert list(groups)[0] == "coding" and "mt_bench (not coding)" in groups and "mt_bench" not in groups
    assert all(len(t) == 1 for t in groups.values()) and len(groups) == 7
    assert sum(map(len, specbench_groups(5).values())) == 30


def test_process_counters_read_this_process() -> None:
    assert coder_pair.cpu_seconds(os.getpid()) > 0
    assert coder_pair.rss_mb() > 10 and coder_pair.rss_mb(key="VmHWM") >= coder_pair.rss_mb() * 0.5


def test_a_missing_pair_names_the_prepare_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(coder_pair, "TARGET", tmp_path / "absent")
    assert coder_pair.run(tmp_path / "B.md", "cmd") == 2
    assert "specsplit-models prepare qwen-coder" in capsys.readouterr().out
    assert not (tmp_path / "B.md").exists()


def test_the_cli_takes_the_coder_pair_flags() -> None:
    from bench.run import build_parser

    args = build_parser().parse_args(["--only", "coder-pair", "--coder-prompts", "1", "--coder-new-tokens", "8",
                                      "--coder-sessions", "1,4", "--coder-dtype", "bfloat16"])
    assert (args.only, args.coder_prompts, args.coder_new_tokens, args.coder_sessions, args.coder_dtype) == (
        "coder-pair", 1, 8, "1,4", "bfloat16")
    assert build_parser().parse_args(["--only", "coder-pair"]).coder_dtype == "auto"


class FakeClient:
    """Answers each prompt with fixed metrics: 10 tokens, 2 of them streamed, 2 verify calls of 8 nodes."""

    def generate(self, ids: list[int]) -> Any:
        from types import SimpleNamespace

        m = SimpleNamespace(emitted=10, streamed=2, verify_calls=2, drafted=16, accepted=6, switches=1,
                            position_drafted=[2, 2], position_accepted=[2, 1], wall_ms=1100.0, ttft_ms=200.0,
                            start_way="speculate", start_note="cheaper")
        return SimpleNamespace(token_ids=list(range(10)), metrics=m)


def test_tally_and_summary_leave_streamed_tokens_out_of_tokens_per_verify() -> None:
    t = coder_pair.tally(FakeClient(), [[1, 2], [3]])
    r = coder_pair.summary(t, shape="x")
    assert r["shape"] == "x" and r["tokens_per_verify"] == (20 - 4) / 4 and r["streamed"] == 4 and r["switches"] == 2
    assert r["by_position"] == [1.0, 0.5] and r["nodes_per_round"] == 8 and r["acceptance"] == 6 / 16
    assert t["starts"] == [("speculate", "cheaper")] * 2  # each session's first decision, for stream-switch
    assert r["tokens_per_s"] == pytest.approx(18 / 1800 * 1000) and t["texts"] == [list(range(10))] * 2
    assert coder_pair.summary({**t, "verify": 0})["tokens_per_verify"] is None

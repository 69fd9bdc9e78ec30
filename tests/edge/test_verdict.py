"""The demo's verdict (edge/verdict.py): chosen by the run's own figures, and read from a real cloud."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from edge.verdict import Run, cloud_cpu_seconds, verdict, verify_steps
from tests.server import CloudProcess

REPO = Path(__file__).resolve().parents[2]


def test_verify_cost_in_steps_comes_from_the_cloud_fit() -> None:
    cost = {"base_ms": 10.0, "row_ms": 90.0, "forwards": 50}
    assert verify_steps(cost, 8) == (10 + 90 * 9) / 100
    assert verify_steps({**cost, "forwards": 3}, 8) is None  # not fitted yet: said so, not guessed


def test_the_sentence_follows_the_figures() -> None:
    alone = Run(rate=10.0, tokens=100, cloud_cpu_s=10.0)  # 0.1 CPU-s a token
    slower_cheaper = verdict(Run(8.0, 100, 4.0), alone, 8, 7.8, "cpu")
    assert "pays here for cloud capacity" in slower_cheaper and "not one user's speed" in slower_cheaper
    assert "a verify of 8 costs 7.8 steps" in slower_cheaper and "on a GPU" in slower_cheaper
    faster = verdict(Run(20.0, 100, 4.0), alone, 4, 1.1, "cuda")
    assert faster.startswith("speculation pays here for this user's speed (2.00x), and for cloud capacity")
    neither = verdict(Run(8.0, 100, 12.0), alone, 8, 7.8, "cpu")
    assert "pays for neither" in neither
    unknown = verdict(Run(8.0, 100, None), alone, 8, None, "cpu")
    assert "not measured yet" in unknown and "cloud CPU unknown" in unknown


def test_generate_against_cloud_only_prints_the_verdict(tiny_pair: tuple[Path, Path]) -> None:
    """A real cloud and `specsplit-edge generate --against-cloud-only`: the decode line, then the sentence with
    this cloud's figures; the cloud's CPU-seconds are read from its /metrics."""
    target, draft = tiny_pair
    with CloudProcess(target) as cloud:
        assert (cloud_cpu_seconds(cloud.http_url) or 0) > 0
        p = subprocess.run([sys.executable, "-m", "edge.cli", "generate", "Hello", "--cloud", cloud.http_url,
                            "--draft", str(draft), "--temperature", "0", "--max-new-tokens", "24",
                            "--against-cloud-only"], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert lines[-2].startswith("decode: ")
    assert "cloud CPU-s a token" in lines[-1] and "verify of" in lines[-1], lines[-1]
